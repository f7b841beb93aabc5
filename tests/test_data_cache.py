"""One budget for the data caches (tasks/data/cache_budget.py, `python -m flows.cache`, `cache_max_size`):
token entries, packed datasets, tokenizers and the datasets cache shown and pruned least recently used first,
broken entries shown and always pruned, and never what a run holds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prefect import flow

from flows import cache as cache_cli
from stdlib_corpus import MODULES, copy_modules
from tasks.data import cache_budget, token_store
from tasks.data.cache import build_lock
from tasks.data.corpus import DataError
from tasks.data.settings import DataSettings, as_settings
from tasks.dataset import build_dataset
from tasks.prepare_data import build_data
from tasks.refs import DatasetRef, TokenizerRef
from tasks.tokenize import train_tokenizer

SEQ_LEN = 16


def _age(path: Path, days: float) -> None:
    then = time.time() - days * 86400
    os.utime(path, (then, then))


@pytest.fixture()
def built(home: Path, tmp_path: Path) -> tuple[Path, TokenizerRef, DatasetRef]:
    corpus = tmp_path / "corpus"
    copy_modules(corpus, MODULES[:6])
    tokenizer = train_tokenizer(str(corpus), 300, val_fraction=0.2)
    return corpus, tokenizer, build_dataset(str(corpus), tokenizer, SEQ_LEN, val_fraction=0.2)


def test_show_lists_every_kind_and_a_broken_token_entry_is_shown_and_pruned(
    built: tuple[Path, TokenizerRef, DatasetRef], capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, _, dataset = built
    entries = token_store.entries()
    Path(entries[0].data).unlink()  # a .json without its .bin
    assert cache_cli.main(["show"]) == 0
    out = capsys.readouterr().out
    assert f"tokens: {len(entries)} entries" in out and "1 broken" in out
    assert "datasets: 1 entries" in out and "tokenizers: 1 entries" in out and "hf-datasets:" in out
    assert f"{Path(dataset.path).name[:12]} {corpus}" in out  # a dataset is shown with its corpus
    assert cache_cli.main(["prune", "--older-than", "30"]) == 0  # nothing is old: only the broken entry goes
    assert "removed 1 entries" in capsys.readouterr().out
    assert [e.key for e in token_store.entries()] == [e.key for e in entries[1:]]
    assert token_store.orphans() == []


def test_prune_to_a_size_removes_the_least_recently_used_of_all_kinds_first(
    built: tuple[Path, TokenizerRef, DatasetRef],
) -> None:
    _, tokenizer, dataset = built
    _age(Path(dataset.path) / "meta.json", 10)
    _age(Path(tokenizer.path).parent / "meta.json", 5)
    every = cache_budget.items(("tokens", "datasets", "tokenizers"))
    assert [i.kind for i in every[:2]] == ["datasets", "tokenizers"]
    total = sum(i.bytes for i in every)
    removed, _ = cache_budget.prune(max_bytes=total - 1, kinds=("tokens", "datasets", "tokenizers"))
    assert [i.kind for i in removed] == ["datasets"]
    assert not Path(dataset.path).exists() and Path(tokenizer.path).is_file()


def test_a_slot_being_built_is_never_pruned(built: tuple[Path, TokenizerRef, DatasetRef]) -> None:
    _, tokenizer, dataset = built
    with build_lock(Path(dataset.path)):  # a builder holds the dataset's slot
        cache_budget.prune(max_bytes=0, kinds=("datasets", "tokenizers"))
    assert Path(dataset.path, "meta.json").is_file() and not Path(tokenizer.path).exists()


@flow
def _data_stage(settings: DataSettings, tokenizer: TokenizerRef) -> DatasetRef:
    return build_data(settings, tokenizer, SEQ_LEN, seed=0)


def test_cache_max_size_prunes_after_the_data_stage_and_keeps_what_the_run_holds(
    built: tuple[Path, TokenizerRef, DatasetRef],
) -> None:
    corpus, tokenizer, old = built
    _age(Path(old.path) / "meta.json", 3)
    settings = DataSettings(data=str(corpus), val_fraction=0.3, cache_max_size="1K")
    ref = _data_stage(settings, tokenizer)
    assert ref.path != old.path and Path(ref.path, "meta.json").is_file() and Path(tokenizer.path).is_file()
    assert not Path(old.path).exists() and token_store.entries() == []
    with pytest.raises(DataError, match="cache_max_size: 'lots' is not a size"):
        as_settings(None, cache_max_size="lots")
