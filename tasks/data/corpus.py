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

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.data.errors import DataError, DataWarning, blake, unit_hash
from tasks.data.files import (
    RECORD_SUFFIXES,
    STDLIB_EXCLUDED_DIRS,
    TEXT_SUFFIXES,
    FilePart,
    SourceFile,
    generate_documents,
    line_cut,
    read_source_files,
)
from tasks.data.hf_datasets import hf_fingerprint, hf_split_dataset, parse_hf

__all__ = [
    "STDLIB_EXCLUDED_DIRS",
    "Corpus",
    "CorpusSplit",
    "DataError",
    "DataSpec",
    "DataWarning",
    "as_spec",
    "blake",
    "resolve_corpus",
]

FORMAT_VERSION = "corpus-v1"
_TRAIN, _VAL = "train", "validation"


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
        raise DataError(
            f"val_fraction={spec.val_fraction} must be between 0 and 1 (exclusive); 0.05 is typical."
        )
    return spec


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
            for row in hf_split_dataset(self.hf, streaming=self.hf["streaming"]):
                if row["text"]:
                    yield row["text"]
            return
        for row in generate_documents(list(self.parts), self.text_field):
            yield row["text"]

    def dataset(self, *, streaming: bool = False):  # -> datasets.Dataset | datasets.IterableDataset
        """A `datasets` object with one column `text`, one row per document."""
        if self.hf is not None:
            return hf_split_dataset(self.hf, streaming=streaming)
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
            cut = line_cut(text, spec.val_fraction)
            train_bytes, val_bytes = len(text[:cut].encode()), len(text[cut:].encode())
        train = CorpusSplit(
            _TRAIN,
            blake(base, _TRAIN),
            f"{source} ({mode} before the last {spec.val_fraction:.0%})",
            (FilePart(only, (select[0], spec.val_fraction)),),
            field_,
            bytes=train_bytes,
        )
        val = CorpusSplit(
            _VAL,
            blake(base, _VAL),
            f"{source} (held-out {mode})",
            (FilePart(only, (select[1], spec.val_fraction)),),
            field_,
            bytes=val_bytes,
        )
        return train, val
    scored = sorted(files, key=lambda f: unit_hash(f.relpath))
    val_files = [f for f in scored if unit_hash(f.relpath) < spec.val_fraction]
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


def _whole_files_split(
    name: Literal["train", "validation"], source: str, files: list[SourceFile], text_field: str
) -> CorpusSplit:
    return CorpusSplit(
        name,
        _files_fingerprint(files, text_field),
        f"{source}: {len(files)} files",
        tuple(FilePart(f) for f in files),
        text_field,
        # Parquet is compressed: its size does not bound the text size.
        bytes=None if any(f.kind == ".parquet" for f in files) else sum(f.size for f in files),
        extra={"files": len(files)},
    )


# ------------------------------------------------------------------------------------- Hugging Face


def _hf_splits(
    source: str, spec: DataSpec, *, as_val_source: bool = False
) -> tuple[CorpusSplit, CorpusSplit | None]:
    name, config = parse_hf(source)
    base = {"name": name, "config": config, "text_field": spec.text_field, "streaming": spec.streaming}
    train_fp = hf_fingerprint(name, config, spec.hf_split, spec.text_field, spec.streaming)
    if as_val_source or spec.val_data is not None:
        whole = CorpusSplit(
            _TRAIN, blake(FORMAT_VERSION, train_fp), source, hf={**base, "split": spec.hf_split}
        )
        return whole, None
    if spec.hf_val_split is not None:
        val_fp = hf_fingerprint(name, config, spec.hf_val_split, spec.text_field, spec.streaming)
        return (
            CorpusSplit(
                _TRAIN,
                blake(FORMAT_VERSION, train_fp),
                f"{source}[{spec.hf_split}]",
                hf={**base, "split": spec.hf_split},
            ),
            CorpusSplit(
                _VAL,
                blake(FORMAT_VERSION, val_fp),
                f"{source}[{spec.hf_val_split}]",
                hf={**base, "split": spec.hf_val_split},
            ),
        )
    fraction = spec.val_fraction
    shared = {**base, "split": spec.hf_split, "val_fraction": fraction}
    return (
        CorpusSplit(
            _TRAIN,
            blake(FORMAT_VERSION, train_fp, _TRAIN, repr(fraction)),
            source,
            hf={**shared, "keep_val": False},
        ),
        CorpusSplit(
            _VAL,
            blake(FORMAT_VERSION, train_fp, _VAL, repr(fraction)),
            f"{source} (held-out rows)",
            hf={**shared, "keep_val": True},
        ),
    )


# ---------------------------------------------------------------------------------------- resolving


def _whole_source(source: str, spec: DataSpec, name: Literal["train", "validation"]) -> CorpusSplit:
    if source.startswith("hf:"):
        whole, _ = _hf_splits(source, spec, as_val_source=True)
        return CorpusSplit(name, whole.fingerprint, whole.description, hf=whole.hf)
    files = read_source_files(source, spec.text_field)
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
    files = read_source_files(source, spec.text_field)
    train, val = _split_files(source, files, spec)
    return Corpus(spec, train, val)
