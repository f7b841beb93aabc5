"""Packed token datasets: corpus + tokenizer → `train.npy` / `val.npy` blocks, cached by fingerprint.

Layout (the contract with the trainer, `tasks/data/packed.py`): each split is a 2-D array `(n_blocks, seq_len + 1)` of the
smallest unsigned dtype that holds the vocabulary; a row's inputs are `row[:-1]`, its targets
`row[1:]`. Rows do not overlap, so the rows of a split concatenate back to its token stream. The
stream is every document's tokens followed by EOS (`add_bos=True` also puts BOS before each
document). Blocks span documents but never mix train and validation. The tail shorter than a block
is dropped, or with `keep_remainder=True` right-padded with PAD into a last block (when it holds at
least 2 tokens, i.e. one target). `train_tokens` / `val_tokens` count the targets the loss sees:
non-PAD tokens in `row[1:]`, i.e. `seq_len` per full block (the stats also hold the stream lengths).

Tokenization runs through `datasets.map(batched=True, num_proc=...)`; each batch becomes one row of
concatenated ids, written straight to disk, so neither the corpus nor its tokens are held in memory
(`streaming=True` also avoids the Arrow copy of the corpus in the datasets cache).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.context import TaskRunContext

from model.atomic import atomic_dir
from tasks import home
from tasks.data.cache import build_lock, is_complete, prefect_cache_key
from tasks.data.common import data_logger
from tasks.data.corpus import Corpus, CorpusSplit, DataError, DataSpec, blake, resolve_corpus
from tasks.data.packed import FORMAT_VERSION, load_dataset_ref, token_dtype, write_meta, write_split
from tasks.refs import DatasetRef, TokenizerRef

MAP_BATCH_SIZE = 64  # documents per map batch: stdlib files average 16 kB
_TOKENIZERS: dict[str, Any] = {}


def datasets_dir() -> Path:
    return home.cache_dir() / "datasets"


def dataset_fingerprint(
    corpus: Corpus, tokenizer: TokenizerRef, seq_len: int, keep_remainder: bool, add_bos: bool
) -> str:
    return blake(
        FORMAT_VERSION,
        corpus.fingerprint,
        tokenizer.fingerprint,
        str(seq_len),
        f"keep_remainder={keep_remainder}",
        f"add_bos={add_bos}",
    )


# ---------------------------------------------------------------------------------------- tokenizing


def _encode_batch(
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


def _token_chunks(
    split: CorpusSplit,
    tokenizer: TokenizerRef,
    *,
    add_bos: bool,
    dtype: np.dtype,
    num_proc: int,
    streaming: bool,
    counts: dict[str, int],
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
        mapped = docs.map(_encode_batch, **common)
    else:
        # More processes than map batches would only add start-up time.
        workers = min(num_proc, -(-len(docs) // MAP_BATCH_SIZE))
        mapped = docs.map(
            _encode_batch,
            num_proc=workers if workers > 1 else None,
            desc=f"tokenize {split.name}",
            new_fingerprint=blake(split.fingerprint, tokenizer.fingerprint, str(add_bos), dtype.name),
            **common,
        )
    for table in mapped.with_format("arrow").iter(batch_size=16):
        counts["documents"] += sum(table.column("documents").to_pylist())
        counts["bytes"] += sum(table.column("bytes").to_pylist())
        for piece in table.column("ids").chunks:
            flat = piece.flatten().to_numpy(zero_copy_only=False)
            if flat.size:
                yield flat


def _write_tokens(chunks: Iterator[np.ndarray], path: Path) -> int:
    """Append the token stream to a raw file; returns its length in tokens."""
    total = 0
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk.tobytes())
            total += chunk.size
    return total


def _pack(
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


def _too_few_tokens(split: str, tokens: int, seq_len: int, *, estimated: bool) -> DataError:
    amount = f"at most {tokens}" if estimated else f"{tokens}"
    return DataError(
        f"The {split} split has {amount} tokens, fewer than one block of seq_len + 1 = {seq_len + 1}. "
        f"Use a smaller seq_len (at most {max(tokens - 1, 1)}), more data, or a larger val_fraction / val_data "
        "for the validation split."
    )


def _early_checks(corpus: Corpus, seq_len: int, add_bos: bool) -> None:
    """Byte-level BPE emits at most one token per byte, so text bytes bound the token count."""
    for split in (corpus.train, corpus.val):
        if split.bytes is None:
            continue
        documents = max(len(split.parts), 1)
        bound = split.bytes + documents * (1 + int(add_bos))
        if split.bytes == 0 or bound < seq_len + 1:
            raise _too_few_tokens(
                split.name, bound if split.bytes else 0, seq_len, estimated=bool(split.bytes)
            )


# ------------------------------------------------------------------------------------------ building


def _validate_inputs(tokenizer: TokenizerRef, seq_len: int, num_proc: int | None) -> int:
    if seq_len < 2:
        raise DataError(
            f"seq_len={seq_len} is too small: a block needs at least 2 tokens to predict one; try 256."
        )
    if not Path(tokenizer.path).is_file():
        raise DataError(
            f"Tokenizer file {tokenizer.path} is missing (cache cleared?); run train_tokenizer again."
        )
    if num_proc is None:
        return max(1, min(2, os.cpu_count() or 1))
    if num_proc < 1:
        raise DataError(f"num_proc={num_proc} must be at least 1 (or None for min(2, CPU count)).")
    return num_proc


def build_dataset(
    data: str | DataSpec | None,
    tokenizer: TokenizerRef,
    seq_len: int,
    *,
    val_fraction: float | None = None,
    val_data: str | None = None,
    text_field: str | None = None,
    hf_split: str | None = None,
    hf_val_split: str | None = None,
    streaming: bool | None = None,
    keep_remainder: bool = False,
    add_bos: bool = False,
    num_proc: int | None = None,
    seed: int | None = None,
) -> DatasetRef:
    """Tokenize and pack `data` into train/val blocks of `seq_len + 1` tokens; cached by content.

    `seed` is accepted for a uniform stage interface and unused: split and packing are deterministic
    functions of the content (order is the trainer's business).
    """
    del seed
    workers = _validate_inputs(tokenizer, seq_len, num_proc)
    corpus = resolve_corpus(
        data,
        val_fraction=val_fraction,
        val_data=val_data,
        text_field=text_field,
        hf_split=hf_split,
        hf_val_split=hf_val_split,
        streaming=streaming,
    )
    fingerprint = dataset_fingerprint(corpus, tokenizer, seq_len, keep_remainder, add_bos)
    directory = datasets_dir() / fingerprint
    if is_complete(directory):
        data_logger().info(f"dataset {fingerprint}: cached at {directory}")
        return load_dataset_ref(directory)
    _early_checks(corpus, seq_len, add_bos)

    with build_lock(directory):
        if is_complete(directory):
            data_logger().info(f"dataset {fingerprint}: built by another run while this one waited")
            return load_dataset_ref(directory)
        started = time.perf_counter()
        dtype = token_dtype(tokenizer.vocab_size)
        with atomic_dir(directory) as staged:
            meta = _build_into(
                staged.path,
                corpus,
                tokenizer,
                seq_len,
                keep_remainder=keep_remainder,
                add_bos=add_bos,
                dtype=dtype,
                num_proc=workers,
            )
            meta["fingerprint"] = fingerprint
            meta["stats"]["seconds"] = round(time.perf_counter() - started, 3)
            shutil.copyfile(tokenizer.path, staged.path / "tokenizer.json")
            write_meta(staged.path, meta)
    ref = load_dataset_ref(directory)
    data_logger().info(
        f"dataset {fingerprint}: {ref.stats['documents']} documents, {ref.stats['tokens']:,} tokens, "
        f"{ref.train_blocks} train + {ref.val_blocks} val blocks of {seq_len + 1}, {ref.stats['seconds']} s"
    )
    return ref


def _build_into(
    staging: Path,
    corpus: Corpus,
    tokenizer: TokenizerRef,
    seq_len: int,
    *,
    keep_remainder: bool,
    add_bos: bool,
    dtype: np.dtype,
    num_proc: int,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "seq_len": seq_len,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "dtype": dtype.name,
        "keep_remainder": keep_remainder,
        "add_bos": add_bos,
        "format": FORMAT_VERSION,
    }
    stats: dict[str, Any] = {
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "corpus": corpus.train.description,
    }
    # Validation first: it is small, and a too-small val split should fail before the long train pass.
    for split, short in ((corpus.val, "val"), (corpus.train, "train")):
        counts = {"documents": 0, "bytes": 0}
        raw = staging / f"{short}.tokens.bin"
        chunks = _token_chunks(
            split,
            tokenizer,
            add_bos=add_bos,
            dtype=dtype,
            num_proc=num_proc,
            streaming=corpus.spec.streaming,
            counts=counts,
        )
        n_tokens = _write_tokens(chunks, raw)
        if n_tokens < seq_len + 1:
            raise _too_few_tokens(split.name, n_tokens, seq_len, estimated=False)
        blocks, kept = _pack(
            raw,
            staging / f"{short}.npy",
            n_tokens,
            seq_len=seq_len,
            keep_remainder=keep_remainder,
            pad_id=tokenizer.pad_id,
            dtype=dtype,
        )
        raw.unlink()
        meta[f"{short}_blocks"], meta[f"{short}_tokens"] = blocks, kept - blocks  # row[0] is never a target
        stats.update(
            {
                f"{short}_documents": counts["documents"],
                f"{short}_stream_tokens": n_tokens,
                f"{short}_bytes": counts["bytes"],
                f"{short}_dropped_tokens": n_tokens - kept,
            }
        )
    stream = stats["train_stream_tokens"] + stats["val_stream_tokens"]
    stats["documents"] = stats["train_documents"] + stats["val_documents"]
    stats["tokens"] = stream
    stats["blocks"] = meta["train_blocks"] + meta["val_blocks"]
    stats["bytes_per_token"] = round((stats["train_bytes"] + stats["val_bytes"]) / stream, 4)
    meta["stats"] = stats
    return meta


def _dataset_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    args = dict(parameters)
    tokenizer = args["tokenizer"]
    if isinstance(tokenizer, dict):
        tokenizer = TokenizerRef(**tokenizer)
    corpus = resolve_corpus(
        args.get("data"),
        val_fraction=args.get("val_fraction"),
        val_data=args.get("val_data"),
        text_field=args.get("text_field"),
        hf_split=args.get("hf_split"),
        hf_val_split=args.get("hf_val_split"),
        streaming=args.get("streaming"),
    )
    fingerprint = dataset_fingerprint(
        corpus, tokenizer, args["seq_len"], bool(args.get("keep_remainder")), bool(args.get("add_bos"))
    )
    return prefect_cache_key("build_dataset", fingerprint, datasets_dir() / fingerprint)


build_dataset_task = task(
    build_dataset,
    name="build_dataset",
    cache_key_fn=_dataset_cache_key,
    persist_result=True,
    result_serializer="json",
)
