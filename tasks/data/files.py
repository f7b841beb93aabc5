"""Local corpus files: listing a file-backed source, fingerprinting each file's bytes, checking its fields.

Non-UTF-8 text is skipped with a `DataWarning` (a corpus folder often holds a stray binary or Latin-1 file;
failing the whole run for it helps nobody); if nothing is left, `DataError`.
"""

from __future__ import annotations

import codecs
import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path

from tasks.data.errors import DataError, DataWarning, not_utf8
from tasks.data.formats import KNOWN_SUFFIXES, RECORD_SUFFIXES, record_fields, split_suffix


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


# Digests this process computed, by (path, size, mtime, inode, ctime): a flow resolves its corpus several
# times (planning, the cache key, building) and reads each file once. A rewritten file changes its ctime,
# and what is tokenized is checked against its digest again while it is read (tasks.data.documents).
_DIGESTS: dict[tuple[str, int, int, int, int], tuple[str, int]] = {}


def _digest(path: Path, *, check_utf8: bool) -> tuple[str, int]:
    """Content hash and size, read in 1 MiB chunks (files may be larger than memory)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)
    if (known := _DIGESTS.get(key)) is None:
        known = _DIGESTS[key] = _read_digest(path, check_utf8=check_utf8)
    return known


def _read_digest(path: Path, *, check_utf8: bool) -> tuple[str, int]:
    digest = hashlib.blake2b(digest_size=16)
    decoder = codecs.getincrementaldecoder("utf-8")()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            if check_utf8:
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    err.start += size
                    raise
            digest.update(chunk)
            size += len(chunk)
    if check_utf8:
        decoder.decode(b"", final=True)
    return digest.hexdigest(), size


def read_source_files(source: str, paths: list[Path], root: Path, text_field: str) -> list[SourceFile]:
    """The files of a source, hashed, with their paths relative to `root`."""
    result: list[SourceFile] = []
    skipped: list[str] = []
    for path in paths:
        kind, codec = split_suffix(path.name)
        if not kind:
            raise DataError(
                f"{path} has an unknown extension; supported: {', '.join(KNOWN_SUFFIXES)}. Rename it or filter the glob."
            )
        try:
            digest, size = _digest(path, check_utf8=kind != ".parquet" and not codec)
        except UnicodeDecodeError as err:
            warnings.warn(
                f"Skipping {path}: not UTF-8 ({err.reason} near byte {err.start}).", DataWarning, stacklevel=3
            )
            skipped.append(str(path))
            continue
        file = SourceFile(str(path), path.relative_to(root).as_posix(), digest, size)
        check_text_field(file, text_field)
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


def check_text_field(file: SourceFile, text_field: str) -> None:
    """Fail fast when a record file lacks the text field, naming the fields it has."""
    if file.kind not in RECORD_SUFFIXES:
        return
    try:
        fields = record_fields(file.path)
    except UnicodeDecodeError as err:  # a compressed file: its text was not checked with its bytes
        raise not_utf8(file.path, err) from err
    if fields is not None and text_field not in fields:
        raise DataError(
            f"{file.path} has no field {text_field!r}; its fields are {fields}. Pass text_field= one of those."
        )
