"""Local corpus files: listing a file-backed source, fingerprinting each file's bytes, checking its fields.

Non-UTF-8 text is skipped with a `DataWarning` (a corpus folder often holds a stray binary or Latin-1 file;
failing the whole run for it helps nobody); if nothing is left, `DataError`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from tasks.data.digest_index import DigestIndex
from tasks.data.errors import DataError, DataWarning
from tasks.data.formats import KNOWN_SUFFIXES, RECORD_SUFFIXES, split_suffix


@dataclass(frozen=True)
class SourceFile:
    path: str
    relpath: str  # under the root the source names: the identity its documents' split is decided by
    digest: str
    size: int

    @property
    def kind(self) -> str:
        """The format (".jsonl" for `a.jsonl.gz` too)."""
        return split_suffix(self.path)[0]

    @property
    def codec(self) -> str:
        return split_suffix(self.path)[1]


@dataclass(frozen=True)
class FilePart:
    """A file, or the documents of it that fall on one side of the split: `select` = (side, val_fraction);
    `filters`: what each document goes through (a `tasks.data.filters.DocFilter.key`, "" for nothing)."""

    file: SourceFile
    select: tuple[str, float] | None = None
    filters: str = ""


def read_source_files(source: str, paths: list[Path], root: Path, text_field: str) -> list[SourceFile]:
    """The files of a source, hashed, with their paths relative to `root`."""
    result: list[SourceFile] = []
    skipped: list[str] = []
    with DigestIndex() as index:  # an unchanged file is not read again (tasks.data.digest_index)
        for path in paths:
            if not split_suffix(path.name)[0]:
                raise DataError(
                    f"{path} has an unknown extension; supported: {', '.join(KNOWN_SUFFIXES)}. Rename it or "
                    "filter the glob."
                )
            try:
                scanned = index.scan(path)
            except UnicodeDecodeError as err:
                warnings.warn(
                    f"Skipping {path}: not UTF-8 ({err.reason} near byte {err.start}).",
                    DataWarning,
                    stacklevel=3,
                )
                skipped.append(str(path))
                continue
            file = SourceFile(str(path), path.relative_to(root).as_posix(), scanned.digest, scanned.size)
            check_text_field(file, text_field, scanned.fields)
            result.append(file)
    if not result:
        raise DataError(
            f"The data source {source!r} has no usable files (skipped as non-UTF-8: {skipped}); give UTF-8 text."
        )
    if all(f.size == 0 for f in result):
        raise DataError(
            f"The data source {source!r} is empty (all {len(result)} files have 0 bytes); give some text."
        )
    return result


def check_text_field(file: SourceFile, text_field: str, fields: list[str] | None) -> None:
    """Fail fast when a record file lacks the text field, naming the fields it has (`fields`)."""
    if file.kind in RECORD_SUFFIXES and fields is not None and text_field not in fields:
        raise DataError(
            f"{file.path} has no field {text_field!r}; its fields are {fields}. Pass text_field= one of those."
        )
