"""What a kind of corpus source is: the contract every module of `tasks/data/sources/` fulfils."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TableRef:
    """A table source's split as it travels to a task (plain values): which kind loads it, and how."""

    kind: str
    source: str
    split: str
    text_field: str
    streaming: bool


@dataclass(frozen=True)
class SourceKind:
    """One kind of source. `claims` says whether a `data` string is of this kind (kinds are asked in
    `priority` order, lowest first); `check` is the cheap test a config runs before any task (syntax,
    existence: no reading). A kind is either file-backed (`list_files`: the files and the root their
    relative paths, the documents' identities, are taken from) or a table read through `datasets`
    (`load_table` and `table_fingerprint`)."""

    name: str
    priority: int
    claims: Callable[[str], bool]
    check: Callable[[str], None]
    list_files: Callable[[str], tuple[list[Path], Path]] | None = None
    load_table: Callable[[TableRef], Any] | None = None
    table_fingerprint: Callable[[TableRef], str] | None = None
    named_splits: bool = False  # the source has named splits (`hf_split`, `hf_val_split` pick them)
