"""File formats of local corpora, and reading a file's documents while hashing the bytes read.

Text files (`.txt`, `.md`, `.py`) are documents; `.jsonl` / `.json` records and `.parquet` rows are
documents (field `text_field`). `.jsonl` may be compressed (`.jsonl.gz`, `.jsonl.zst`). Prose files
(`.txt`, `.md`) longer than `SEGMENT_CHARS` are read as line-aligned segments, each a document: a book in one
file splits by its segments, and is never held in memory whole.

Every reader hashes the file's bytes as it reads them (`HashingReader`), so what was tokenized can be checked
against the digest the corpus was listed with (`tasks.data.documents`).
"""

from __future__ import annotations

import codecs as text_codecs
import gzip
import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from tasks.data.errors import DataError, not_utf8

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
    """A raw reader that feeds the file's bytes, in file order, into a blake2b digest as they are read.

    Sequential reads hash what they pass on. A reader that seeks (Parquet: the footer first, then row groups,
    skipping unselected columns) is hashed in order too: the bytes it skips before a later read are read and
    hashed then (each byte once, in 1 MiB chunks), except reads in the footer (`tail`), which `finish` hashes."""

    def __init__(self, raw: IO[bytes], tail: int | None = None) -> None:
        self._raw = raw
        self._hash = hashlib.blake2b(digest_size=16)
        self._pos = 0
        self.tail = tail  # reads at or after this offset (a footer) are not hashed in order
        self.size = 0  # bytes hashed so far: every byte before this offset

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = self._raw.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def _hash_upto(self, end: int) -> None:
        """Read and hash the skipped bytes [size, end), then return to where the reader was."""
        self._raw.seek(self.size)
        while self.size < end and (chunk := self._raw.read(min(1 << 20, end - self.size))):
            self._hash.update(chunk)
            self.size += len(chunk)
        self._raw.seek(self._pos)

    def readinto(self, buffer: Any) -> int:
        start = self._pos
        if self.size < start and (self.tail is None or start < self.tail):
            self._hash_upto(start)
        count = self._raw.readinto(buffer) or 0
        self._pos += count
        if start <= self.size < self._pos:
            self._hash.update(memoryview(buffer)[self.size - start : count])
            self.size = self._pos
        return count

    def finish(self) -> tuple[str, int]:
        """Hash what is left unread (a reader may stop before the end), then (digest, size)."""
        self._raw.seek(self.size)
        while chunk := self._raw.read(1 << 20):
            self._hash.update(chunk)
            self.size += len(chunk)
        return self._hash.hexdigest(), self.size


class _ZstdReader(io.RawIOBase):
    """The frames of a .zst stream one after another, and an error when the last one is cut short (zstandard's
    `stream_reader` ends quietly there: a truncated download would pass as a shorter file)."""

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._raw, self._context, self._error = raw, zstandard.ZstdDecompressor(), zstandard.ZstdError
        self._frame = self._context.decompressobj()
        self._pending = b""
        self._started = False  # the current frame has had input

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._started and not self._frame.eof:
                    raise self._error("the stream ends inside a frame: the file is truncated")
                return 0
            while chunk:
                if self._frame.eof:
                    self._frame, self._started = self._context.decompressobj(), False
                self._started = True
                self._pending += self._frame.decompress(chunk)
                chunk = self._frame.unused_data if self._frame.eof else b""
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count


def _decompressed(raw: HashingReader, codec: str) -> IO[bytes]:
    if codec == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if codec == ".zst":
        try:
            import zstandard  # noqa: F401
        except ImportError as err:
            raise DataError("Reading .zst needs the zstandard package: pip install zstandard") from err
        return io.BufferedReader(_ZstdReader(raw), buffer_size=1 << 20)
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
    """A record file's records (only `columns` of a Parquet file, when given); DataError for a bad file."""
    if kind == ".parquet":
        yield from _parquet_records(raw, path, columns)
        return
    handle = _text(raw, codec)
    if kind == ".json":
        yield from _json_records(_parse_json(handle, path), path)
        return
    try:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield _jsonl_record(line, path, number)
    except (EOFError, OSError, _zstd_error()) as err:  # a truncated or corrupt .gz / .zst
        raise bad_file(path, err) from err


def _parquet_records(raw: HashingReader, path: str, columns: list[str] | None) -> Iterator[dict[str, Any]]:
    """Row group by row group from the file handle (never the whole file in memory), hashed in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        end = raw.seek(0, io.SEEK_END)
        raw.tail = max(end - 8, 0)
        raw.seek(raw.tail)
        tail = raw.read(8)
        if len(tail) < 8 or tail[4:] != b"PAR1":
            raise pa.ArrowInvalid("no Parquet footer at the end of the file")
        # The footer, and the 64 KiB pyarrow reads speculatively to find it, are hashed in order later.
        raw.tail = max(0, min(end - 8 - int.from_bytes(tail[:4], "little"), end - (1 << 16)))
        raw.seek(0)
        table = pq.ParquetFile(raw)
        for batch in table.iter_batches(batch_size=1024, columns=columns):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise bad_file(path, err) from err


def _parse_json(handle: IO[str], path: str) -> Any:
    try:
        return json.load(handle)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); fix the file, "
            "or remove it from the corpus."
        ) from err


def _json_records(loaded: Any, path: str) -> Iterator[dict[str, Any]]:
    for record in loaded if isinstance(loaded, list) else [loaded]:
        if not isinstance(record, dict):
            raise DataError(f"{path} must hold a JSON object or a list of objects.")
        yield record


def _jsonl_record(line: str, path: str, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number} is not valid JSON ({err.msg}); fix or remove that line.") from err
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number} is not a JSON object; each line must be one.")
    return record


def _zstd_error() -> type[Exception]:
    try:
        import zstandard
    except ImportError:
        return DataError  # nothing is raised by a codec that cannot be read
    return zstandard.ZstdError


def bad_file(path: str, err: BaseException) -> DataError:
    """The error for a file its format's reader cannot read (truncated, corrupt, not of its format)."""
    kind, codec = split_suffix(path)
    what = f"{kind}{codec} ({'truncated or corrupt' if codec else 'corrupt or not ' + kind[1:]})"
    return DataError(
        f"{path} is not a readable {what}: {type(err).__name__}: {err}. Download or write it again, or remove "
        "it from the corpus."
    )


@dataclass(frozen=True)
class Scan:
    """What listing a file learns from one read of it: the digest and size of its bytes, and a record file's
    fields (None: a text file, or a record file without records)."""

    digest: str
    size: int
    fields: list[str] | None = None


def scan(path: str) -> Scan:
    """Read a file once: hash it and check it can be read whole (a truncated .gz/.zst, a corrupt Parquet or
    an invalid .json is a DataError now, before any tokenizing). Plain text that is not UTF-8 raises
    UnicodeDecodeError (the caller skips the file); inside a compressed file, DataError."""
    kind, codec = split_suffix(path)
    with open(path, "rb") as handle:
        raw = HashingReader(handle)
        fields = None
        if kind == ".parquet":
            fields = _parquet_fields(path)
        elif kind == ".json":
            first = next(_json_records(_parse_json(_text(raw), path), path), None)
            fields = None if first is None else list(first)
        elif codec or kind == ".jsonl":
            fields = _check_jsonl(raw, path, codec)
        else:
            _check_utf8(raw)
        digest, size = raw.finish()
    return Scan(digest, size, fields)


def _parquet_fields(path: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).schema_arrow.names
    except (pa.ArrowException, OSError) as err:
        raise bad_file(path, err) from err


def _check_jsonl(raw: HashingReader, path: str, codec: str) -> list[str] | None:
    """The first record's fields, after decoding the whole file (its compression and UTF-8: not its JSON,
    whose bad lines are named, with their numbers, when it is tokenized)."""
    handle = _text(raw, codec)
    try:
        first = next((line for line in handle if line.strip()), None)
        while handle.read(1 << 20):
            pass
    except UnicodeDecodeError as err:
        if not codec:
            raise
        raise not_utf8(path, err) from err
    except (EOFError, OSError, _zstd_error()) as err:
        raise bad_file(path, err) from err
    return None if first is None else list(_jsonl_record(first, path, 1))


def _check_utf8(raw: HashingReader) -> None:
    decoder = text_codecs.getincrementaldecoder("utf-8")()
    offset = 0
    while chunk := raw.read(1 << 20):
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as err:
            err.start += offset
            raise
        offset += len(chunk)
    decoder.decode(b"", final=True)
