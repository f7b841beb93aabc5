"""Tokenizing a table source's split (`hf:NAME`, a saved dataset): `datasets.map(batched=True, num_proc=...)`, each batch
one row of concatenated ids, written straight to a raw stream file and cut into blocks, so neither the
corpus nor its tokens are held in memory (`streaming=True` also avoids the Arrow copy in the datasets cache).
Local files go through the per-file token cache instead (`tasks.data.tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tasks.data.corpus import CorpusSplit
from tasks.data.counts import TokenCounts
from tasks.data.errors import blake
from tasks.data.packed import write_split
from tasks.refs import TokenizerRef

MAP_BATCH_SIZE = 64  # documents per map batch: stdlib files average 16 kB
_TOKENIZERS: dict[str, Any] = {}


def encode_batch(
    batch: dict[str, list[str]], tokenizer_path: str, bos_id: int | None, eos_id: int, dtype: str
) -> dict[str, list[Any]]:
    """One map batch → one row: the batch's documents' ids, each followed by EOS, concatenated."""
    tokenizer = _TOKENIZERS.get(tokenizer_path)
    if tokenizer is None:  # loaded once per worker process
        from tokenizers import Tokenizer

        tokenizer = _TOKENIZERS[tokenizer_path] = Tokenizer.from_file(tokenizer_path)
    texts = [text for text in batch["text"] if text]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False):
        if bos_id is not None:
            ids.append(bos_id)
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return {
        "ids": [np.asarray(ids, dtype=dtype)],
        "documents": [len(texts)],
        "bytes": [sum(len(text.encode("utf-8")) for text in texts)],
    }


def token_chunks(
    split: CorpusSplit,
    tokenizer: TokenizerRef,
    *,
    add_bos: bool,
    dtype: np.dtype,
    num_proc: int,
    streaming: bool,
    counts: TokenCounts,
) -> Iterator[np.ndarray]:
    """Token arrays of a split, in corpus order; fills `counts` with documents and bytes."""
    from datasets import Features, List, Value

    features = Features(
        {"ids": List(Value(dtype.name)), "documents": Value("int64"), "bytes": Value("int64")}
    )
    fn_kwargs = {
        "tokenizer_path": tokenizer.path,
        "bos_id": tokenizer.bos_id if add_bos else None,
        "eos_id": tokenizer.eos_id,
        "dtype": dtype.name,
    }
    docs = split.dataset(streaming=streaming)
    common = {
        "batched": True,
        "batch_size": MAP_BATCH_SIZE,
        "remove_columns": ["text"],
        "features": features,
        "fn_kwargs": fn_kwargs,
    }
    if streaming:
        mapped = docs.map(encode_batch, **common)
    else:
        # More processes than map batches would only add start-up time.
        workers = min(num_proc, -(-len(docs) // MAP_BATCH_SIZE))
        mapped = docs.map(
            encode_batch,
            num_proc=workers if workers > 1 else None,
            desc=f"tokenize {split.name}",
            new_fingerprint=blake(split.fingerprint, tokenizer.fingerprint, str(add_bos), dtype.name),
            **common,
        )
    for table in mapped.with_format("arrow").iter(batch_size=16):
        counts.documents += sum(table.column("documents").to_pylist())
        counts.bytes += sum(table.column("bytes").to_pylist())
        for piece in table.column("ids").chunks:
            flat = piece.flatten().to_numpy(zero_copy_only=False)
            if flat.size:
                yield flat


def write_tokens(chunks: Iterator[np.ndarray], path: Path) -> int:
    """Append the token stream to a raw file; returns its length in tokens."""
    total = 0
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk.tobytes())
            total += chunk.size
    return total


def pack_stream(
    raw_path: Path,
    npy_path: Path,
    n_tokens: int,
    *,
    seq_len: int,
    keep_remainder: bool,
    pad_id: int,
    dtype: np.dtype,
) -> tuple[int, int]:
    """Cut the raw stream into (n_blocks, seq_len + 1) rows of an .npy; returns (blocks, stream tokens kept)."""
    width = seq_len + 1
    full, remainder = divmod(n_tokens, width)
    keep_tail = keep_remainder and remainder >= 2
    blocks = full + int(keep_tail)
    kept = full * width + (remainder if keep_tail else 0)
    stream = np.memmap(raw_path, dtype=dtype, mode="r", shape=(n_tokens,)) if n_tokens else np.zeros(0, dtype)
    write_split(npy_path, stream[:kept], n_blocks=blocks, seq_len=seq_len, pad_id=pad_id)
    del stream
    return blocks, kept
