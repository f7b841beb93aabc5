"""`stdlib` (the default): the running interpreter's standard library sources, without tests,
site-packages and idlelib. Relative paths under the stdlib directory are the documents' identities."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from tasks.data.sources.base import SourceKind

EXCLUDED_DIRS = frozenset({"test", "tests", "site-packages", "idlelib", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_files() -> list[Path]:
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(found)


KIND = SourceKind(
    name="stdlib",
    priority=0,
    claims=lambda source: source == "stdlib",
    check=lambda source: None,
    list_files=lambda source: (stdlib_files(), stdlib_root()),
)
