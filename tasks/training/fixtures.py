"""Small packed datasets and ModelRefs built directly on disk, for tests and benchmarks of the engine.

They follow the packed-dataset contract (train.npy/val.npy + meta.json), without tokenizing anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from numpy.lib.format import open_memmap

from model import LlamaConfig, LlamaForPretraining, count_params, save_weights
from tasks.refs import DatasetRef, ModelRef


def write_packed_dataset(
    directory: str | Path,
    train_blocks: np.ndarray,
    val_blocks: np.ndarray,
    *,
    vocab_size: int,
    bos_id: int = 1,
    eos_id: int = 2,
    pad_id: int = 0,
) -> DatasetRef:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    seq_len = train_blocks.shape[1] - 1
    for name, blocks in (("train", train_blocks), ("val", val_blocks)):
        out = open_memmap(directory / f"{name}.npy", mode="w+", dtype=dtype, shape=blocks.shape)
        out[:] = blocks
        out.flush()
        del out
    counts = {n: int((b[:, 1:] != pad_id).sum()) for n, b in (("train", train_blocks), ("val", val_blocks))}
    meta = {
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "pad_id": pad_id,
        "dtype": np.dtype(dtype).name,
        "train_blocks": len(train_blocks),
        "val_blocks": len(val_blocks),
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "stats": {},
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=2))
    digest = hashlib.sha256(
        np.ascontiguousarray(train_blocks).tobytes() + np.ascontiguousarray(val_blocks).tobytes()
    )
    return DatasetRef(
        path=str(directory),
        fingerprint=digest.hexdigest()[:16],
        seq_len=seq_len,
        vocab_size=vocab_size,
        train_blocks=len(train_blocks),
        val_blocks=len(val_blocks),
        train_tokens=counts["train"],
        val_tokens=counts["val"],
    )


def pattern_blocks(n_blocks: int, seq_len: int, vocab_size: int, seed: int, pad_id: int = 0) -> np.ndarray:
    """Learnable synthetic text: each block counts upward from a random start with a random stride."""
    rng = np.random.default_rng(seed)
    start = rng.integers(3, vocab_size, size=(n_blocks, 1))
    stride = rng.integers(1, 4, size=(n_blocks, 1))
    span = vocab_size - 3
    blocks = 3 + (start - 3 + stride * np.arange(seq_len + 1)[None, :]) % span
    assert (blocks != pad_id).all()
    return blocks.astype(np.int64)


def write_model_ref(directory: str | Path, config: LlamaConfig, seed: int = 0) -> ModelRef:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForPretraining(config)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    save_weights(model, directory / "model.safetensors")
    digest = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()[:16]
    return ModelRef(path=str(directory), fingerprint=digest, n_params=count_params(model))
