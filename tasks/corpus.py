"""Text corpora: where documents come from, how they split into train/validation, their fingerprints.

`resolve_corpus(spec)` turns a `DataSpec` into a `Corpus` of two `CorpusSplit`s. Resolving reads and
hashes the files (cheap: ~0.1 s for the 11 MB standard library) but tokenizes nothing, so every
bad-input error is raised before the expensive work starts.

Sources (`DataSpec.data`):
- `None` or `"stdlib"`: the running interpreter's standard library sources (no test folders,
  no site-packages, no idlelib).
- a file, a glob or a directory (recursively): `.txt`, `.md`, `.py` (one document per file),
  `.jsonl` / `.json` (one document per record, field `text_field`), `.parquet` (column `text_field`).
- `hf:NAME[:CONFIG]`: a Hugging Face dataset (hub or local HF cache, or a local data directory),
  split `hf_split`, column `text_field`.

Split: with `val_data` the validation split is that source. Otherwise it is a `val_fraction` of the
files, chosen by a hash of each file's relative path, so adding a file never moves the others. With
a single file the split is inside it: its last lines (text) or hashed record indices (records).
Hugging Face datasets split by a hash of the row index, unless `hf_val_split` names a split.

Non-UTF-8 files are skipped with a `DataWarning` naming them (a corpus folder often holds a stray
binary or Latin-1 file; failing the whole run for it helps nobody); if nothing is left, `DataError`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FORMAT_VERSION = "corpus-v1"
TEXT_SUFFIXES = (".txt", ".md", ".py")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
KNOWN_SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "site-packages", "idlelib", "__pycache__"})
_TRAIN, _VAL = "train", "validation"


class DataError(ValueError):
    """Bad data input; the message names the problem and the fix."""


class DataWarning(UserWarning):
    """Something in the corpus was skipped."""


class DataSpec(BaseModel):
    """Which text to train on, and how to hold out validation text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: str | None = Field(default=None, description="None/'stdlib', a path, a glob, or 'hf:NAME[:CONFIG]'")
    val_data: str | None = Field(default=None, description="Separate validation source (same forms as data)")
    val_fraction: float = 0.05
    text_field: str = "text"
    hf_split: str = "train"
    hf_val_split: str | None = None
    streaming: bool = False


def as_spec(data: str | DataSpec | None = None, **overrides: Any) -> DataSpec:
    """A DataSpec from a source string or a spec; keyword overrides that are None are ignored."""
    updates = {key: value for key, value in overrides.items() if value is not None}
    if isinstance(data, DataSpec):
        spec = DataSpec(**{**data.model_dump(), **updates})
    else:
        spec = DataSpec(data=data, **updates)
    if not 0.0 < spec.val_fraction < 1.0:
        raise DataError(f"val_fraction={spec.val_fraction} must be between 0 and 1 (exclusive); 0.05 is typical.")
    return spec


def blake(*parts: str | bytes) -> str:
    """A 32-hex-digit blake2b over length-prefixed parts (so ("ab", "c") != ("a", "bc"))."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return digest.hexdigest()


def _unit_hash(key: str) -> float:
    """A stable number in [0, 1) for a split key (relative path or record index)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2**64


# --------------------------------------------------------------------------------------------- files


@dataclass(frozen=True)
class SourceFile:
    path: str
    relpath: str
    digest: str
    size: int

    @property
    def kind(self) -> str:
        return Path(self.path).suffix.lower()


@dataclass(frozen=True)
class FilePart:
    """A file, or part of one: `select` picks lines (text) or records by hashed index."""

    file: SourceFile
    select: tuple[str, float] | None = None  # ("head"|"tail"|"records_train"|"records_val", fraction)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _stdlib_files() -> list[Path]:
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS)
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(found)


def _expand(source: str) -> tuple[list[Path], Path]:
    """Files of a path/glob/directory source and the root their relative paths are taken from."""
    if source == "stdlib":
        return _stdlib_files(), stdlib_root()
    if glob.has_magic(source):
        matches = sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(source), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise DataError(f"The glob {source!r} matches no files; check the pattern and the working directory.")
        root = Path(os.path.commonpath([str(p.parent) for p in files]))
        return files, root
    path = Path(os.path.expanduser(source)).resolve()
    if not path.exists():
        raise DataError(
            f"Data path {source!r} does not exist (resolved to {path}); give an existing file, directory or glob,"
            " 'stdlib', or 'hf:NAME' for a Hugging Face dataset."
        )
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and p.suffix.lower() in KNOWN_SUFFIXES and "__pycache__" not in p.parts
        )
        if not files:
            raise DataError(
                f"Directory {path} holds no files with a known extension {KNOWN_SUFFIXES}; point data at text files."
            )
        return files, path
    return [path], path.parent


def _read_source_files(source: str, text_field: str) -> list[SourceFile]:
    paths, root = _expand(source)
    result: list[SourceFile] = []
    skipped: list[str] = []
    for path in paths:
        if path.suffix.lower() not in KNOWN_SUFFIXES:
            raise DataError(
                f"{path} has an unknown extension; supported: {', '.join(KNOWN_SUFFIXES)}. Rename it or filter the glob."
            )
        raw = path.read_bytes()
        if path.suffix.lower() != ".parquet":
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                warnings.warn(f"Skipping {path}: not UTF-8 ({err.reason} at byte {err.start}).", DataWarning, stacklevel=3)
                skipped.append(str(path))
                continue
        relpath = path.relative_to(root).as_posix()
        file = SourceFile(str(path), relpath, blake(raw), len(raw))
        _check_text_field(file, text_field)
        result.append(file)
    if not result:
        raise DataError(
            f"The data source {source!r} has no usable files (skipped as non-UTF-8: {skipped}); give UTF-8 text."
        )
    if all(f.size == 0 for f in result):
        raise DataError(f"The data source {source!r} is empty (all {len(result)} files have 0 bytes); give some text.")
    return result


def _check_text_field(file: SourceFile, text_field: str) -> None:
    """Fail fast when a record file lacks the text field, naming the fields it has."""
    if file.kind not in RECORD_SUFFIXES:
        return
    if file.kind == ".parquet":
        import pyarrow.parquet as pq

        fields = pq.read_schema(file.path).names
    else:
        first = next(_iter_records(file), None)
        if first is None:
            return
        fields = list(first)
    if text_field not in fields:
        raise DataError(
            f"{file.path} has no field {text_field!r}; its fields are {fields}. "
            f"Pass text_field= one of those."
        )


def _iter_records(file: SourceFile) -> Iterator[dict[str, Any]]:
    if file.kind == ".jsonl":
        with open(file.path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise DataError(f"{file.path}:{number} is not a JSON object; each line must be one.")
                    yield record
    elif file.kind == ".json":
        with open(file.path, encoding="utf-8") as handle:
            loaded = json.load(handle)
        records = loaded if isinstance(loaded, list) else [loaded]
        for record in records:
            if not isinstance(record, dict):
                raise DataError(f"{file.path} must hold a JSON object or a list of objects.")
            yield record


def _record_texts(file: SourceFile, text_field: str) -> Iterator[str]:
    if file.kind == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(file.path).iter_batches(columns=[text_field], batch_size=1024):
            yield from (text for text in batch.column(0).to_pylist() if text)
        return
    for index, record in enumerate(_iter_records(file)):
        if text_field not in record:
            raise DataError(
                f"{file.path} record {index} has no field {text_field!r}; its fields are {list(record)}."
            )
        text = record[text_field]
        if text:
            yield str(text)


def _part_texts(part: FilePart, text_field: str) -> Iterator[str]:
    file = part.file
    if file.kind in TEXT_SUFFIXES:
        text = Path(file.path).read_text(encoding="utf-8")
        if part.select is not None:
            where, fraction = part.select
            cut = _line_cut(text, fraction)
            text = text[:cut] if where == "head" else text[cut:]
        if text:
            yield text
        return
    texts = _record_texts(file, text_field)
    if part.select is None:
        yield from texts
        return
    where, fraction = part.select
    for index, text in enumerate(texts):
        if (_unit_hash(f"{file.relpath}#{index}") < fraction) == (where == "records_val"):
            yield text


def _line_cut(text: str, val_fraction: float) -> int:
    """Character offset where the held-out tail starts: the first line break after (1 - fraction)."""
    target = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", target)
    return len(text) if newline < 0 else newline + 1


def generate_documents(parts: list[FilePart], text_field: str) -> Iterator[dict[str, str]]:
    """Generator for `datasets`: one row {"text": ...} per document (top-level, so it pickles)."""
    for part in parts:
        for text in _part_texts(part, text_field):
            yield {"text": text}


# -------------------------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class CorpusSplit:
    """One split of a corpus: a fingerprint plus a way to get its documents as a `datasets` object."""

    name: Literal["train", "validation"]
    fingerprint: str
    description: str
    parts: tuple[FilePart, ...] = ()
    text_field: str = "text"
    hf: dict[str, Any] | None = None
    bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def texts(self) -> Iterator[str]:
        """Documents one by one, without holding the corpus in memory."""
        if self.hf is not None:
            for row in _hf_split_dataset(self.hf, streaming=self.hf["streaming"]):
                if row["text"]:
                    yield row["text"]
            return
        for row in generate_documents(list(self.parts), self.text_field):
            yield row["text"]

    def dataset(self, *, streaming: bool = False):  # -> datasets.Dataset | datasets.IterableDataset
        """A `datasets` object with one column `text`, one row per document."""
        if self.hf is not None:
            return _hf_split_dataset(self.hf, streaming=streaming)
        from datasets import Dataset, Features, IterableDataset, Value

        kwargs = {"parts": list(self.parts), "text_field": self.text_field}
        features = Features({"text": Value("string")})
        if streaming:
            return IterableDataset.from_generator(generate_documents, features=features, gen_kwargs=kwargs)
        return Dataset.from_generator(
            generate_documents, features=features, gen_kwargs=kwargs, fingerprint=f"{self.fingerprint}-docs"
        )


@dataclass(frozen=True)
class Corpus:
    spec: DataSpec
    train: CorpusSplit
    val: CorpusSplit

    @property
    def fingerprint(self) -> str:
        return blake(FORMAT_VERSION, self.train.fingerprint, self.val.fingerprint)


def _files_fingerprint(files: list[SourceFile], text_field: str, *extra: str) -> str:
    needs_field = any(f.kind in RECORD_SUFFIXES for f in files)
    parts = [FORMAT_VERSION, text_field if needs_field else "", *extra]
    for file in sorted(files, key=lambda f: f.relpath):
        parts += [file.relpath, file.digest]
    return blake(*parts)


def _split_files(source: str, files: list[SourceFile], spec: DataSpec) -> tuple[CorpusSplit, CorpusSplit]:
    field_ = spec.text_field
    if len(files) == 1:
        only = files[0]
        mode = "lines" if only.kind in TEXT_SUFFIXES else "records"
        select = ("head", "tail") if mode == "lines" else ("records_train", "records_val")
        base = _files_fingerprint(files, field_, f"single-{mode}", repr(spec.val_fraction))
        train_bytes = val_bytes = None
        if mode == "lines":
            text = Path(only.path).read_text(encoding="utf-8")
            cut = _line_cut(text, spec.val_fraction)
            train_bytes, val_bytes = len(text[:cut].encode()), len(text[cut:].encode())
        train = CorpusSplit(_TRAIN, blake(base, _TRAIN), f"{source} ({mode} before the last {spec.val_fraction:.0%})",
                            (FilePart(only, (select[0], spec.val_fraction)),), field_, bytes=train_bytes)
        val = CorpusSplit(_VAL, blake(base, _VAL), f"{source} (held-out {mode})",
                          (FilePart(only, (select[1], spec.val_fraction)),), field_, bytes=val_bytes)
        return train, val
    scored = sorted(files, key=lambda f: _unit_hash(f.relpath))
    val_files = [f for f in scored if _unit_hash(f.relpath) < spec.val_fraction]
    # Small corpora: still hold out one file, and keep one for training.
    if not val_files:
        val_files = scored[:1]
    if len(val_files) == len(files):
        val_files = val_files[:-1]
    val_set = {f.relpath for f in val_files}
    train_files = [f for f in files if f.relpath not in val_set]
    val_files = [f for f in files if f.relpath in val_set]
    return (
        _whole_files_split(_TRAIN, source, train_files, field_),
        _whole_files_split(_VAL, source, val_files, field_),
    )


def _whole_files_split(name: Literal["train", "validation"], source: str, files: list[SourceFile],
                       text_field: str) -> CorpusSplit:
    return CorpusSplit(
        name, _files_fingerprint(files, text_field), f"{source}: {len(files)} files",
        tuple(FilePart(f) for f in files), text_field,
        # Parquet is compressed: its size does not bound the text size.
        bytes=None if any(f.kind == ".parquet" for f in files) else sum(f.size for f in files),
        extra={"files": len(files)},
    )


# ------------------------------------------------------------------------------------- Hugging Face


def _parse_hf(source: str) -> tuple[str, str | None]:
    name, _, config = source[len("hf:"):].partition(":")
    if not name:
        raise DataError(f"{source!r} names no dataset; write 'hf:NAME' or 'hf:NAME:CONFIG'.")
    return name, config or None


def _load_hf(name: str, config: str | None, split: str, *, streaming: bool):
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except (ConnectionError, FileNotFoundError, OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = (
            "HF offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE=1) and the dataset is not in the local "
            "HF cache: run once online to cache it, or give a local path."
            if offline else "Check the name, config and split, and your network or HF token."
        )
        raise DataError(f"Could not load Hugging Face dataset {name!r} (config {config!r}, split {split!r}): "
                        f"{err}. {hint}") from err


def _hf_split_dataset(hf: dict[str, Any], *, streaming: bool):
    ds = _load_hf(hf["name"], hf["config"], hf["split"], streaming=streaming)
    ds = ds.select_columns([hf["text_field"]])
    if hf["text_field"] != "text":
        ds = ds.rename_column(hf["text_field"], "text")
    fraction, keep_val = hf.get("val_fraction"), hf.get("keep_val")
    if fraction is None:
        return ds
    return ds.filter(_hf_row_selected, with_indices=True, fn_kwargs={"fraction": fraction, "keep_val": keep_val})


def _hf_row_selected(_row: dict[str, Any], index: int, fraction: float, keep_val: bool) -> bool:
    return (_unit_hash(f"row#{index}") < fraction) == keep_val


def _hf_fingerprint(name: str, config: str | None, split: str, text_field: str, streaming: bool) -> str:
    ds = _load_hf(name, config, split, streaming=streaming)
    if text_field not in (ds.column_names or []):
        raise DataError(f"Hugging Face dataset {name!r} split {split!r} has no column {text_field!r}; "
                        f"its columns are {ds.column_names}. Pass text_field= one of those.")
    own = getattr(ds, "_fingerprint", None)
    if own is None:  # a streaming dataset has no content fingerprint; its builder's hash follows the data files
        import datasets

        builder = datasets.load_dataset_builder(name, config)
        own = blake("streaming", name, str(config), split, str(builder.hash), str(builder.config.data_files))
    return own


def _hf_splits(source: str, spec: DataSpec, *, as_val_source: bool = False) -> tuple[CorpusSplit, CorpusSplit | None]:
    name, config = _parse_hf(source)
    base = {"name": name, "config": config, "text_field": spec.text_field, "streaming": spec.streaming}
    train_fp = _hf_fingerprint(name, config, spec.hf_split, spec.text_field, spec.streaming)
    if as_val_source or spec.val_data is not None:
        whole = CorpusSplit(_TRAIN, blake(FORMAT_VERSION, train_fp), source, hf={**base, "split": spec.hf_split})
        return whole, None
    if spec.hf_val_split is not None:
        val_fp = _hf_fingerprint(name, config, spec.hf_val_split, spec.text_field, spec.streaming)
        return (
            CorpusSplit(_TRAIN, blake(FORMAT_VERSION, train_fp), f"{source}[{spec.hf_split}]",
                        hf={**base, "split": spec.hf_split}),
            CorpusSplit(_VAL, blake(FORMAT_VERSION, val_fp), f"{source}[{spec.hf_val_split}]",
                        hf={**base, "split": spec.hf_val_split}),
        )
    fraction = spec.val_fraction
    shared = {**base, "split": spec.hf_split, "val_fraction": fraction}
    return (
        CorpusSplit(_TRAIN, blake(FORMAT_VERSION, train_fp, _TRAIN, repr(fraction)), source,
                    hf={**shared, "keep_val": False}),
        CorpusSplit(_VAL, blake(FORMAT_VERSION, train_fp, _VAL, repr(fraction)), f"{source} (held-out rows)",
                    hf={**shared, "keep_val": True}),
    )


# ---------------------------------------------------------------------------------------- resolving


def _whole_source(source: str, spec: DataSpec, name: Literal["train", "validation"]) -> CorpusSplit:
    if source.startswith("hf:"):
        whole, _ = _hf_splits(source, spec, as_val_source=True)
        return CorpusSplit(name, whole.fingerprint, whole.description, hf=whole.hf)
    files = _read_source_files(source, spec.text_field)
    return _whole_files_split(name, source, files, spec.text_field)


def resolve_corpus(data: str | DataSpec | None = None, **overrides: Any) -> Corpus:
    """Find, read and fingerprint the corpus, and decide its split; tokenizes nothing."""
    spec = as_spec(data, **overrides)
    source = spec.data or "stdlib"
    if spec.val_data is not None:
        return Corpus(spec, _whole_source(source, spec, _TRAIN), _whole_source(spec.val_data, spec, _VAL))
    if source.startswith("hf:"):
        train, val = _hf_splits(source, spec)
        assert val is not None
        return Corpus(spec, train, val)
    files = _read_source_files(source, spec.text_field)
    train, val = _split_files(source, files, spec)
    return Corpus(spec, train, val)
