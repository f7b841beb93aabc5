"""The token cache on disk (`<home>/cache/tokens`, written by `tasks.data.tokens`): what it holds, and its
lock (pruning it, with the other caches, is `tasks.data.cache_budget`).

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
    data: str = ""  # the `.bin` and `.json` files
    meta: str = ""


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
def exclusive(on_wait: object = None, *, wait: bool = True) -> Iterator[bool]:
    """Hold the token cache alone; `on_wait()` is called once when builds hold it and this waits. With
    `wait=False` it does not wait: the block gets False (not held) instead."""
    with open(_lock_path(), "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            if callable(on_wait):
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
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
        found.append(Entry(meta.stem, size, stat.st_mtime, str(data), str(meta)))
    return sorted(found, key=lambda e: (e.last_used, e.key))


def orphans(root: Path | None = None) -> list[Path]:
    """Halves of entries: a `.json` without its `.bin` (the tokens were deleted) or a `.bin` without its
    `.json` older than any live writer (a writer publishes the `.bin`, then the `.json` at once)."""
    root = root or tokens_dir()
    now = time.time()
    found = []
    for path in sorted(root.glob("*/*.*")) if root.is_dir() else []:
        if path.name.startswith(".") or path.suffix not in (".json", ".bin"):
            continue
        other = path.with_suffix(".bin" if path.suffix == ".json" else ".json")
        try:
            if not other.exists() and (path.suffix == ".json" or now - path.stat().st_mtime > 3600):
                found.append(path)
        except FileNotFoundError:
            continue
    return found


def entry_paths(key: str, root: Path | None = None) -> tuple[str, str]:
    """(tokens, counts) files of an entry; strings, as they are looked up for every part of a corpus."""
    base = os.path.join(root or tokens_dir(), key[:2], key)
    return base + ".bin", base + ".json"


def remove_stale_staging(root: Path, now: float) -> int:
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
