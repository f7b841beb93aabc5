"""Content-addressed cache directories of the data stages, and the Prefect cache records that point at them.

A result is built in a private staging directory and renamed into place (`model.atomic.atomic_dir`), so
readers never see a half-written directory. When two processes build the same key at once, the first
rename wins; the loser discards its copy and uses the winner's (same inputs, same content).
"""

from __future__ import annotations

from pathlib import Path

COMPLETE_MARKER = "meta.json"


def is_complete(final: Path) -> bool:
    return (final / COMPLETE_MARKER).is_file()


def prefect_cache_key(task_name: str, fingerprint: str, output: Path) -> str:
    """Prefect cache key for a task whose result points at `output`.

    If `output` was deleted (a cleared cache), the persisted result would hand out a dangling path:
    drop that record so the task runs again and rebuilds. Records live in the task's result storage,
    Prefect's default unless configured (`PREFECT_LOCAL_STORAGE_PATH`, a default storage block).
    """
    key = f"{task_name}-{fingerprint}"
    if not is_complete(output):
        _forget_record(key)
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
