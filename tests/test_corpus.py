"""Corpus sources, the by-file split and content fingerprints (tasks/data/corpus.py); no tokenizing here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stdlib_corpus import MODULES, copy_modules
from tasks.data.chunking import MAX_BYTES, MIN_BYTES
from tasks.data.corpus import STDLIB_EXCLUDED_DIRS, DataError, DataWarning, resolve_corpus


def _split_names(corpus) -> tuple[set[str], set[str]]:
    return ({p.file.relpath for p in corpus.train.parts}, {p.file.relpath for p in corpus.val.parts})


def test_default_corpus_is_stdlib_split_by_file_deterministically() -> None:
    first, second = resolve_corpus(None), resolve_corpus("stdlib")
    train, val = _split_names(first)
    assert (train, val) == _split_names(second)
    assert first.fingerprint == second.fingerprint
    assert all(part.select is None for part in first.train.parts + first.val.parts)  # whole files
    assert not train & val
    assert 400 < len(train | val) < 2000
    assert 0.02 < len(val) / len(train | val) < 0.10
    for relpath in train | val:
        assert relpath.endswith(".py")
        assert not set(Path(relpath).parts) & STDLIB_EXCLUDED_DIRS, relpath
    assert "os.py" in train | val and "json/decoder.py" in train | val


def test_adding_a_file_keeps_the_others_in_their_split(tmp_path: Path) -> None:
    corpus_dir = tmp_path / "corpus"
    for i in range(60):
        (corpus_dir / f"doc{i:02d}.txt").parent.mkdir(exist_ok=True)
        (corpus_dir / f"doc{i:02d}.txt").write_text(f"document number {i}\n")
    before = _split_names(resolve_corpus(str(corpus_dir), val_fraction=0.2))
    (corpus_dir / "new.txt").write_text("a new document\n")
    after = _split_names(resolve_corpus(str(corpus_dir), val_fraction=0.2))
    assert before[1] and before[0]
    assert before[0] <= after[0] and before[1] <= after[1]
    assert len(after[0] | after[1]) == 61


def test_fingerprint_follows_content_not_mtime(tmp_path: Path) -> None:
    files = copy_modules(tmp_path / "c")
    base = resolve_corpus(str(tmp_path / "c"))
    os.utime(files[0], (1_000_000, 1_000_000))
    assert resolve_corpus(str(tmp_path / "c")).fingerprint == base.fingerprint
    files[0].write_text(files[0].read_text() + "\n# changed\n")
    changed = resolve_corpus(str(tmp_path / "c"))
    assert changed.fingerprint != base.fingerprint
    files[0].rename(files[0].with_name("renamed.py"))
    assert resolve_corpus(str(tmp_path / "c")).fingerprint not in {base.fingerprint, changed.fingerprint}


def test_directory_glob_and_file_sources(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha text\n")
    (root / "b.md").write_text("# beta\n")
    (root / "sub" / "c.py").write_text("print('gamma')\n")
    (root / "sub" / "ignored.bin").write_bytes(b"\x00\x01")
    corpus = resolve_corpus(str(root), val_fraction=0.3)
    texts = set(corpus.train.texts()) | set(corpus.val.texts())
    assert texts == {"alpha text\n", "# beta\n", "print('gamma')\n"}
    assert _split_names(corpus)[0] | _split_names(corpus)[1] == {"a.txt", "b.md", "sub/c.py"}

    globbed = resolve_corpus(str(root / "**" / "*.py"), val_data=str(root / "a.txt"))
    assert list(globbed.train.texts()) == ["print('gamma')\n"]
    assert list(globbed.val.texts()) == ["alpha text\n"]


def _texts(corpus) -> tuple[set[str], set[str]]:
    return set(corpus.train.texts()), set(corpus.val.texts())


def _kept_sides(before: tuple[set[str], set[str]], after: tuple[set[str], set[str]]) -> None:
    assert before[0] and before[1]
    assert before[0] <= after[0] and before[1] <= after[1], "a document moved to the other side"


def test_a_single_prose_file_splits_by_its_segments_and_a_single_small_one_is_a_clear_error(
    tmp_path: Path,
) -> None:
    path = tmp_path / "book.txt"
    path.write_text("".join(f"line {i} of the book, long enough to fill segments\n" for i in range(40_000)))
    corpus = resolve_corpus(str(path), val_fraction=0.1)
    train, val = list(corpus.train.texts()), list(corpus.val.texts())
    text = path.read_text()
    assert all(MIN_BYTES <= len(t) <= MAX_BYTES for t in train + val if not text.endswith(t))
    assert all(t[-1].isspace() for t in train + val)  # cut after whitespace
    assert all(t in text for t in train + val) and len("".join(train + val)) == len(text)
    assert 1 <= len(val) <= len(train) / 3
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "note.txt").write_text("a short note\n")
    with pytest.raises(DataError, match=r"holds 1 document.*give val_data="):
        resolve_corpus(str(tmp_path / "small" / "note.txt"), val_fraction=0.1)


def test_a_glob_corpus_that_grows_by_a_new_subdirectory_keeps_every_document_on_its_side(
    tmp_path: Path,
) -> None:
    for i in range(60):
        (tmp_path / "c" / "old").mkdir(parents=True, exist_ok=True)
        (tmp_path / "c" / "old" / f"doc{i:02d}.txt").write_text(f"document number {i}\n")
    pattern = str(tmp_path / "c" / "**" / "*.txt")
    before = _texts(resolve_corpus(pattern, val_fraction=0.2))
    (tmp_path / "c" / "new").mkdir()
    for i in range(5):
        (tmp_path / "c" / "new" / f"doc{i:02d}.txt").write_text(f"new document {i}\n")
    after = _texts(resolve_corpus(pattern, val_fraction=0.2))
    _kept_sides(before, after)
    assert len(after[0] | after[1]) == 65


def test_a_corpus_that_grows_from_one_file_to_two_keeps_every_document_on_its_side(tmp_path: Path) -> None:
    (tmp_path / "records").mkdir()
    first = tmp_path / "records" / "a.jsonl"
    first.write_text("".join(json.dumps({"text": f"record {i} of the first file"}) + "\n" for i in range(60)))
    before = _texts(resolve_corpus(str(tmp_path / "records"), val_fraction=0.2))
    (tmp_path / "records" / "b.jsonl").write_text(json.dumps({"text": "the second file's record"}) + "\n")
    _kept_sides(before, _texts(resolve_corpus(str(tmp_path / "records"), val_fraction=0.2)))

    (tmp_path / "prose").mkdir()
    (tmp_path / "prose" / "a.txt").write_text(
        "".join(f"line {i} of a long book of prose\n" for i in range(30_000))
    )
    before = _texts(resolve_corpus(str(tmp_path / "prose"), val_fraction=0.2))
    (tmp_path / "prose" / "b.txt").write_text("a second, short book\n")
    _kept_sides(before, _texts(resolve_corpus(str(tmp_path / "prose"), val_fraction=0.2)))


def test_jsonl_json_and_parquet_records(tmp_path: Path) -> None:
    records = [{"body": f"record {i} says hello", "id": i} for i in range(40)]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = resolve_corpus(str(jsonl), text_field="body", val_fraction=0.2)
    train, val = list(corpus.train.texts()), list(corpus.val.texts())
    assert sorted(train + val) == sorted(r["body"] for r in records)
    assert train and val and not set(train) & set(val)

    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "list.json").write_text(json.dumps(records[:3]))
    (tmp_path / "json" / "one.json").write_text(json.dumps(records[3]))
    both = resolve_corpus(str(tmp_path / "json" / "*.json"), text_field="body")
    assert sorted([*both.train.texts(), *both.val.texts()]) == sorted(r["body"] for r in records[:4])

    table = pa.table({"text": [r["body"] for r in records], "id": [r["id"] for r in records]})
    pq.write_table(table, tmp_path / "data.parquet")
    parquet = resolve_corpus(str(tmp_path / "data.parquet"))
    assert sorted([*parquet.train.texts(), *parquet.val.texts()]) == sorted(r["body"] for r in records)


def test_compressed_jsonl_parquet_shards_and_saved_datasets(tmp_path: Path) -> None:
    import gzip

    import datasets
    import zstandard

    records = [{"text": f"record {i} of a compressed file", "id": i} for i in range(60)]
    lines = [(json.dumps(r) + "\n").encode() for r in records]
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "a.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[:30])))
    (tmp_path / "packed" / "b.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(b"".join(lines[30:]))
    )
    corpus = resolve_corpus(str(tmp_path / "packed"), val_fraction=0.2)
    train, val = _texts(corpus)
    assert train | val == {r["text"] for r in records} and train and val and not train & val

    (tmp_path / "shards").mkdir()
    for shard in range(3):
        rows = records[shard * 20 : (shard + 1) * 20]
        pq.write_table(
            pa.table({"text": [r["text"] for r in rows]}), tmp_path / "shards" / f"train-{shard}.parquet"
        )
    assert _texts(resolve_corpus(str(tmp_path / "shards"), val_fraction=0.2)) == (
        train,
        val,
    )  # same documents

    table = datasets.Dataset.from_list(records)
    table.save_to_disk(str(tmp_path / "saved"))
    assert _texts(resolve_corpus(str(tmp_path / "saved"), val_fraction=0.2)) == (train, val)
    datasets.DatasetDict({"train": table, "dev": table.select(range(5))}).save_to_disk(str(tmp_path / "dict"))
    named = resolve_corpus(str(tmp_path / "dict"), hf_val_split="dev")
    assert set(named.val.texts()) == {r["text"] for r in records[:5]}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl.gz").write_bytes(gzip.compress(lines[0] + b'{"text": "caf\xe9"}\n'))
    with pytest.raises(DataError, match=r"a\.jsonl\.gz holds text that is not UTF-8"):
        _texts(resolve_corpus(str(tmp_path / "bad"), val_fraction=0.2))
    (tmp_path / "bad" / "a.jsonl.gz").write_bytes(gzip.compress(lines[0] + b'{"text": \n'))
    with pytest.raises(DataError, match=r"a\.jsonl\.gz:2 is not valid JSON"):
        _texts(resolve_corpus(str(tmp_path / "bad"), val_fraction=0.2))
    with pytest.raises(DataError, match=r"no split 'test'; its splits are \['train', 'dev'\]"):
        resolve_corpus(str(tmp_path / "dict"), hf_split="test")


def test_datasets_view_matches_plain_iteration(tmp_path: Path) -> None:
    copy_modules(tmp_path / "c")
    corpus = resolve_corpus(str(tmp_path / "c"), val_fraction=0.2)
    eager = corpus.train.dataset()
    assert eager.column_names == ["text"]
    assert list(eager["text"]) == list(corpus.train.texts())
    assert [row["text"] for row in corpus.train.dataset(streaming=True)] == list(corpus.train.texts())


def test_hf_dataset_from_a_local_data_directory(tmp_path: Path) -> None:
    (tmp_path / "hfdata").mkdir()
    rows = [{"content": f"hugging face row {i}"} for i in range(50)]
    (tmp_path / "hfdata" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = resolve_corpus(f"hf:{tmp_path / 'hfdata'}", text_field="content", val_fraction=0.2)
    train, val = list(corpus.train.texts()), list(corpus.val.texts())
    assert sorted(train + val) == sorted(r["content"] for r in rows)
    assert train and val and not set(train) & set(val)
    assert list(corpus.val.dataset()["text"]) == val
    assert (
        corpus.fingerprint
        == resolve_corpus(f"hf:{tmp_path / 'hfdata'}", text_field="content", val_fraction=0.2).fingerprint
    )
    with pytest.raises(DataError, match=r"no column 'text'.*'content'"):
        resolve_corpus(f"hf:{tmp_path / 'hfdata'}")

    streamed = resolve_corpus(
        f"hf:{tmp_path / 'hfdata'}", text_field="content", val_fraction=0.2, streaming=True
    )
    assert (list(streamed.train.texts()), list(streamed.val.texts())) == (train, val)
    assert [row["text"] for row in streamed.val.dataset(streaming=True)] == val
    with open(tmp_path / "hfdata" / "train.jsonl", "a") as handle:
        handle.write(json.dumps({"content": "one more row"}) + "\n")
    grown = resolve_corpus(
        f"hf:{tmp_path / 'hfdata'}", text_field="content", val_fraction=0.2, streaming=True
    )
    assert grown.fingerprint != streamed.fingerprint


def test_hf_named_validation_split(tmp_path: Path) -> None:
    (tmp_path / "hfdata").mkdir()
    for split in ("train", "validation"):
        rows = [{"text": f"{split} row {i}"} for i in range(5)]
        (tmp_path / "hfdata" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = resolve_corpus(f"hf:{tmp_path / 'hfdata'}", hf_val_split="validation")
    assert list(corpus.train.texts()) == [f"train row {i}" for i in range(5)]
    assert list(corpus.val.texts()) == [f"validation row {i}" for i in range(5)]
    with pytest.raises(DataError, match=r"split 'test'"):
        resolve_corpus(f"hf:{tmp_path / 'hfdata'}", hf_val_split="test")


def test_unreachable_hub_dataset_offline_is_a_clear_error() -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(DataError, match=r"offline mode is on.*not in the local HF cache"):
        resolve_corpus("hf:llamaflow-test/definitely-not-cached")


def test_missing_path_and_empty_glob_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist"):
        resolve_corpus(str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match=r"matches no files"):
        resolve_corpus(str(tmp_path / "*.txt"))
    with pytest.raises(DataError, match=r"no files with a known extension"):
        resolve_corpus(str(tmp_path))


def test_empty_corpus_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(DataError, match=r"is empty"):
        resolve_corpus(str(tmp_path))


def test_non_utf8_files_are_skipped_with_a_warning(tmp_path: Path) -> None:
    copy_modules(tmp_path / "c", MODULES[:3])
    (tmp_path / "c" / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    with pytest.warns(DataWarning, match=r"latin1\.txt: not UTF-8"):
        corpus = resolve_corpus(str(tmp_path / "c"))
    assert "latin1.txt" not in _split_names(corpus)[0] | _split_names(corpus)[1]
    with pytest.warns(DataWarning), pytest.raises(DataError, match=r"no usable files"):
        resolve_corpus(str(tmp_path / "c" / "latin1.txt"))


def test_records_without_the_text_field_name_file_field_and_fields_found(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    with pytest.raises(DataError, match=r"rows\.jsonl has no field 'text'; its fields are \['body', 'id'\]"):
        resolve_corpus(str(path))
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "rows.parquet")
    with pytest.raises(DataError, match=r"rows\.parquet has no field 'text'.*\['content'\]"):
        resolve_corpus(str(tmp_path / "rows.parquet"))


def test_bad_val_fraction_and_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"val_fraction=1.5"):
        resolve_corpus(None, val_fraction=1.5)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown extension"):
        resolve_corpus(str(tmp_path / "data.csv"))
