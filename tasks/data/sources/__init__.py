"""Corpus sources, one module per kind; this registry finds them.

A kind is a module of this package that defines `KIND` (a `SourceKind`); adding a kind is adding one
file. `kind_of(source)` asks the kinds in priority order which one a `data` string is; `check_source` is
the one place a config's `data` / `val_data` strings are checked.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from tasks.data.sources.base import SourceKind, TableRef

__all__ = ["SourceKind", "TableRef", "check_source", "kind_of", "kinds"]


@cache
def kinds() -> tuple[SourceKind, ...]:
    found = []
    for module in pkgutil.iter_modules(__path__):
        kind = getattr(importlib.import_module(f"{__name__}.{module.name}"), "KIND", None)
        if isinstance(kind, SourceKind):
            found.append(kind)
    return tuple(sorted(found, key=lambda k: (k.priority, k.name)))


def kind_of(source: str | None) -> SourceKind:
    text = source or "stdlib"
    return next(kind for kind in kinds() if kind.claims(text))  # `local` claims whatever is left


def check_source(source: str | None) -> None:
    """Raise DataError when `source` cannot name a corpus (cheap: nothing is read)."""
    kind_of(source).check(source or "stdlib")
