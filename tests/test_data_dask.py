"""The tokenization map on a Dask cluster (tasks/prepare_data.py, prefect-dask): a local cluster of two worker
processes builds the dataset the threads runner builds (same fingerprint, same arrays), the shards tokenized
in the workers, not in this process."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from prefect import flow

from stdlib_corpus import MODULES, copy_modules
from tasks.data import tokens
from tasks.data.settings import DataSettings
from tasks.dataset import plan_tokenization
from tasks.prepare_data import build_data, tokenize_shards
from tasks.refs import DatasetRef, TokenizerRef
from tasks.tokenize import train_tokenizer

SEQ_LEN = 32
FILES = MODULES[:7]


@flow
def _build(data: DataSettings, tokenizer: TokenizerRef) -> tuple[DatasetRef, list[dict[str, float]]]:
    shards = plan_tokenization(data, tokenizer, SEQ_LEN)
    ran = tokenize_shards(shards, data)
    return build_data(data, tokenizer, SEQ_LEN, seed=0), ran


def test_a_local_dask_cluster_of_two_processes_builds_what_the_threads_runner_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus"
    copy_modules(corpus, FILES)
    monkeypatch.setattr(tokens, "SHARD_BYTES", 16 << 10)  # several shards for the workers to share
    built = {}
    for runner in ("threads", "dask"):
        monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / runner))  # each tokenizes from an empty cache
        tokenizer = train_tokenizer(str(corpus), 300, val_fraction=0.2)
        settings = DataSettings(data=str(corpus), val_fraction=0.2, task_runner=runner)
        built[runner] = _build(settings, tokenizer)
    (threads, by_threads), (dask, by_dask) = built["threads"], built["dask"]
    assert len(by_dask) == len(by_threads) >= 2
    assert {int(r["pid"]) for r in by_threads} == {os.getpid()}
    assert os.getpid() not in {int(r["pid"]) for r in by_dask}
    assert dask.fingerprint == threads.fingerprint
    for split in ("train", "val"):
        np.testing.assert_array_equal(
            np.load(Path(dask.path) / f"{split}.npy"), np.load(Path(threads.path) / f"{split}.npy")
        )
