"""A persistent index of what listing learned about each corpus file, so an unchanged file is not read again.

`<home>/cache/digests.sqlite` maps (path, size, mtime_ns, inode, ctime_ns) to the file's digest, size and
fields (`tasks.data.formats.scan`): a second run over an unchanged corpus hashes nothing. A file rewritten in
place changes its mtime and ctime; and what is tokenized is still hashed as it is read and checked against the
listed digest (`tasks.data.documents`), which also forgets the row of a file whose digest was stale. A home on
a file system where SQLite cannot lock only loses the index: files are hashed as before.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from types import TracebackType

from tasks import home
from tasks.data.errors import data_logger
from tasks.data.formats import Scan, scan

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, inode INTEGER, "
    "ctime_ns INTEGER, digest TEXT, fields TEXT, not_utf8 TEXT)"
)
# What this process learned, by the same key: a flow lists its corpus several times (planning, cache keys).
_KNOWN: dict[tuple[str, int, int, int, int], Scan | UnicodeDecodeError] = {}
_LOCK = threading.Lock()


def index_path() -> Path:
    return home.cache_dir() / "digests.sqlite"


def _key(path: str, stat: os.stat_result) -> tuple[str, int, int, int, int]:
    return (path, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)


def _connect() -> sqlite3.Connection | None:
    try:
        index_path().parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(index_path(), timeout=60)
        connection.execute(_SCHEMA)
        return connection
    except sqlite3.Error as err:
        data_logger().warning(f"the digest index {index_path()} cannot be used ({err}): hashing every file")
        return None


class DigestIndex:
    """`scan(path)` through the index; new rows are written in one transaction when the block ends."""

    def __enter__(self) -> DigestIndex:
        self._db = _connect()
        self._new: list[tuple[object, ...]] = []
        return self

    def scan(self, path: Path) -> Scan:
        """The file's `Scan`; raises UnicodeDecodeError for plain text that is not UTF-8 (remembered too)."""
        key = _key(str(path), path.stat())
        known = _KNOWN.get(key) or self._lookup(key)
        if known is None:
            try:
                known = scan(str(path))
            except UnicodeDecodeError as err:
                known = err
            self._new.append((*key, *_row(known)))
        _KNOWN[key] = known
        if isinstance(known, UnicodeDecodeError):
            raise known
        return known

    def _lookup(self, key: tuple[str, int, int, int, int]) -> Scan | UnicodeDecodeError | None:
        if self._db is None:
            return None
        row = self._db.execute(
            "SELECT size, mtime_ns, inode, ctime_ns, digest, fields, not_utf8 FROM files WHERE path = ?",
            (key[0],),
        ).fetchone()
        if row is None or tuple(row[:4]) != key[1:]:
            return None
        if row[6] is not None:
            reason, start = json.loads(row[6])
            return UnicodeDecodeError("utf-8", b"", start, start + 1, reason)
        return Scan(row[4], key[1], None if row[5] is None else json.loads(row[5]))

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._db is None:
            return
        try:
            if self._new:
                with _LOCK, self._db:
                    self._db.executemany(
                        "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)", self._new
                    )
        except sqlite3.Error as err:
            data_logger().warning(f"the digest index {index_path()} was not updated ({err})")
        finally:
            self._db.close()


def _row(known: Scan | UnicodeDecodeError) -> tuple[object, ...]:
    if isinstance(known, UnicodeDecodeError):
        return ("", None, json.dumps([known.reason, known.start]))
    return (known.digest, None if known.fields is None else json.dumps(known.fields), None)


def forget(path: str) -> None:
    """Drop what is known of `path` (its digest was found stale when it was read)."""
    for key in [key for key in _KNOWN if key[0] == path]:
        _KNOWN.pop(key, None)
    db = _connect()
    if db is None:
        return
    try:
        with db:
            db.execute("DELETE FROM files WHERE path = ?", (path,))
    except sqlite3.Error:
        pass
    finally:
        db.close()
