"""A dataset saved with `datasets`' `save_to_disk` (a directory with `state.json`, or `dataset_dict.json` for
a DatasetDict, whose splits `hf_split` / `hf_val_split` pick), read with `load_from_disk`: memory-mapped
Arrow, its content fingerprint the one `datasets` saved with it."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from tasks.data.errors import DataError
from tasks.data.sources.base import SourceKind, TableRef

_MARKERS = ("state.json", "dataset_dict.json")


def _directory(source: str) -> Path:
    return Path(os.path.expanduser(source)).resolve()


def claims(source: str) -> bool:
    directory = _directory(source)
    return any((directory / marker).is_file() for marker in _MARKERS)


def load(table: TableRef):  # -> datasets.Dataset | datasets.IterableDataset
    import datasets

    loaded = datasets.load_from_disk(str(_directory(table.source)))
    if isinstance(loaded, datasets.DatasetDict):
        if table.split not in loaded:
            raise DataError(
                f"The saved dataset {table.source} has no split {table.split!r}; its splits are "
                f"{list(loaded)}: set hf_split (and hf_val_split) to one of those."
            )
        loaded = loaded[table.split]
    return loaded.to_iterable_dataset() if table.streaming else loaded


def fingerprint(table: TableRef) -> str:
    """The fingerprint `datasets` saved with the split (memory-mapped: nothing is read)."""
    return load(replace(table, streaming=False))._fingerprint


KIND = SourceKind(
    name="saved",
    priority=20,
    claims=claims,
    check=lambda source: None,
    load_table=load,
    table_fingerprint=fingerprint,
    named_splits=True,
)
