"""File formats of local corpora, and reading a file's documents while hashing the bytes read.

Text files (`.txt`, `.md`, `.py`) are documents; `.jsonl` / `.json` records and `.parquet` rows are
documents (field `text_field`). `.jsonl` may be compressed (`.jsonl.gz`, `.jsonl.zst`). Prose files
(`.txt`, `.md`) longer than `SEGMENT_CHARS` are read as line-aligned segments, each a document: a book in one
file splits by its segments, and is never held in memory whole.

Every reader hashes the file's bytes as it reads them (`HashingReader`), so what was tokenized can be checked
against the digest the corpus was listed with (`tasks.data.documents`).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterator
from typing import IO, Any

from tasks.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".py")
SEGMENTED_SUFFIXES = (".txt", ".md")  # prose; code files are documents whole
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
COMPRESSED = {".jsonl": (".gz", ".zst")}
KNOWN_SUFFIXES = (
    TEXT_SUFFIXES + RECORD_SUFFIXES + tuple(kind + c for kind, codecs in COMPRESSED.items() for c in codecs)
)
SEGMENT_CHARS = 1 << 16


def split_suffix(name: str) -> tuple[str, str]:
    """(format, compression) of a file name: `a.jsonl.gz` → (".jsonl", ".gz"); unknown → ("", "")."""
    lower = name.lower()
    for kind, codecs in COMPRESSED.items():
        for codec in codecs:
            if lower.endswith(kind + codec):
                return kind, codec
    for kind in TEXT_SUFFIXES + RECORD_SUFFIXES:
        if lower.endswith(kind):
            return kind, ""
    return "", ""


def is_known(name: str) -> bool:
    return split_suffix(name)[0] != ""


class HashingReader(io.RawIOBase):
    """A raw reader that feeds every byte it passes on into a blake2b digest."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._hash = hashlib.blake2b(digest_size=16)
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = self._raw.readinto(buffer)
        if count:
            self._hash.update(memoryview(buffer)[:count])
            self.size += count
        return count or 0

    def finish(self) -> tuple[str, int]:
        """Hash what is left unread (a reader may stop before the end), then (digest, size)."""
        while chunk := self._raw.read(1 << 20):
            self._hash.update(chunk)
            self.size += len(chunk)
        return self._hash.hexdigest(), self.size


def _decompressed(raw: HashingReader, codec: str) -> IO[bytes]:
    if codec == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if codec == ".zst":
        try:
            import zstandard
        except ImportError as err:
            raise DataError("Reading .zst needs the zstandard package: pip install zstandard") from err
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)  # type: ignore[return-value]
    return io.BufferedReader(raw, buffer_size=1 << 20)  # type: ignore[arg-type]


def _text(raw: HashingReader, codec: str = "") -> io.TextIOWrapper:
    return io.TextIOWrapper(_decompressed(raw, codec), encoding="utf-8")


def text_documents(raw: HashingReader, kind: str) -> Iterator[str]:
    """A text file's documents: the whole file, or (prose) its line-aligned segments."""
    handle = _text(raw)
    if kind not in SEGMENTED_SUFFIXES:
        yield handle.read()
        return
    segment: list[str] = []
    size = 0
    for line in handle:
        segment.append(line)
        size += len(line)
        if size >= SEGMENT_CHARS:
            yield "".join(segment)
            segment, size = [], 0
    if segment:
        yield "".join(segment)


def records(
    raw: HashingReader, path: str, kind: str, codec: str, columns: list[str] | None = None
) -> Iterator[dict[str, Any]]:
    """A record file's records (only `columns` of a Parquet file, when given)."""
    if kind == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # Parquet is read from its footer first: the bytes are read (and hashed) whole, then parsed.
        table = pq.ParquetFile(pa.BufferReader(raw.read()))
        for batch in table.iter_batches(batch_size=1024, columns=columns):
            yield from batch.to_pylist()
        return
    handle = _text(raw, codec)
    if kind == ".json":
        loaded = json.load(handle)
        for record in loaded if isinstance(loaded, list) else [loaded]:
            if not isinstance(record, dict):
                raise DataError(f"{path} must hold a JSON object or a list of objects.")
            yield record
        return
    for number, line in enumerate(handle, start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{number} is not valid JSON ({err.msg}); fix or remove that line."
                ) from err
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number} is not a JSON object; each line must be one.")
            yield record


def record_fields(path: str) -> list[str] | None:
    """The fields of a record file's first record (a Parquet file's columns); None when it has none."""
    kind, codec = split_suffix(path)
    if kind == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(path).names
    with open(path, "rb") as handle:
        first = next(records(HashingReader(handle), path, kind, codec), None)  # type: ignore[arg-type]
    return None if first is None else list(first)
