"""Content-addressed cache directories, published atomically.

A result is built in a private staging directory beside its final place and then renamed into it,
so readers never see a half-written directory. When two processes build the same key at once, the
first rename wins; the loser discards its copy and uses the winner's (same inputs, same content).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

COMPLETE_MARKER = "meta.json"


def staging_dir(final: Path) -> Path:
    """A fresh private directory beside `final` (same file system, so the rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def publish(staging: Path, final: Path) -> bool:
    """Move `staging` to `final`; returns False (and deletes staging) when another process won."""
    try:
        os.rename(staging, final)
        return True
    except OSError:
        if not (final / COMPLETE_MARKER).is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return False


def is_complete(final: Path) -> bool:
    return (final / COMPLETE_MARKER).is_file()


def _prefect_results_dir() -> Path:
    from tasks import settings

    return settings.cache_dir() / "prefect-results"


# Where the data stages' Prefect tasks persist their (small, JSON) results. Read once at import:
# Prefect takes a task's result storage at definition, as a path or a server-side saved block.
PREFECT_RESULTS_DIR = _prefect_results_dir()


def prefect_cache_key(task_name: str, fingerprint: str, output: Path) -> str:
    """Prefect cache key for a task whose result points at `output`.

    If `output` was deleted (a cleared cache), the persisted result would hand out a dangling path:
    drop that record so the task runs again and rebuilds.
    """
    key = f"{task_name}-{fingerprint}"
    if not is_complete(output):
        (PREFECT_RESULTS_DIR / key).unlink(missing_ok=True)
    return key
