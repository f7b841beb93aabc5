"""A complete cache slot and its last use, with no Prefect in reach: the engine marks the packed dataset it
takes as used (`tasks.data.packed`), and `tasks.data.cache_budget` prunes the least recently used first."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

COMPLETE_MARKER = "meta.json"


def is_complete(final: Path) -> bool:
    return (final / COMPLETE_MARKER).is_file()


def touch(final: Path) -> None:
    """Mark a complete slot used now."""
    with contextlib.suppress(
        OSError
    ):  # removed meanwhile, or a read-only cache: only the pruning order moves
        os.utime(final / COMPLETE_MARKER)
