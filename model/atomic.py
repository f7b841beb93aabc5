"""Publish a file or a directory atomically: build it under a private name beside its place, then rename.

A reader sees the old version or the new one, never half of one, and a writer killed at any moment leaves
at most a hidden `.NAME.tmp-*` entry behind (`remove_stale` clears them).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_TMP_INFIX = ".tmp-"


def staging_path(final: str | os.PathLike[str]) -> Path:
    """A private name beside `final` (same file system, so the rename is atomic), unique per writer."""
    final = Path(final)
    return final.parent / f".{final.name}{_TMP_INFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextmanager
def atomic_file(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a private path to write; on success it replaces `final` in one rename, on error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_path(final)
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(final: str | os.PathLike[str], text: str) -> Path:
    with atomic_file(final) as tmp:
        tmp.write_text(text)
    return Path(final)


@dataclass
class StagedDir:
    path: Path  # where to write the directory's content
    final: Path
    published: bool = False  # False after the block when another writer's `final` was kept


@contextmanager
def atomic_dir(
    final: str | os.PathLike[str], *, replace: bool = False, durable: bool = False
) -> Iterator[StagedDir]:
    """Yield a private directory to fill; on success it becomes `final`, on error it is removed.

    If `final` already exists: `replace=False` keeps it (another writer of the same content won; ours is
    discarded, `published` stays False); `replace=True` puts ours in its place and removes the old one.
    `durable=True` fsyncs every file and the directories, so the content survives a power cut.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = StagedDir(path=staging_path(final), final=final)
    staged.path.mkdir()
    try:
        yield staged
        if durable:
            _fsync_tree(staged.path)
        staged.published = _publish(staged.path, final, replace=replace)
        if durable:
            _fsync(final.parent)
    finally:
        shutil.rmtree(staged.path, ignore_errors=True)


def _publish(staging: Path, final: Path, *, replace: bool) -> bool:
    if final.exists() and replace:
        old = staging_path(final)
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old, ignore_errors=True)
        return True
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
        return False
    return True


def remove_stale(parent: str | os.PathLike[str], name: str = "*") -> list[Path]:
    """Delete the `.NAME.tmp-*` entries that killed writers left in `parent`; returns what was removed.

    Only for directories that one writer at a time works in (a run directory, a cache slot under a lock):
    a live writer's entry looks the same.
    """
    removed = []
    for path in Path(parent).glob(f".{name}{_TMP_INFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(root)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
