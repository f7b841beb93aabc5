"""The packed-dataset layout: the contract between the data stages (which write it) and the trainer and
evaluation (which read it).

A dataset directory holds `train.npy` and `val.npy`, each a 2-D array `(n_blocks, seq_len + 1)` of the
smallest unsigned dtype that holds the vocabulary (a row's inputs are `row[:-1]`, its targets `row[1:]`;
rows do not overlap), `meta.json` (sizes, special token ids, counts, fingerprint, stats) and the
`tokenizer.json` that made it. Arrays are memory-mapped when read: no copy, no pickle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tasks.data.slot import touch
from tasks.refs import DatasetRef

FORMAT_VERSION = "packed-v2"  # v2: train_tokens counts targets
META_FILE = "meta.json"
_COPY_CHUNK = 1 << 22  # tokens per copy from a stream into a split


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_split(path: Path, stream: np.ndarray, *, n_blocks: int, seq_len: int, pad_id: int) -> None:
    """Write the first `n_blocks * (seq_len + 1)` tokens of the 1-D `stream` (a memmap is fine) as the
    rows of `path`; a stream shorter than that is right-padded with `pad_id`."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=stream.dtype, shape=(n_blocks, seq_len + 1))
    flat = out.reshape(-1)
    kept = min(len(stream), flat.size)
    copy_chunked(flat[:kept], stream[:kept])
    flat[kept:] = pad_id
    out.flush()


def copy_chunked(
    target: np.ndarray, source: np.ndarray, on_chunk: Callable[[int], object] | None = None
) -> None:
    """Copy the 1-D `source` (a memmap) into `target` of its length `_COPY_CHUNK` tokens at a time, so memory
    holds one chunk whatever the size; `on_chunk(tokens)` after each (progress)."""
    for start in range(0, len(source), _COPY_CHUNK):
        stop = min(start + _COPY_CHUNK, len(source))
        target[start:stop] = source[start:stop]
        if on_chunk is not None:
            on_chunk(stop - start)


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    (directory / META_FILE).write_text(json.dumps(meta, indent=2))


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: point the DatasetRef at a directory built by build_dataset"
        )
    return json.loads(path.read_text())


def load_dataset_ref(directory: Path) -> DatasetRef:
    meta = read_meta(directory)
    touch(directory)  # taken by a run: its last use
    fields = ("seq_len", "vocab_size", "train_blocks", "val_blocks", "train_tokens", "val_tokens")
    return DatasetRef(
        path=str(directory),
        fingerprint=meta["fingerprint"],
        stats=meta["stats"],
        **{name: meta[name] for name in fields},
    )


def open_blocks(directory: str | Path, split: str = "train") -> np.ndarray:
    """Memory-map `<split>.npy` (no copy, no pickle) and check it against `meta.json`."""
    meta = read_meta(directory)
    path = Path(directory) / f"{split}.npy"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: rebuild the dataset")
    blocks = np.load(path, mmap_mode="r", allow_pickle=False)
    if blocks.ndim != 2 or blocks.shape[1] != meta["seq_len"] + 1:
        raise ValueError(
            f"{path} has shape {blocks.shape}, expected (n_blocks, seq_len + 1 = {meta['seq_len'] + 1}); "
            "the file and meta.json disagree, rebuild the dataset"
        )
    if blocks.dtype not in (np.uint16, np.uint32):
        raise ValueError(f"{path} has dtype {blocks.dtype}, expected uint16 or uint32")
    return blocks
