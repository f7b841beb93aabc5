"""Deduplication and document filters (tasks/data/filters.py, tasks/data/near_dedup.py): exact copies dropped
by default and counted, near copies with MinHash, length limits and a user hook, all in the fingerprints.
Unit level: corpora are resolved and read, nothing is tokenized."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tasks.data.corpus import Corpus, DataError, resolve_corpus


def _all_texts(corpus: Corpus) -> list[str]:
    return [*corpus.train.texts(), *corpus.val.texts()]


def _code(root: Path, count: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        words = " ".join(f"name_{i}_{k}" for k in range(60))
        (root / f"m{i:02d}.py").write_text(f"# module {i}\nVALUES = '{words}'\n")


def test_exact_copies_are_dropped_across_the_corpus_and_counted(tmp_path: Path) -> None:
    _code(tmp_path / "c" / "a", 10)
    _code(tmp_path / "c" / "b", 10)  # the same ten texts at other paths
    records = [{"text": f"record {i % 7}"} for i in range(30)]
    (tmp_path / "c" / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = resolve_corpus(str(tmp_path / "c"), val_fraction=0.2)
    texts = _all_texts(corpus)
    assert len(texts) == len(set(texts)) == 10 + 7
    assert corpus.duplicates == 10  # whole files counted at listing (copies inside a file: when read)
    kept = resolve_corpus(str(tmp_path / "c"), val_fraction=0.2, dedup="off")
    assert len(_all_texts(kept)) > len(texts) and kept.fingerprint != corpus.fingerprint


def test_length_limits_and_a_hook_filter_documents_and_change_the_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    root.mkdir()
    for i, size in enumerate((5, 50, 500, 5000)):
        (root / f"doc{i}.txt").write_text("x" * (size - 1) + "\n")
    (root / "secret.txt").write_text("SECRET: drop me\n")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "my_hooks.py").write_text(
        "def clean(text):\n    return None if text.startswith('SECRET') else text.upper()\n"
    )
    monkeypatch.syspath_prepend(str(hooks))
    plain = resolve_corpus(str(root), val_fraction=0.3)
    assert sorted(map(len, _all_texts(plain))) == [5, 16, 50, 500, 5000]
    limited = resolve_corpus(str(root), val_fraction=0.3, min_chars=10, max_chars=1000)
    assert sorted(map(len, _all_texts(limited))) == [16, 50, 500]
    hooked = resolve_corpus(str(root), val_fraction=0.3, doc_filter="my_hooks:clean")
    assert sorted(_all_texts(hooked)) == sorted(t.upper() for t in _all_texts(plain) if "SECRET" not in t)
    fingerprints = {c.fingerprint for c in (plain, limited, hooked)}
    assert len(fingerprints) == 3
    (hooks / "my_hooks.py").write_text("def clean(text):\n    return text\n")  # an edited hook
    sys.modules.pop("my_hooks")
    from tasks.data.filters import hook_function

    hook_function.cache_clear()
    assert (
        resolve_corpus(str(root), val_fraction=0.3, doc_filter="my_hooks:clean").fingerprint
        != hooked.fingerprint
    )


def test_a_bad_hook_or_limits_are_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text\n")
    with pytest.raises(DataError, match=r"doc_filter='nomodule_xyz:f'.*cannot import"):
        resolve_corpus(str(tmp_path), doc_filter="nomodule_xyz:f")
    with pytest.raises(DataError, match=r"doc_filter='json'.*module:function"):
        resolve_corpus(str(tmp_path), doc_filter="json")
    with pytest.raises(DataError, match=r"max_chars=5 is below min_chars=10"):
        resolve_corpus(str(tmp_path), min_chars=10, max_chars=5)


def test_minhash_drops_near_copies_training_side_first(tmp_path: Path) -> None:
    pytest.importorskip("datasketch")
    root = tmp_path / "c"
    _code(root, 30)
    base = (root / "m00.py").read_text()
    (root / "near.py").write_text(base.replace("name_0_59", "changed_name"))  # one word of 61 changed
    exact = resolve_corpus(str(root), val_fraction=0.2)
    near = resolve_corpus(str(root), val_fraction=0.2, dedup="minhash")
    assert exact.duplicates == 0 and near.duplicates == 1
    assert len(_all_texts(near)) == 30 and near.fingerprint != exact.fingerprint
    train, val = set(near.train.texts()), set(near.val.texts())
    assert not {base, base.replace("name_0_59", "changed_name")} <= train | val  # one of the two is kept
