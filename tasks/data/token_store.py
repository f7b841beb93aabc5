"""The token cache on disk (`<home>/cache/tokens`, written by `tasks.data.tokens`): what it holds, and
pruning it by last use or total size so it cannot fill the disk.

An entry is `<key>.bin` (tokens) and `<key>.json` (counts, written last); the `.json`'s modification time is
the entry's last use (every lookup touches it). Builds hold the cache's lock shared while they look entries
up and pack them (`in_use`); pruning holds it exclusively, so it never removes an entry between a build's
lookup and its read. It waits for running builds instead. A pruned entry is tokenized again when needed.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks import home

STALE_STAGING_SECONDS = 24 * 3600  # a `.*.tmp-*` file this old belongs to no live writer


def tokens_dir() -> Path:
    return home.cache_dir() / "tokens"


@dataclass(frozen=True)
class Entry:
    key: str
    bytes: int
    last_used: float  # seconds since the epoch


def _lock_path() -> Path:
    locks = home.cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / "tokens.lock"


@contextmanager
def in_use() -> Iterator[None]:
    """Hold the token cache shared: no prune runs until the block ends (many builds may hold it)."""
    with open(_lock_path(), "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def exclusive(on_wait: object = None) -> Iterator[None]:
    """Hold the token cache alone; `on_wait()` is called once when builds hold it and this waits."""
    with open(_lock_path(), "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if callable(on_wait):
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def entries(root: Path | None = None) -> list[Entry]:
    """Every complete entry, least recently used first."""
    root = root or tokens_dir()
    found = []
    for meta in root.glob("*/*.json") if root.is_dir() else []:
        data = meta.with_suffix(".bin")
        try:
            stat = meta.stat()
            size = stat.st_size + data.stat().st_size
        except FileNotFoundError:
            continue
        found.append(Entry(meta.stem, size, stat.st_mtime))
    return sorted(found, key=lambda e: (e.last_used, e.key))


def entry_paths(key: str, root: Path | None = None) -> tuple[str, str]:
    """(tokens, counts) files of an entry; strings, as they are looked up for every part of a corpus."""
    base = os.path.join(root or tokens_dir(), key[:2], key)
    return base + ".bin", base + ".json"


def _remove(entry: Entry, root: Path) -> None:
    data, meta = entry_paths(entry.key, root)
    Path(meta).unlink(missing_ok=True)  # first: the entry stops being complete
    Path(data).unlink(missing_ok=True)


def _remove_stale_staging(root: Path, now: float) -> int:
    freed = 0
    for path in root.glob("*/.*.tmp-*") if root.is_dir() else []:
        try:
            stat = path.stat()
            if now - stat.st_mtime > STALE_STAGING_SECONDS:
                path.unlink()
                freed += stat.st_size
        except FileNotFoundError:
            continue
    return freed


def prune(
    *, older_than: float | None = None, max_bytes: int | None = None, on_wait: object = None
) -> tuple[int, int]:
    """Remove entries unused for `older_than` seconds, then the least recently used until the cache holds at
    most `max_bytes`; returns (entries removed, bytes freed). Waits for running builds first."""
    root = tokens_dir()
    with exclusive(on_wait):
        now = time.time()
        found = entries(root)
        doomed = [e for e in found if older_than is not None and now - e.last_used > older_than]
        kept = [e for e in found if e not in doomed]
        total = sum(e.bytes for e in kept)
        for entry in kept:
            if max_bytes is None or total <= max_bytes:
                break
            doomed.append(entry)
            total -= entry.bytes
        for entry in doomed:
            _remove(entry, root)
        freed = sum(e.bytes for e in doomed) + _remove_stale_staging(root, now)
    return len(doomed), freed
