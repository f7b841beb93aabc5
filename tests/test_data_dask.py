"""The tokenization map on a Dask cluster (tasks/prepare_data.py, prefect-dask): a local cluster of two worker
processes builds the dataset the threads runner builds (same fingerprint, same arrays), the shards tokenized
in the workers, not in this process."""

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
from tasks.data import tokens
from tasks.data.counts import ShardReport
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
