"""The token cache cannot lie and cannot fill the disk (tasks/data/tokens.py, tasks/data/token_store.py,
`python -m flows.cache`): a part's tokens are kept only under the digest of the bytes actually read, pruning
goes by last use or size, and a prune in another process waits for a running build instead of removing what
it is about to read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import tasks.data.packing
from flows import cache as cache_cli
from stdlib_corpus import MODULES, copy_modules
from tasks.data import token_store
from tasks.data.corpus import DataError, resolve_corpus
from tasks.data.documents import part_texts
from tasks.data.tokens import cached_counts, part_key, tokenize_shard
from tasks.dataset import build_dataset, plan_tokenization
from tasks.home import PROJECT_ROOT
from tasks.refs import TokenizerRef
from tasks.tokenize import train_tokenizer

SEQ_LEN = 32
FILES = MODULES[:7]


@pytest.fixture()
def corpus_dir(tmp_path: Path) -> Path:
    copy_modules(tmp_path / "corpus", FILES)
    return tmp_path / "corpus"


@pytest.fixture()
def tokenizer(home: Path, corpus_dir: Path) -> TokenizerRef:
    return train_tokenizer(str(corpus_dir), 300, val_fraction=0.2)


def _train_stream(corpus_dir: Path, tokenizer: TokenizerRef) -> np.ndarray:
    tok = Tokenizer.from_file(tokenizer.path)
    ids: list[int] = []
    for text in resolve_corpus(str(corpus_dir), val_fraction=0.2).train.texts():
        ids += tok.encode(text, add_special_tokens=False).ids + [tokenizer.eos_id]
    return np.asarray(ids)


def test_a_file_rewritten_or_deleted_after_listing_is_refused_never_cached_under_its_old_key(
    corpus_dir: Path, tokenizer: TokenizerRef
) -> None:
    (shard,) = plan_tokenization(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2)
    part = next(p for p in shard.parts if p.relpath == "textwrap.py")
    path = Path(part.path)
    stat = path.stat()
    text = path.read_text()
    path.write_text(text.replace("the", "THE"))  # an ingest job rewrites it: same size, same mtime
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(DataError, match=r"textwrap\.py changed while this run read it"):
        tokenize_shard(shard)
    assert cached_counts(part_key(part, tokenizer, shard.add_bos, shard.dtype)) is None
    ref = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2)  # listed again: the new text
    train = np.load(Path(ref.path) / "train.npy")
    np.testing.assert_array_equal(train.reshape(-1), _train_stream(corpus_dir, tokenizer)[: train.size])

    path.unlink()  # deleted after listing
    with pytest.raises(DataError, match=r"textwrap\.py was deleted after the corpus was listed"):
        list(part_texts(part.file_part(), "text"))


def _age(days: float, entries: list[token_store.Entry]) -> None:
    then = time.time() - days * 86400
    for entry in entries:
        _, meta = token_store.entry_paths(entry.key)
        os.utime(meta, (then, then))


def test_prune_by_last_use_and_by_size_and_a_pruned_part_is_tokenized_again(
    corpus_dir: Path, tokenizer: TokenizerRef, capsys: pytest.CaptureFixture[str]
) -> None:
    first = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2)
    entries = token_store.entries()
    assert len(entries) == len(FILES)
    _age(40, entries[:2])
    assert cache_cli.main(["prune", "--older-than", "30"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert {e.key for e in token_store.entries()} == {e.key for e in entries[2:]}

    cached_counts(
        entries[2].key
    )  # a lookup is a use: the least recent entry becomes the one a size cut keeps
    keep = token_store.entries()[-1]
    assert keep.key == entries[2].key
    assert cache_cli.main(["prune", "--max-size", str(keep.bytes), "--only", "tokens"]) == 0
    assert [e.key for e in token_store.entries()] == [keep.key]
    assert "tokens: 1 entries" in capsys.readouterr().out

    # The dataset, built again in another slot, tokenizes what was pruned and packs the same stream.
    again = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN + 1, val_fraction=0.2)
    assert len(token_store.entries()) == len(FILES)
    stream = [np.load(Path(ref.path) / "train.npy").reshape(-1) for ref in (first, again)]
    size = min(s.size for s in stream)
    np.testing.assert_array_equal(stream[0][:size], stream[1][:size])
    with pytest.raises(SystemExit):
        cache_cli.main(["prune", "--max-size", "lots"])


def test_a_prune_in_another_process_waits_for_a_running_build(
    home: Path, corpus_dir: Path, tokenizer: TokenizerRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build is held between looking its parts up and packing them while a second process prunes the
    whole cache: the prune must wait, and the build must pack exactly its corpus's tokens."""
    pack_parts = tasks.data.packing.pack_parts
    pruner: list[subprocess.Popen[str]] = []
    first_line: list[str] = []

    def pack_while_pruning(*args, **kwargs):
        if not pruner:
            pruner.append(
                subprocess.Popen(
                    [sys.executable, "-m", "flows.cache", "prune", "--max-size", "0", "--only", "tokens"],
                    cwd=PROJECT_ROOT,
                    env={**os.environ, "LLAMAFLOW_HOME": str(home), "PYTHONPATH": str(PROJECT_ROOT)},
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
            first_line.append(pruner[0].stdout.readline())  # type: ignore[union-attr]
        return pack_parts(*args, **kwargs)

    monkeypatch.setattr(tasks.data.packing, "pack_parts", pack_while_pruning)
    ref = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2)
    out, _ = pruner[0].communicate(timeout=60)
    assert first_line == ["waiting for running data builds to finish\n"], first_line
    assert "removed" in out and token_store.entries() == []
    train = np.load(Path(ref.path) / "train.npy")
    np.testing.assert_array_equal(train.reshape(-1), _train_stream(corpus_dir, tokenizer)[: train.size])


_opened_jsonl: list[str] = []


def _record_opens(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str) and args[0].endswith(".jsonl"):
        _opened_jsonl.append(args[0])


def test_a_record_file_with_documents_on_both_sides_is_read_once_into_both_entries(
    home: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "records"
    corpus.mkdir()
    texts = [f"document {i}: " + "words of the corpus " * (i % 7 + 1) for i in range(400)]
    (corpus / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = train_tokenizer(str(corpus), 300, val_fraction=0.2)
    (shard,) = plan_tokenization(str(corpus), tokenizer, SEQ_LEN, val_fraction=0.2)
    assert (len(shard.parts), shard.files, shard.bytes) == (2, 1, (corpus / "all.jsonl").stat().st_size)

    sys.addaudithook(_record_opens)  # stays for the process; it only records .jsonl opens
    _opened_jsonl.clear()
    tokenize_shard(shard)
    assert _opened_jsonl == [str(corpus / "all.jsonl")]

    tok = Tokenizer.from_file(tokenizer.path)
    split = resolve_corpus(str(corpus), val_fraction=0.2)
    for part, side in zip(shard.parts, (split.val, split.train), strict=True):
        data, _ = token_store.entry_paths(part_key(part, tokenizer, shard.add_bos, shard.dtype))
        expected = [i for t in side.texts() for i in tok.encode(t).ids + [tokenizer.eos_id]]
        np.testing.assert_array_equal(np.fromfile(data, dtype=shard.dtype), expected)
