"""Publish a file or a directory atomically: build it under a private name beside its place, then rename.

A reader sees the old version or the new one, never half of one, and a writer killed at any moment leaves
at most a hidden `.NAME.tmp-*` entry behind (`remove_stale` clears them).

Replacing a directory swaps the two in one `renameat2(RENAME_EXCHANGE)` on Linux. Where that is missing
(another OS, a file system without it) the old directory is first renamed aside to `.NAME.old-*`: a writer
killed before the new one is in place leaves it there, and `remove_stale` puts it back.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_TMP_INFIX = ".tmp-"
_ASIDE_INFIX = ".old-"
_RENAME_EXCHANGE = 2  # linux/fs.h


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
        if not _exchange(staging, final):
            aside = final.parent / f".{final.name}{_ASIDE_INFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(staging, final)
            shutil.rmtree(aside, ignore_errors=True)
        # After an exchange `staging` holds the old directory; the caller removes it.
        return True
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
        return False
    return True


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_cwd = -100  # AT_FDCWD: paths are taken as given
    result = renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(error, f"cannot exchange {a} and {b}: {os.strerror(error)}")


def remove_stale(parent: str | os.PathLike[str], name: str = "*") -> list[Path]:
    """Delete the `.NAME.tmp-*` entries that killed writers left in `parent`, and put back a `.NAME.old-*`
    directory a killed replace moved aside (removed instead if NAME is there again); returns what was removed.

    Only for directories that one writer at a time works in (a run directory, a cache slot under a lock):
    a live writer's entry looks the same.
    """
    parent = Path(parent)
    for aside in parent.glob(f".{name}{_ASIDE_INFIX}*"):
        original = parent / aside.name[1:].rsplit(_ASIDE_INFIX, 1)[0]
        if not original.exists():
            os.rename(aside, original)
    removed = []
    for path in [*parent.glob(f".{name}{_TMP_INFIX}*"), *parent.glob(f".{name}{_ASIDE_INFIX}*")]:
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
