"""Small packed datasets and models for the engine's tests, built without tokenizing anything.

The blocks go through the data layer's own writer (`tasks.data.packed`) and the models through the
build stage, so the files are exactly what the pipeline makes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from model import LlamaConfig
from tasks.build import build_model
from tasks.data.packed import FORMAT_VERSION, token_dtype, write_meta, write_split
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainSettings


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
    dtype = token_dtype(vocab_size)
    seq_len = train_blocks.shape[1] - 1
    digest = hashlib.sha256()
    counts = {}
    for name, blocks in (("train", train_blocks), ("val", val_blocks)):
        stream = np.ascontiguousarray(blocks, dtype=dtype).reshape(-1)
        write_split(directory / f"{name}.npy", stream, n_blocks=len(blocks), seq_len=seq_len, pad_id=pad_id)
        digest.update(stream.tobytes())
        counts[name] = int((blocks[:, 1:] != pad_id).sum())
    meta = {
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "pad_id": pad_id,
        "dtype": dtype.name,
        "format": FORMAT_VERSION,
        "fingerprint": digest.hexdigest()[:16],
        "train_blocks": len(train_blocks),
        "val_blocks": len(val_blocks),
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "stats": {},
    }
    write_meta(directory, meta)
    return DatasetRef(
        path=str(directory),
        fingerprint=meta["fingerprint"],
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


def model_ref(config: LlamaConfig, seed: int = 0) -> ModelRef:
    """Initial weights of `config` from `seed`, as the build stage writes them."""
    return build_model(config, seed=seed)


def eager_settings(**values: object) -> TrainSettings:
    """Settings of a CPU engine test: eager fp32, 2 x 4 micro-batches, lr 3e-3, unless `values` say otherwise.
    A module binds its own run with `functools.partial(eager_settings, ...)`."""
    base: dict[str, object] = dict(
        micro_batch_size=2, accumulate_steps=4, lr=3e-3, compile=False, dtype="fp32"
    )
    return TrainSettings(**{**base, **values})  # type: ignore[arg-type]
