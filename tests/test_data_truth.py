"""What the data stage claims, checked: a bad file is one clear error before any work, an unchanged file is
not hashed again (and what is read is still verified), and table sources are tokenized and packed."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from stdlib_corpus import MODULES, copy_modules, stdlib_text
from tasks.data import digest_index, formats
from tasks.data.corpus import DataError, resolve_corpus
from tasks.dataset import build_dataset
from tasks.home import PROJECT_ROOT
from tasks.tokenize import train_tokenizer

SEQ_LEN = 16


def _records(names: tuple[str, ...] = MODULES[:6]) -> list[dict[str, str]]:
    return [{"text": text} for text in stdlib_text(names, 3000)]


def _jsonl(records: list[dict[str, str]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _bad_files(root: Path) -> dict[str, bytes]:
    """One broken file of each format, by name."""
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": [r["text"] for r in _records()]}), root / "good.parquet")
    parquet = (root / "good.parquet").read_bytes()
    gz, zst = gzip.compress(_jsonl(_records())), zstandard.ZstdCompressor().compress(_jsonl(_records()))
    return {
        "cut.parquet": parquet[: len(parquet) // 2],
        "noise.parquet": b"PAR1" + b"\x00" * 64,
        "broken.json": json.dumps(_records()).encode()[:-40],
        "cut.jsonl.gz": gz[: len(gz) // 2],
        "cut.jsonl.zst": zst[: len(zst) // 2],
    }


def test_each_bad_file_is_one_data_error_naming_it_when_the_corpus_is_listed(
    tmp_path: Path, home: Path
) -> None:
    for name, content in _bad_files(tmp_path / "made").items():
        corpus = tmp_path / name.replace(".", "-")
        copy_modules(corpus, MODULES[:3])
        (corpus / name).write_bytes(content)
        with pytest.raises(DataError) as caught:
            resolve_corpus(str(corpus))  # lists and hashes: no text is tokenized or trained on
        message = str(caught.value)
        assert str(corpus / name) in message and "remove it from the corpus" in message, message
        if "json" in name and "gz" not in name and "zst" not in name:
            assert "is not valid JSON" in message


@pytest.mark.e2e
def test_the_command_line_ends_with_the_bad_file_and_exit_code_2_before_a_tokenizer_is_trained(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "corpus"
    copy_modules(corpus, MODULES[:4])
    gz = gzip.compress(_jsonl(_records()))
    (corpus / "shard.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pretrain", "--preset", "tiny", "--data", str(corpus)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "LLAMAFLOW_HOME": str(home)},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith(f"error: {corpus / 'shard.jsonl.gz'} is not a readable .jsonl.gz"), last
    assert not (home / "cache" / "tokenizers").exists() or not any((home / "cache" / "tokenizers").iterdir())


def test_an_unchanged_file_is_not_hashed_again_and_a_stale_digest_is_caught_when_read(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus"
    files = copy_modules(corpus, MODULES[:6])
    scanned: list[str] = []
    real_scan = digest_index.scan
    monkeypatch.setattr(digest_index, "scan", lambda path: scanned.append(path) or real_scan(path))
    first = resolve_corpus(str(corpus), val_fraction=0.2)
    assert len(scanned) == 6
    digest_index._KNOWN.clear()  # a new process: only the index on disk is left
    scanned.clear()
    assert resolve_corpus(str(corpus), val_fraction=0.2).fingerprint == first.fingerprint
    assert scanned == []
    files[0].write_text(files[0].read_text() + "\n# grown\n")
    digest_index._KNOWN.clear()
    assert resolve_corpus(str(corpus), val_fraction=0.2).fingerprint != first.fingerprint
    assert scanned == [str(files[0])]

    # A stale row (a file system whose times did not move): the read notices, and the row is forgotten.
    digest_index._KNOWN.clear()
    stat = files[1].stat()
    with digest_index.DigestIndex() as index:
        index._new.append(
            (
                str(files[1]),
                stat.st_size,
                stat.st_mtime_ns,
                stat.st_ino,
                stat.st_ctime_ns,
                "0" * 32,
                None,
                None,
            )
        )
    stale = resolve_corpus(str(corpus), val_fraction=0.2)
    with pytest.raises(DataError, match="changed while this run read it"):
        for split in (stale.train, stale.val):
            list(split.texts())
    digest_index._KNOWN.clear()
    assert resolve_corpus(str(corpus), val_fraction=0.2).fingerprint != stale.fingerprint


def test_a_parquet_file_is_read_by_row_group_and_hashed_in_file_order(tmp_path: Path, home: Path) -> None:
    records = _records(MODULES[:12])
    path = tmp_path / "shard.parquet"
    rng = np.random.default_rng(0)
    # Two columns (one never read) and several row groups: the reader seeks, and still hashes every byte.
    pq.write_table(
        pa.table({"id": [rng.bytes(20000).hex() for _ in range(12)], "text": [r["text"] for r in records]}),
        path,
        row_group_size=3,
    )
    with open(path, "rb") as handle:
        raw = formats.HashingReader(handle)
        texts = [r["text"] for r in formats.records(raw, str(path), ".parquet", "", ["text"])]
        scanned = formats.scan(str(path))  # one sequential read of the file
        assert raw.finish() == (scanned.digest, scanned.size)
    assert texts == [r["text"] for r in records]


@pytest.mark.parametrize("kind", ["hf", "saved"])
def test_a_table_source_is_tokenized_and_packed_end_to_end(tmp_path: Path, home: Path, kind: str) -> None:
    import datasets

    records = _records(MODULES[:12])
    if kind == "hf":  # a data folder that datasets prepares into the local HF cache (offline)
        (tmp_path / "hfdata").mkdir()
        (tmp_path / "hfdata" / "train.jsonl").write_bytes(_jsonl(records))
        source = f"hf:{tmp_path / 'hfdata'}"
    else:
        datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
        source = str(tmp_path / "saved")
    tokenizer = train_tokenizer(source, 300, val_fraction=0.25)
    ref = build_dataset(source, tokenizer, SEQ_LEN, val_fraction=0.25)
    corpus = resolve_corpus(source, val_fraction=0.25)
    encoder = Tokenizer.from_file(tokenizer.path)
    for split, name in ((corpus.train, "train"), (corpus.val, "val")):
        texts = list(split.texts())
        assert texts and len(texts) < len(records)
        stream = [
            i for t in texts for i in [*encoder.encode(t, add_special_tokens=False).ids, tokenizer.eos_id]
        ]
        blocks = np.load(Path(ref.path) / f"{name}.npy")
        assert blocks.shape[1] == SEQ_LEN + 1 and blocks.size == len(stream) // (SEQ_LEN + 1) * (SEQ_LEN + 1)
        np.testing.assert_array_equal(blocks.reshape(-1), stream[: blocks.size])
    assert ref.stats["documents"] == len(records)
