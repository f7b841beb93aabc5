"""Incremental data: a corpus that grew re-tokenizes only its new files, the packed dataset is the one a cold
build makes (same fingerprint, same arrays). In a flow, the files to tokenize run as mapped Prefect tasks:
tests/test_continue_flow.py. The timing goal (<= 5% of the cold data stage) is benchmarks/incremental_data.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stdlib_corpus import copy_modules
from tasks.data import tokens
from tasks.dataset import build_dataset, plan_tokenization
from tasks.tokenize import train_tokenizer

FILES = ["textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "colorsys.py", "heapq.py", "keyword.py"]
SEQ_LEN = 32


def _corpus(root: Path, names: list[str]) -> Path:
    copy_modules(root, names)
    return root


def _entries() -> dict[Path, int]:
    """Every token cache file, with its modification time."""
    root = tokens.tokens_dir()
    return {p: p.stat().st_mtime_ns for p in root.rglob("*.bin")} if root.exists() else {}


def _arrays(directory: str) -> tuple[bytes, bytes]:
    return tuple(np.load(Path(directory) / f"{s}.npy").tobytes() for s in ("train", "val"))  # type: ignore[return-value]


def test_a_grown_corpus_tokenizes_only_its_new_files_and_packs_what_a_cold_build_packs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = _corpus(tmp_path / "corpus", FILES[:-1])
    tokenizer = train_tokenizer(str(corpus), 300)
    options = {"val_fraction": 0.2}
    before = _entries()
    first = build_dataset(str(corpus), tokenizer, SEQ_LEN, **options)
    cached = {p: t for p, t in _entries().items() if p not in before}
    assert len(cached) == len(FILES) - 1  # one entry per file

    _corpus(corpus, FILES[-1:])  # the corpus grew by one file
    (shard,) = plan_tokenization(str(corpus), tokenizer, SEQ_LEN, **options)
    assert [p.relpath for p in shard.parts] == [FILES[-1]]
    grown = build_dataset(str(corpus), tokenizer, SEQ_LEN, **options)
    after = _entries()
    assert {p: after[p] for p in cached} == cached  # the old files' tokens were not written again
    assert len(set(after) - set(before)) == len(FILES)
    assert grown.fingerprint != first.fingerprint

    # The same corpus built cold, in an empty home: the same dataset, byte for byte.
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "cold-home"))
    cold = build_dataset(
        str(corpus), train_tokenizer(str(_corpus(tmp_path / "c0", FILES[:-1])), 300), SEQ_LEN, **options
    )
    assert cold.fingerprint == grown.fingerprint and _arrays(cold.path) == _arrays(grown.path)
    assert cold.stats["tokens"] == grown.stats["tokens"] and cold.stats["documents"] == len(FILES)
