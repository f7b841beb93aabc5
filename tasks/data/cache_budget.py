"""One budget for everything the data stages keep on disk: token cache entries, packed datasets, tokenizers
and the `datasets` library's cache (Arrow files of `hf:` and saved sources, `datasets.map` results).

Each item has a size and a last use: a token entry's `.json` modification time (every lookup touches it), a
dataset's or tokenizer's `meta.json` (touched whenever a run takes it, `tasks.data.cache.touch`), the newest
file of a `datasets` cache directory. `prune` removes items unused for `older_than`, then the least recently
used until the total fits `max_bytes`. Broken items (a token entry's `.json` without its `.bin` or the
reverse; a dataset or tokenizer directory without `meta.json`) are shown and always pruned.

What a live run holds is never removed: pruning holds the token cache exclusively (`token_store.exclusive`:
builds hold it shared while they look entries up, pack, and map table sources), and skips a dataset or
tokenizer whose build lock a builder holds. A run training on a dataset has its arrays memory-mapped: on a
local file system removing them frees the space once the run ends, never under it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks import home
from tasks.data import token_store
from tasks.data.cache import lock_path
from tasks.data.slot import COMPLETE_MARKER

KINDS = ("tokens", "datasets", "tokenizers", "hf-datasets")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """`500M`, `20G`, `1.5T` or a number of bytes; ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"{text!r} is not a size: write e.g. 500M, 20G or 1.5T (bytes: 1000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class Item:
    kind: str  # one of KINDS
    paths: tuple[Path, ...]
    bytes: int
    last_used: float  # seconds since the epoch
    label: str  # what it holds: a dataset's corpus, a tokenizer's, a token entry's key
    broken: bool = False


def _size(path: Path) -> tuple[int, float]:
    """Bytes and newest modification time of a file or a directory tree."""
    if path.is_file():
        stat = path.stat()
        return stat.st_size, stat.st_mtime
    size, newest = 0, path.stat().st_mtime
    for root, _, names in os.walk(path):
        for name in names:
            try:
                stat = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            size, newest = size + stat.st_size, max(newest, stat.st_mtime)
    return size, newest


def _token_items() -> list[Item]:
    root = token_store.tokens_dir()
    found = [
        Item("tokens", (Path(e.data), Path(e.meta)), e.bytes, e.last_used, e.key)
        for e in token_store.entries(root)
    ]
    for orphan in token_store.orphans(root):  # half an entry: shown, and removed by any prune
        stat = orphan.stat()
        found.append(Item("tokens", (orphan,), stat.st_size, stat.st_mtime, orphan.stem, broken=True))
    return found


def _slot_items(kind: str, root: Path) -> list[Item]:
    found = []
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if directory.name.startswith(".") or not directory.is_dir():
            continue  # staging: the build lock's holder removes stale ones
        size, newest = _size(directory)
        meta = directory / COMPLETE_MARKER
        label, used = directory.name, newest
        if meta.is_file():
            used = meta.stat().st_mtime
            stats = json.loads(meta.read_text()).get("stats", {})
            label = f"{directory.name[:12]} {stats.get('corpus', '')}".strip()
        found.append(Item(kind, (directory,), size, used, label, broken=not meta.is_file()))
    return found


def hf_datasets_dir() -> Path:
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE)


def _hf_items() -> list[Item]:
    """A `datasets` cache's items: each builder's config directory (`json/default-…`), and `downloads`."""
    root = hf_datasets_dir()
    found = []
    for builder in sorted(root.iterdir()) if root.is_dir() else []:
        if not builder.is_dir() or builder.name.startswith("."):
            continue
        for item in [builder] if builder.name == "downloads" else sorted(builder.iterdir()):
            if item.is_dir():
                size, newest = _size(item)
                found.append(Item("hf-datasets", (item,), size, newest, f"{builder.name}/{item.name}"))
    return found


def items(kinds: tuple[str, ...] = KINDS) -> list[Item]:
    """Every item of `kinds`, least recently used first."""
    cache = home.cache_dir()
    makers: dict[str, Callable[[], list[Item]]] = {
        "tokens": _token_items,
        "datasets": lambda: _slot_items("datasets", cache / "datasets"),
        "tokenizers": lambda: _slot_items("tokenizers", cache / "tokenizers"),
        "hf-datasets": _hf_items,
    }
    found = [item for kind in kinds for item in makers[kind]()]
    return sorted(found, key=lambda i: (i.last_used, i.kind, i.label))


def _remove(item: Item) -> bool:
    """Remove an item unless a builder holds its slot; whether it was removed."""
    if item.kind in ("datasets", "tokenizers"):
        with open(lock_path(item.paths[0]), "a+b") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # being built (or taken) right now
            try:
                (item.paths[0] / COMPLETE_MARKER).unlink(missing_ok=True)  # first: it stops being complete
                shutil.rmtree(item.paths[0], ignore_errors=True)
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return True
    for path in sorted(item.paths, key=lambda p: p.suffix != ".json"):  # a token entry's .json first
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return True


def prune(
    *,
    older_than: float | None = None,
    max_bytes: int | None = None,
    kinds: tuple[str, ...] = KINDS,
    keep: frozenset[Path] = frozenset(),
    on_wait: object = None,
    wait: bool = True,
) -> tuple[list[Item], int] | None:
    """Remove broken items, items unused for `older_than` seconds, then the least recently used until `kinds`
    hold at most `max_bytes` (never the directories in `keep`: what the calling run holds); returns (removed,
    bytes freed), or None when `wait` is False and builds hold the cache. Waits for running builds otherwise."""
    with token_store.exclusive(on_wait, wait=wait) as held:
        if not held:
            return None
        now = time.time()
        every = items(kinds)
        found = [i for i in every if not keep.intersection(i.paths)]
        held = sum(i.bytes for i in every) - sum(i.bytes for i in found)
        doomed = [i for i in found if i.broken or (older_than is not None and now - i.last_used > older_than)]
        kept = [i for i in found if i not in doomed]
        total = held + sum(i.bytes for i in kept)
        for item in kept:
            if max_bytes is None or total <= max_bytes:
                break
            doomed.append(item)
            total -= item.bytes
        removed = [item for item in doomed if _remove(item)]
        freed = sum(i.bytes for i in removed)
        if "tokens" in kinds:
            freed += token_store.remove_stale_staging(token_store.tokens_dir(), now)
    return removed, freed
