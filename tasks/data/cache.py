"""Content-addressed cache directories of the data stages, and the Prefect cache records that point at them.

A result is built in a private staging directory and renamed into place (`model.atomic.atomic_dir`), so
readers never see a half-written directory. Builders of one cache slot take its lock first (`build_lock`):
when two runs need the same dataset at once, one builds it and the other waits and then uses it, instead of
both tokenizing. Under the lock, staging directories that a killed builder left behind are removed.

The Prefect records hold refs whose paths are relative to the llamaflow home (`tasks.refs.HomePath`), so a
hit is resolved against the home of the process that reads it; a record whose directory is gone from that
home is dropped and the task runs again.
"""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from model.atomic import remove_stale
from tasks import home
from tasks.data.errors import data_logger
from tasks.data.slot import is_complete, touch

_HELD = threading.local()  # the lock files this thread holds


def lock_path(final: Path) -> Path:
    """The lock file of cache slot `final` (under `<home>/cache/locks`)."""
    locks = home.cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"{final.parent.name}-{final.name}.lock"


@contextmanager
def build_lock(final: Path) -> Iterator[None]:
    """Hold the exclusive lock of cache slot `final` (one builder at a time, across processes).

    The lock file lives under `<home>/cache/locks`, not beside the slot, so cache directories hold only
    published entries. `flock` is released by the kernel when a holder dies, so a crash never leaves it held.
    """
    lock = lock_path(final)
    held = _HELD.__dict__.setdefault("locks", set())
    if lock in held:  # this thread holds it already (the flow's build_data around build_dataset)
        yield
        return
    with open(lock, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        held.add(lock)
        try:
            removed = remove_stale(final.parent, final.name)  # no live builder of this slot exists now
            if removed:
                data_logger().info(
                    f"removed {len(removed)} staging directories of a crashed build of {final}"
                )
            yield
        finally:
            held.discard(lock)
            fcntl.flock(handle, fcntl.LOCK_UN)


def prefect_cache_key(task_name: str, fingerprint: str, output: Path) -> str:
    """Prefect cache key for a task whose result points at `output` (a directory under the current home).

    If `output` is missing here (a cleared cache, another home, another machine), the persisted result
    would hand out a path that does not exist: drop that record so the task runs again and rebuilds.
    Records live in the task's result storage, Prefect's default unless configured
    (`PREFECT_LOCAL_STORAGE_PATH`, a default storage block).
    """
    key = f"{task_name}-{fingerprint}"
    if not is_complete(output):
        _forget_record(key)
    else:
        touch(output)  # a cache hit is a use
    return key


def _forget_record(key: str) -> None:
    from prefect.filesystems import LocalFileSystem
    from prefect.results import get_result_store

    storage = get_result_store().result_storage
    if storage is None:
        from prefect.results import get_default_result_storage

        storage = get_default_result_storage()
    if isinstance(storage, LocalFileSystem):
        Path(storage.basepath or ".").expanduser().joinpath(key).unlink(missing_ok=True)
