"""Table sources (a Hugging Face dataset, a dataset saved with `save_to_disk`) as corpus splits: a `datasets`
object with one column `text`, held-out rows chosen by their text (a pure function of each row, like every
other document's side), and the content fingerprint `datasets` keeps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tasks.data.documents import is_val
from tasks.data.errors import DataError
from tasks.data.sources import kind_of
from tasks.data.sources.base import TableRef


def load(table: TableRef):  # -> datasets.Dataset | datasets.IterableDataset
    loader = kind_of(table.source).load_table
    assert loader is not None, table
    return loader(table)


def table_fingerprint(table: TableRef) -> str:
    """The table's own content fingerprint; DataError when it lacks the text column."""
    ds = load(table)
    if ds.column_names is not None and table.text_field not in ds.column_names:  # None: streamed, unknown
        raise DataError(
            f"{table.source} split {table.split!r} has no column {table.text_field!r}; "
            f"its columns are {ds.column_names}. Pass text_field= one of those."
        )
    fingerprint = kind_of(table.source).table_fingerprint
    assert fingerprint is not None, table
    return fingerprint(table)


def table_dataset(table: TableRef, select: tuple[str, float] | None, *, streaming: bool | None = None):
    """The table's rows as a dataset with one column `text`; `select` = (side, val_fraction) keeps one side."""
    if streaming is not None and streaming != table.streaming:
        table = replace(table, streaming=streaming)
    ds = load(table).select_columns([table.text_field])
    if table.text_field != "text":
        ds = ds.rename_column(table.text_field, "text")
    if select is None:
        return ds
    return ds.filter(_row_selected, fn_kwargs={"side": select[0], "fraction": select[1]})


def _row_selected(row: dict[str, Any], side: str, fraction: float) -> bool:
    return bool(row["text"]) and is_val(row["text"], fraction) == (side == "validation")
