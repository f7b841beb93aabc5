"""Real text for the data tests: modules of this Python's standard library, copied into a corpus or read."""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Twelve small modules (~100 KB of source): enough files for a by-file train/validation split.
MODULES = (
    "textwrap.py",
    "string.py",
    "shlex.py",
    "fnmatch.py",
    "bisect.py",
    "keyword.py",
    "glob.py",
    "colorsys.py",
    "heapq.py",
    "copy.py",
    "struct.py",
    "this.py",
)


def copy_modules(target: Path, names: Sequence[str] = MODULES) -> list[Path]:
    """Copies of the stdlib modules `names` in `target` (created if missing)."""
    target.mkdir(parents=True, exist_ok=True)
    copies = []
    for name in names:
        copy = target / name
        copy.write_bytes((STDLIB / name).read_bytes())
        copies.append(copy)
    return copies


def stdlib_text(names: Sequence[str], limit: int | None = None) -> list[str]:
    """The source of the stdlib modules `names`, each cut to its first `limit` characters."""
    return [(STDLIB / name).read_text(encoding="utf-8")[:limit] for name in names]
