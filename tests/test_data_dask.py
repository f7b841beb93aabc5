"""The tokenization map on a Dask cluster (tasks/prepare_data.py, prefect-dask): a local cluster of two worker
processes builds the dataset the threads runner builds (same fingerprint, same arrays), the shards tokenized
in the workers, not in this process; a worker's output that does not reach the flow's token cache fails the
flow, and so does a worker with another LLAMAFLOW_HOME."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.context import get_run_context

from stdlib_corpus import MODULES, copy_modules
from tasks import prepare_data
from tasks.data import tokens
from tasks.data.counts import ShardReport
from tasks.data.errors import DataError
from tasks.data.settings import DataSettings
from tasks.dataset import plan_tokenization
from tasks.prepare_data import build_data, tokenize_shards
from tasks.refs import DatasetRef, TokenizerRef
from tasks.tokenize import train_tokenizer

SEQ_LEN = 32
FILES = MODULES[:7]


@flow
def _build(data: DataSettings, tokenizer: TokenizerRef) -> tuple[DatasetRef, list[ShardReport], str]:
    shards = plan_tokenization(data, tokenizer, SEQ_LEN)
    ran = tokenize_shards(shards, data)
    return build_data(data, tokenizer, SEQ_LEN, seed=0), ran, str(get_run_context().flow_run.id)


def _recorded_shard_runs(flow_run_id: str, expected: int) -> int:
    """tokenize_shard runs this flow run's API recorded as completed (recorded from events: 30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
        done = sum(
            r.name.startswith("tokenize_shard") and r.state is not None and r.state.is_completed()
            for r in runs
        )
        if done >= expected or time.monotonic() > deadline:
            return done
        time.sleep(0.5)


def test_a_local_dask_cluster_of_two_processes_builds_what_the_threads_runner_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = tmp_path / "corpus"
    copy_modules(corpus, FILES)
    monkeypatch.setattr(tokens, "SHARD_BYTES", 16 << 10)  # several shards for the workers to share
    monkeypatch.setenv("LLAMAFLOW_PROGRESS_SECONDS", "0")  # a progress line per shard done
    flow_log = logging.getLogger("prefect.flow_runs")
    flow_log.addHandler(caplog.handler)
    built, progress = {}, {}
    try:
        for runner in ("threads", "dask"):
            monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / runner))  # each tokenizes from an empty cache
            tokenizer = train_tokenizer(str(corpus), 300, val_fraction=0.2)
            settings = DataSettings(data=str(corpus), val_fraction=0.2, task_runner=runner)
            caplog.clear()
            built[runner] = _build(settings, tokenizer)
            progress[runner] = [
                r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizing: ")
            ]
    finally:
        flow_log.removeHandler(caplog.handler)
    for runner, lines in progress.items():  # the mapped shards' progress, in the flow's log
        assert len(lines) >= 2 and "(100%)" in lines[-1] and "B/s, ETA 00:00" in lines[-1], (runner, lines)
    (threads, by_threads, _), (dask, by_dask, dask_run) = built["threads"], built["dask"]
    assert len(by_dask) == len(by_threads) >= 2
    assert {r.pid for r in by_threads} == {os.getpid()}
    # A thread per core at most, not one per shard (a check where there are more shards than cores: here).
    assert len({r.thread for r in by_threads}) <= min(os.cpu_count() or 1, len(by_threads))
    assert os.getpid() not in {r.pid for r in by_dask}
    assert _recorded_shard_runs(dask_run, len(by_dask)) == len(
        by_dask
    )  # the workers report to the flow's API
    assert dask.fingerprint == threads.fingerprint
    for split in ("train", "val"):
        np.testing.assert_array_equal(
            np.load(Path(dask.path) / f"{split}.npy"), np.load(Path(threads.path) / f"{split}.npy")
        )


@flow
def _build_only(data: DataSettings, tokenizer: TokenizerRef) -> DatasetRef:
    return build_data(data, tokenizer, SEQ_LEN, seed=0)


def test_a_worker_output_lost_before_the_flow_reads_it_fails_the_flow_naming_llamaflow_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus"
    copy_modules(corpus, FILES)
    monkeypatch.setattr(tokens, "SHARD_BYTES", 16 << 10)
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "home"))
    tokenizer = train_tokenizer(str(corpus), 300, val_fraction=0.2)
    settings = DataSettings(data=str(corpus), val_fraction=0.2, task_runner="dask", dask_workers=1)

    def discarding(shards: list[tokens.TokenShard], data: DataSettings) -> list[ShardReport]:
        reports = mapped(shards, data)
        for part in shards[0].parts:  # the first shard's output is lost on its way to the flow's cache
            key = tokens.part_key(part, shards[0].tokenizer, shards[0].add_bos, shards[0].dtype)
            for path in tokens.entry_paths(key):
                Path(path).unlink()
        return reports

    mapped = prepare_data.tokenize_shards
    monkeypatch.setattr(prepare_data, "tokenize_shards", discarding)
    with pytest.raises(DataError, match=r"not in this process's token cache .* share LLAMAFLOW_HOME="):
        _build_only(settings, tokenizer)


def test_a_worker_with_another_llamaflow_home_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a Dask worker runs (`tokenize_shard`), in a process whose LLAMAFLOW_HOME is not the planner's."""
    corpus = tmp_path / "corpus"
    copy_modules(corpus, FILES[:3])
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "flow-home"))
    tokenizer = train_tokenizer(str(corpus), 300, val_fraction=0.2)
    shards = plan_tokenization(DataSettings(data=str(corpus), val_fraction=0.2), tokenizer, SEQ_LEN)
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "worker-home"))
    with pytest.raises(
        DataError, match=r"worker's LLAMAFLOW_HOME is .*worker-home.* Set LLAMAFLOW_HOME=.*flow-home"
    ):
        tokens.tokenize_shard(shards[0])
    assert not (tmp_path / "worker-home" / "cache" / "tokens").exists()
