"""Packed datasets (tasks/dataset.py): layout, packing, cache, races, bad input, Prefect caching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from prefect import flow
from prefect.testing.utilities import prefect_test_harness
from tokenizers import Tokenizer

from stdlib_corpus import MODULES as STDLIB_MODULES
from stdlib_corpus import STDLIB, copy_modules
from tasks.data.corpus import DataError, DataSettings, resolve_corpus
from tasks.data.packed import token_dtype
from tasks.data.split import MANIFEST_NAME
from tasks.dataset import build_dataset, build_dataset_task, dataset_fingerprint
from tasks.home import PROJECT_ROOT
from tasks.refs import DatasetRef, TokenizerRef
from tasks.tokenize import train_tokenizer, train_tokenizer_task

MODULES = STDLIB_MODULES[:10]
SEQ_LEN = 32


def _corpus(root: Path, names: Sequence[str] = MODULES) -> Path:
    copy_modules(root, names)
    return root


@pytest.fixture()
def corpus_dir(tmp_path: Path) -> Path:
    return _corpus(tmp_path / "corpus")


@pytest.fixture()
def tokenizer(home: Path, corpus_dir: Path) -> TokenizerRef:
    return train_tokenizer(str(corpus_dir), 384, val_fraction=0.2)


def _stream(texts, tokenizer: TokenizerRef, add_bos: bool = False) -> np.ndarray:
    """The expected token stream, computed without the datasets machinery."""
    tok = Tokenizer.from_file(tokenizer.path)
    ids: list[int] = []
    for text in texts:
        ids += ([tokenizer.bos_id] if add_bos else []) + tok.encode(text, add_special_tokens=False).ids
        ids.append(tokenizer.eos_id)
    return np.asarray(ids)


def _arrays(ref: DatasetRef) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.load(Path(ref.path) / "train.npy", mmap_mode="r", allow_pickle=False),
        np.load(Path(ref.path) / "val.npy", mmap_mode="r", allow_pickle=False),
    )


def test_blocks_concatenate_back_to_the_token_stream(
    home: Path, corpus_dir: Path, tokenizer: TokenizerRef
) -> None:
    ref = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2, num_proc=2)
    directory = Path(ref.path)
    assert directory.parent == home / "cache" / "datasets" and directory.name == ref.fingerprint
    train, val = _arrays(ref)
    assert train.dtype == np.uint16 and val.dtype == np.uint16
    assert train.shape == (ref.train_blocks, SEQ_LEN + 1) and val.shape == (ref.val_blocks, SEQ_LEN + 1)
    corpus = resolve_corpus(str(corpus_dir), val_fraction=0.2)
    for array, split in ((train, corpus.train), (val, corpus.val)):
        stream = _stream(split.texts(), tokenizer)
        assert array.size == (len(stream) // (SEQ_LEN + 1)) * (SEQ_LEN + 1)  # remainder dropped
        np.testing.assert_array_equal(array.reshape(-1), stream[: array.size])
        assert tokenizer.pad_id not in array
    assert ref.train_tokens == train.shape[0] * SEQ_LEN and ref.val_tokens == val.shape[0] * SEQ_LEN

    meta = json.loads((directory / "meta.json").read_text())
    assert {k: meta[k] for k in ("seq_len", "vocab_size", "bos_id", "eos_id", "pad_id", "dtype")} == {
        "seq_len": SEQ_LEN,
        "vocab_size": 384,
        "bos_id": 0,
        "eos_id": 1,
        "pad_id": 2,
        "dtype": "uint16",
    }
    assert (meta["train_blocks"], meta["val_blocks"]) == (ref.train_blocks, ref.val_blocks)
    assert meta["stats"]["documents"] == len(MODULES) == ref.stats["documents"]
    assert 1.0 < ref.stats["bytes_per_token"] < 4.0
    assert ref.stats["blocks"] == ref.train_blocks + ref.val_blocks and ref.stats["seconds"] > 0
    assert (directory / "tokenizer.json").read_bytes() == Path(tokenizer.path).read_bytes()


def test_empty_files_inside_the_corpus_do_not_end_the_packing(home: Path, tmp_path: Path) -> None:
    """A file that yields no tokens (an empty `__init__.py`: the stdlib has dozens) between others: the
    files after it are still packed, and no block is padding."""
    corpus_dir = _corpus(tmp_path / "corpus")
    for name in ("bisect_a.py", "fnmatch_b.py", "glob_c.py", "heapq_d.py", "shlex_e.py", "string_f.py"):
        (corpus_dir / name).write_text("")
    (corpus_dir / "a_copy.py").write_bytes((corpus_dir / STDLIB_MODULES[0]).read_bytes())  # dropped
    tokenizer = train_tokenizer(str(corpus_dir), 384, val_fraction=0.2)
    ref = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2)
    corpus = resolve_corpus(str(corpus_dir), val_fraction=0.2)
    assert (
        ref.stats["duplicates_removed"]
        == json.loads((Path(ref.path) / "meta.json").read_text())["stats"]["duplicates_removed"]
        == 1
    )
    manifest = json.loads((Path(ref.path) / MANIFEST_NAME).read_text())["sources"][str(corpus_dir)]
    assert set(manifest["validation"].values()) == {p.file.relpath for p in corpus.val.parts}
    for array, split in zip(_arrays(ref), (corpus.train, corpus.val), strict=True):
        stream = _stream([text for text in split.texts() if text], tokenizer)
        assert array.size == (len(stream) // (SEQ_LEN + 1)) * (SEQ_LEN + 1)
        np.testing.assert_array_equal(array.reshape(-1), stream[: array.size])
        assert tokenizer.pad_id not in array


def test_keep_remainder_pads_the_last_block_and_bos_starts_documents(
    home: Path, corpus_dir: Path, tokenizer: TokenizerRef
) -> None:
    ref = build_dataset(
        str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2, keep_remainder=True, add_bos=True
    )
    train, _ = _arrays(ref)
    stream = _stream(resolve_corpus(str(corpus_dir), val_fraction=0.2).train.texts(), tokenizer, add_bos=True)
    remainder = len(stream) % (SEQ_LEN + 1)
    assert remainder >= 2  # this corpus leaves a real tail; the test would be vacuous otherwise
    assert train.shape[0] == len(stream) // (SEQ_LEN + 1) + 1
    np.testing.assert_array_equal(train.reshape(-1)[: len(stream)], stream)
    assert (train[-1, remainder:] == tokenizer.pad_id).all()
    assert (
        ref.train_tokens == len(stream) - train.shape[0]
    )  # every stream token but each row's first is a target
    assert train[0, 0] == tokenizer.bos_id
    assert int((train == tokenizer.bos_id).sum()) == int((train == tokenizer.eos_id).sum())


def test_second_call_does_no_work_and_a_content_change_rebuilds(
    home: Path, corpus_dir: Path, tokenizer: TokenizerRef
) -> None:
    first = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2)
    # meta.json's modification time is the dataset's last use (what `flows.cache prune` goes by): not a write
    stamps = {p.name: p.stat().st_mtime_ns for p in Path(first.path).iterdir() if p.name != "meta.json"}
    assert build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2) == first
    assert {
        p.name: p.stat().st_mtime_ns for p in Path(first.path).iterdir() if p.name != "meta.json"
    } == stamps
    assert len(list((home / "cache" / "datasets").iterdir())) == 1  # no staging leftovers

    other_len = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN * 2, val_fraction=0.2)
    assert other_len.fingerprint != first.fingerprint

    val_file = resolve_corpus(str(corpus_dir), val_fraction=0.2).val.parts[0].file.path
    Path(val_file).write_text(Path(val_file).read_text() + "\nextra = 'validation text'\n")
    rebuilt = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2)
    assert rebuilt.fingerprint != first.fingerprint
    assert rebuilt.stats["val_stream_tokens"] > first.stats["val_stream_tokens"]
    assert rebuilt.stats["train_stream_tokens"] == first.stats["train_stream_tokens"]


def test_streaming_and_process_count_give_identical_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: TokenizerRef
) -> None:
    import datasets

    many = tmp_path / "many"
    for i in range(15):  # 150 documents: several map batches, so num_proc=2 really starts 2 processes
        for path in copy_modules(many / f"copy{i}", STDLIB_MODULES):
            path.write_text(f"{path.read_text()}\n# copy {i}\n")  # not copies: dedup would drop them
    results = []
    for i, options in enumerate(({"num_proc": 1}, {"num_proc": 2}, {"streaming": True})):
        monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / f"home{i}"))
        # A fresh datasets cache too, or the second build would reuse the first's tokenized Arrow file.
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / f"hf{i}")
        ref = build_dataset(str(many), tokenizer, SEQ_LEN, val_fraction=0.2, **options)
        results.append((ref, *_arrays(ref)))
    assert results[0][0].stats["train_documents"] > 64  # at least 2 map batches
    for ref, train, val in results[1:]:
        np.testing.assert_array_equal(train, results[0][1])
        np.testing.assert_array_equal(val, results[0][2])
        assert ref.fingerprint == results[0][0].fingerprint


def test_jsonl_records_pack_with_eos_between_documents(
    home: Path, tmp_path: Path, tokenizer: TokenizerRef
) -> None:
    lines = (STDLIB / "this.py").read_text().splitlines()
    rows = [{"body": line} for line in lines * 8 if line]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = DataSettings(data=str(path), dedup="off")  # the rows repeat: all of them kept
    ref = build_dataset(kept, tokenizer, 16, text_field="body", val_fraction=0.3, keep_remainder=True)
    assert ref.stats["documents"] == len(rows)
    train, val = _arrays(ref)
    real = int((train[:, 1:] != tokenizer.pad_id).sum() + (val[:, 1:] != tokenizer.pad_id).sum())
    assert int((train == tokenizer.eos_id).sum() + (val == tokenizer.eos_id).sum()) == len(rows)
    assert real == ref.train_tokens + ref.val_tokens


_RACER = """
import sys, time
import tasks.data.packing as packing
import tasks.dataset as stage
from tasks.refs import TokenizerRef

build_into = packing.build_into

def slow_build_into(*args, **kwargs):
    with open(sys.argv[4], "a") as log:  # one line per tokenizing build
        log.write("built\\n")
    time.sleep(3)  # long enough that the other racer arrives while this one builds
    return build_into(*args, **kwargs)

packing.build_into = slow_build_into
ref = stage.build_dataset(sys.argv[1], TokenizerRef.model_validate_json(sys.argv[2]), int(sys.argv[3]),
                          val_fraction=0.2, num_proc=1)
print(ref.model_dump_json())
"""


def test_two_processes_racing_for_one_key_tokenize_once_and_share_one_dataset(
    home: Path, tmp_path: Path, corpus_dir: Path, tokenizer: TokenizerRef
) -> None:
    builds = tmp_path / "builds.log"
    racers = []
    for i in range(2):
        env = {**os.environ, "LLAMAFLOW_HOME": str(home), "HF_DATASETS_CACHE": str(tmp_path / f"hf{i}")}
        racers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _RACER,
                    str(corpus_dir),
                    tokenizer.model_dump_json(),
                    str(SEQ_LEN),
                    str(builds),
                ],
                cwd=PROJECT_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [racer.communicate(timeout=120) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err[-2000:] for _, err in outputs]
    assert builds.read_text().splitlines() == ["built"]  # the second waited for the first, then reused it
    refs = [DatasetRef.model_validate_json(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert refs[0] == refs[1]
    assert [p.name for p in (home / "cache" / "datasets").iterdir()] == [refs[0].fingerprint]
    assert build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2) == refs[0]
    train, _ = _arrays(refs[0])
    stream = _stream(resolve_corpus(str(corpus_dir), val_fraction=0.2).train.texts(), tokenizer)
    np.testing.assert_array_equal(train.reshape(-1), stream[: train.size])


def test_staging_directories_of_a_crashed_build_are_removed(
    home: Path, corpus_dir: Path, tokenizer: TokenizerRef
) -> None:
    corpus = resolve_corpus(str(corpus_dir), val_fraction=0.2)
    fingerprint = dataset_fingerprint(corpus, tokenizer, SEQ_LEN, False, False)
    datasets = home / "cache" / "datasets"
    crashed = datasets / f".{fingerprint}.tmp-999999-deadbeef"  # what a killed builder leaves
    (crashed / "val.tokens.bin").parent.mkdir(parents=True)
    (crashed / "val.tokens.bin").write_bytes(b"\0" * 64)
    other = datasets / ".0123abcd.tmp-999999-deadbeef"  # another slot's: not ours to judge
    other.mkdir()
    ref = build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, val_fraction=0.2)
    assert ref.fingerprint == fingerprint
    assert sorted(p.name for p in datasets.iterdir()) == sorted([fingerprint, other.name])


def test_token_dtype_is_the_smallest_that_holds_the_vocabulary() -> None:
    assert token_dtype(8192) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(128_256) == np.uint32


def test_bad_inputs_fail_before_tokenizing(
    home: Path, tmp_path: Path, corpus_dir: Path, tokenizer: TokenizerRef
) -> None:
    with pytest.raises(DataError, match=r"seq_len=1 is too small"):
        build_dataset(str(corpus_dir), tokenizer, 1)
    with pytest.raises(DataError, match=r"num_proc=0"):
        build_dataset(str(corpus_dir), tokenizer, SEQ_LEN, num_proc=0)
    missing = tokenizer.model_copy(update={"path": str(tmp_path / "gone" / "tokenizer.json")})
    with pytest.raises(DataError, match=r"Tokenizer file .* is missing"):
        build_dataset(str(corpus_dir), missing, SEQ_LEN)
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("just a few words of training text\n" * 40)
    (small / "b.txt").write_text("tiny\n")
    with pytest.raises(
        DataError, match=r"validation split has at most 6 tokens.*seq_len \+ 1 = 33.*smaller seq_len"
    ):
        build_dataset(str(small), tokenizer, SEQ_LEN, val_data=str(small / "b.txt"))
    with pytest.raises(DataError, match=r"train split has at most \d+ tokens.*seq_len \+ 1 = 4097"):
        build_dataset(str(small / "a.txt"), tokenizer, 4096, val_data=str(corpus_dir))
    assert not (home / "cache" / "datasets").exists()


def test_too_few_tokens_after_tokenizing_names_the_count(
    home: Path, tmp_path: Path, tokenizer: TokenizerRef
) -> None:
    # 29 bytes pass the byte bound (30 tokens at most >= 21), but common keywords encode to fewer.
    (tmp_path / "val.txt").write_text("def return self import class ")
    with pytest.raises(DataError, match=r"validation split has \d+ tokens, fewer than one block.*= 21"):
        build_dataset(str(STDLIB / "textwrap.py"), tokenizer, 20, val_data=str(tmp_path / "val.txt"))
    assert [p.name for p in (home / "cache" / "datasets").iterdir()] == []  # staging removed


# ------------------------------------------------------------------------------------------- Prefect


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=None):
        yield


@flow
def _data_flow(data: str) -> list:
    tokenizer_state = train_tokenizer_task(data, 384, val_fraction=0.2, return_state=True)
    tokenizer = tokenizer_state.result()
    dataset_state = build_dataset_task(data, tokenizer, SEQ_LEN, val_fraction=0.2, return_state=True)
    return [tokenizer_state.name, dataset_state.name, tokenizer, dataset_state.result()]


def test_prefect_tasks_are_cached_on_the_content_fingerprint(
    prefect_api, home: Path, corpus_dir: Path
) -> None:
    first = _data_flow(str(corpus_dir))
    assert first[:2] == ["Completed", "Completed"]
    assert isinstance(first[2], TokenizerRef) and isinstance(first[3], DatasetRef)
    from prefect.results import get_default_result_storage

    records = Path(get_default_result_storage().basepath).expanduser()
    assert any(records.glob(f"build_dataset-{first[3].fingerprint}*"))

    second = _data_flow(str(corpus_dir))
    assert second[:2] == ["Cached", "Cached"]
    assert second[2:] == first[2:]

    # A cleared dataset cache must not be served as a dangling cached path: it rebuilds.
    import shutil

    shutil.rmtree(first[3].path)
    third = _data_flow(str(corpus_dir))
    assert third[:2] == ["Cached", "Completed"]
    assert Path(third[3].path, "train.npy").is_file()

    extra = corpus_dir / "extra.py"
    extra.write_text((STDLIB / "this.py").read_text())
    fourth = _data_flow(str(corpus_dir))
    assert fourth[1] == "Completed" and fourth[3].fingerprint != first[3].fingerprint


@flow
def _bad_data_flow(data: str) -> None:
    train_tokenizer_task(data, 384)


def test_prefect_task_with_bad_input_raises_the_data_error(prefect_api, home: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist"):
        _bad_data_flow(str(tmp_path / "missing"))


def test_cached_refs_follow_a_moved_home_and_rebuild_in_an_empty_one(
    prefect_api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corpus_dir: Path
) -> None:
    first_home = tmp_path / "first-home"
    monkeypatch.setenv("LLAMAFLOW_HOME", str(first_home))
    first = _data_flow(str(corpus_dir))
    assert Path(first[3].path).is_relative_to(first_home)

    # The home moves (a renamed checkout, another mount point): hits name the files where they are now.
    moved_home = tmp_path / "moved-home"
    first_home.rename(moved_home)
    monkeypatch.setenv("LLAMAFLOW_HOME", str(moved_home))
    moved = _data_flow(str(corpus_dir))
    assert moved[:2] == ["Cached", "Cached"]
    assert Path(moved[2].path).is_file() and Path(moved[2].path).is_relative_to(moved_home)
    assert Path(moved[3].path, "train.npy").is_file() and Path(moved[3].path).is_relative_to(moved_home)
    assert moved[3].fingerprint == first[3].fingerprint

    # A worker with its own, empty home: the records exist but their files do not here, so both rebuild.
    empty_home = tmp_path / "worker-home"
    monkeypatch.setenv("LLAMAFLOW_HOME", str(empty_home))
    rebuilt = _data_flow(str(corpus_dir))
    assert rebuilt[:2] == ["Completed", "Completed"]
    assert Path(rebuilt[3].path, "train.npy").is_file() and Path(rebuilt[3].path).is_relative_to(empty_home)
