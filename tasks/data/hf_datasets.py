"""Hugging Face datasets as corpus sources: `hf:NAME[:CONFIG]`, from the hub, the HF cache or a local folder."""

from __future__ import annotations

import os
from typing import Any

from tasks.data.errors import DataError, blake, unit_hash


def parse_hf(source: str) -> tuple[str, str | None]:
    name, _, config = source[len("hf:") :].partition(":")
    if not name:
        raise DataError(f"{source!r} names no dataset; write 'hf:NAME' or 'hf:NAME:CONFIG'.")
    return name, config or None


def load_hf(name: str, config: str | None, split: str, *, streaming: bool):
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split, streaming=streaming)
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
            f"Could not load Hugging Face dataset {name!r} (config {config!r}, split {split!r}): "
            f"{err}. {hint}"
        ) from err


def hf_split_dataset(hf: dict[str, Any], *, streaming: bool):
    ds = load_hf(hf["name"], hf["config"], hf["split"], streaming=streaming)
    ds = ds.select_columns([hf["text_field"]])
    if hf["text_field"] != "text":
        ds = ds.rename_column(hf["text_field"], "text")
    fraction, keep_val = hf.get("val_fraction"), hf.get("keep_val")
    if fraction is None:
        return ds
    return ds.filter(
        _hf_row_selected, with_indices=True, fn_kwargs={"fraction": fraction, "keep_val": keep_val}
    )


def _hf_row_selected(_row: dict[str, Any], index: int, fraction: float, keep_val: bool) -> bool:
    return (unit_hash(f"row#{index}") < fraction) == keep_val


def hf_fingerprint(name: str, config: str | None, split: str, text_field: str, streaming: bool) -> str:
    ds = load_hf(name, config, split, streaming=streaming)
    if ds.column_names is not None and text_field not in ds.column_names:  # None: streamed, features unknown
        raise DataError(
            f"Hugging Face dataset {name!r} split {split!r} has no column {text_field!r}; "
            f"its columns are {ds.column_names}. Pass text_field= one of those."
        )
    own = getattr(ds, "_fingerprint", None)
    if (
        own is None
    ):  # a streaming dataset has no content fingerprint; its builder's hash follows the data files
        import datasets

        builder = datasets.load_dataset_builder(name, config)
        own = blake("streaming", name, str(config), split, str(builder.hash), str(builder.config.data_files))
    return own
