"""`hf:NAME[:CONFIG]`: a Hugging Face dataset from the hub, the local HF cache (offline in tests) or a local
data folder, through `datasets.load_dataset`; `hf_split` / `hf_val_split` name its splits."""

from __future__ import annotations

import os

from tasks.data.errors import DataError, blake
from tasks.data.sources.base import SourceKind, TableRef

PREFIX = "hf:"


def parse(source: str) -> tuple[str, str | None]:
    name, _, config = source[len(PREFIX) :].partition(":")
    if not name:
        raise DataError(f"{source!r} names no dataset; write 'hf:NAME' or 'hf:NAME:CONFIG'.")
    return name, config or None


def load(table: TableRef):  # -> datasets.Dataset | datasets.IterableDataset
    import datasets

    name, config = parse(table.source)
    try:
        return datasets.load_dataset(name, config, split=table.split, streaming=table.streaming)
    except (
        ConnectionError,
        FileNotFoundError,
        OSError,
        ValueError,
        datasets.exceptions.DatasetNotFoundError,
    ) as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = (
            "HF offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE=1) and the dataset is not in the local "
            "HF cache: run once online to cache it, or give a local path."
            if offline
            else "Check the name, config and split, and your network or HF token."
        )
        raise DataError(
            f"Could not load Hugging Face dataset {name!r} (config {config!r}, split {table.split!r}): "
            f"{err}. {hint}"
        ) from err


def fingerprint(table: TableRef) -> str:
    """`datasets`' own content fingerprint; a streamed dataset has none: its builder's hash, which follows the
    data files."""
    ds = load(table)
    own = getattr(ds, "_fingerprint", None)
    if own is None:
        import datasets

        name, config = parse(table.source)
        builder = datasets.load_dataset_builder(name, config)
        own = blake(
            "streaming", name, str(config), table.split, str(builder.hash), str(builder.config.data_files)
        )
    return own


KIND = SourceKind(
    name="hf",
    priority=10,
    claims=lambda source: source.startswith(PREFIX),
    check=lambda source: None if parse(source) else None,
    load_table=load,
    table_fingerprint=fingerprint,
    named_splits=True,
)
