"""Local corpus files: finding them, fingerprinting their bytes, reading their documents.

Text files (`.txt`, `.md`, `.py`) are one document each; `.jsonl` / `.json` one per record and
`.parquet` one per row, from the field `text_field`. Non-UTF-8 text is skipped with a `DataWarning`.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.data.errors import DataError, DataWarning, unit_hash

TEXT_SUFFIXES = (".txt", ".md", ".py")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
KNOWN_SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "site-packages", "idlelib", "__pycache__"})


@dataclass(frozen=True)
class SourceFile:
    path: str
    relpath: str
    digest: str
    size: int

    @property
    def kind(self) -> str:
        return os.path.splitext(self.path)[1].lower()  # not pathlib: called per file, many times


@dataclass(frozen=True)
class FilePart:
    """A file, or part of one: `select` picks lines (text) or records by hashed index."""

    file: SourceFile
    select: tuple[str, float] | None = None  # ("head"|"tail"|"records_train"|"records_val", fraction)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_files() -> list[Path]:
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS)
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(found)


def expand(source: str) -> tuple[list[Path], Path]:
    """Files of a path/glob/directory source and the root their relative paths are taken from."""
    if source == "stdlib":
        return stdlib_files(), stdlib_root()
    if glob.has_magic(source) and not Path(os.path.expanduser(source)).exists():
        matches = sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(source), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise DataError(
                f"The glob {source!r} matches no files; check the pattern and the working directory."
            )
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
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix.lower() in KNOWN_SUFFIXES and "__pycache__" not in p.parts
        )
        if not files:
            raise DataError(
                f"Directory {path} holds no files with a known extension {KNOWN_SUFFIXES}; point data at text files."
            )
        return files, path
    return [path], path.parent


# Digests this process computed, by (path, size, mtime, inode, ctime): a flow resolves its corpus several
# times (planning, the cache key, building) and reads each file once. A rewritten file changes its mtime.
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


def read_source_files(source: str, text_field: str) -> list[SourceFile]:
    paths, root = expand(source)
    result: list[SourceFile] = []
    skipped: list[str] = []
    for path in paths:
        if path.suffix.lower() not in KNOWN_SUFFIXES:
            raise DataError(
                f"{path} has an unknown extension; supported: {', '.join(KNOWN_SUFFIXES)}. Rename it or filter the glob."
            )
        try:
            digest, size = _digest(path, check_utf8=path.suffix.lower() != ".parquet")
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
    if file.kind == ".parquet":
        import pyarrow.parquet as pq

        fields = pq.read_schema(file.path).names
    else:
        first = next(iter_records(file), None)
        if first is None:
            return
        fields = list(first)
    if text_field not in fields:
        raise DataError(
            f"{file.path} has no field {text_field!r}; its fields are {fields}. "
            f"Pass text_field= one of those."
        )


def iter_records(file: SourceFile) -> Iterator[dict[str, Any]]:
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


def record_texts(file: SourceFile, text_field: str) -> Iterator[str]:
    if file.kind == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(file.path).iter_batches(columns=[text_field], batch_size=1024):
            yield from (text for text in batch.column(0).to_pylist() if text)
        return
    for index, record in enumerate(iter_records(file)):
        if text_field not in record:
            raise DataError(
                f"{file.path} record {index} has no field {text_field!r}; its fields are {list(record)}."
            )
        text = record[text_field]
        if text:
            yield str(text)


def part_texts(part: FilePart, text_field: str) -> Iterator[str]:
    file = part.file
    if file.kind in TEXT_SUFFIXES:
        text = Path(file.path).read_text(encoding="utf-8")
        if part.select is not None:
            where, fraction = part.select
            cut = line_cut(text, fraction)
            text = text[:cut] if where == "head" else text[cut:]
        if text:
            yield text
        return
    texts = record_texts(file, text_field)
    if part.select is None:
        yield from texts
        return
    where, fraction = part.select
    for index, text in enumerate(texts):
        if (unit_hash(f"{file.relpath}#{index}") < fraction) == (where == "records_val"):
            yield text


def line_cut(text: str, val_fraction: float) -> int:
    """Character offset where the held-out tail starts: the first line break after (1 - fraction)."""
    target = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", target)
    return len(text) if newline < 0 else newline + 1


def generate_documents(parts: list[FilePart], text_field: str) -> Iterator[dict[str, str]]:
    """Generator for `datasets`: one row {"text": ...} per document (top-level, so it pickles)."""
    for part in parts:
        for text in part_texts(part, text_field):
            yield {"text": text}
