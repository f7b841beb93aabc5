"""Packed token datasets: corpus + tokenizer → `train.npy` / `val.npy` blocks, cached by fingerprint.

Layout (the contract with the trainer, `tasks/data/packed.py`): each split is a 2-D array `(n_blocks, seq_len + 1)` of the
smallest unsigned dtype that holds the vocabulary; a row's inputs are `row[:-1]`, its targets
`row[1:]`. Rows do not overlap, so the rows of a split concatenate back to its token stream. The
stream is every document's tokens followed by EOS (`add_bos=True` also puts BOS before each
document). Blocks span documents but never mix train and validation. The tail shorter than a block
is dropped, or with `keep_remainder=True` right-padded with PAD into a last block (when it holds at
least 2 tokens, i.e. one target). `train_tokens` / `val_tokens` count the targets the loss sees:
non-PAD tokens in `row[1:]`, i.e. `seq_len` per full block (the stats also hold the stream lengths).

Local files are tokenized once per file content (`tasks.data.tokens`: a corpus that grew re-tokenizes only
its new files) and packing concatenates the cached streams in corpus order; the dataset's fingerprint is
still its content's (corpus, tokenizer, layout). In a flow, the files still to tokenize are mapped as
`tokenize_shard_task` runs over the shards `plan_tokenization` returns (on the flow's task runner: threads,
Dask, Ray); `build_dataset` alone tokenizes whatever is missing in `num_proc` threads. Hugging Face datasets
(`hf:NAME`) go through `datasets.map` (`tasks.data.hf_tokens`).
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.context import TaskRunContext

from model.atomic import atomic_dir
from tasks import home
from tasks.data import token_store
from tasks.data import tokens as token_cache
from tasks.data.cache import build_lock, is_complete, prefect_cache_key
from tasks.data.corpus import (
    Corpus,
    CorpusSplit,
    DataError,
    DataSettings,
    blake,
    corpus_of_parameters,
    resolve_corpus,
)
from tasks.data.errors import data_logger
from tasks.data.hf_tokens import pack_stream, token_chunks, write_tokens
from tasks.data.packed import FORMAT_VERSION, load_dataset_ref, token_dtype, write_meta
from tasks.data.tokens import (
    PartSpec,
    TokenShard,
    pack_parts,
    part_key,
    plan_shards,
    tokenize_part,
    tokenize_shard,
)
from tasks.refs import DatasetRef, TokenizerRef


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
    data: str | DataSettings | None,
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
        # Held shared: no prune of the token cache between looking the parts up and packing them.
        with token_store.in_use(), atomic_dir(directory) as staged:
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


def _parts(split: CorpusSplit) -> list[PartSpec]:
    return [PartSpec.of(part, split.text_field) for part in split.parts]


def _tokenize_split(
    staging: Path,
    split: CorpusSplit,
    short: str,
    corpus: Corpus,
    tokenizer: TokenizerRef,
    seq_len: int,
    *,
    keep_remainder: bool,
    add_bos: bool,
    dtype: np.dtype,
    num_proc: int,
) -> tuple[int, int, int, dict[str, int]]:
    """Write `<short>.npy`; returns (blocks, stream tokens, kept tokens, {"documents", "bytes"})."""
    if split.table is not None:
        counts = {"documents": 0, "bytes": 0}
        raw = staging / f"{short}.tokens.bin"
        chunks = token_chunks(
            split,
            tokenizer,
            add_bos=add_bos,
            dtype=dtype,
            num_proc=num_proc,
            streaming=corpus.settings.streaming,
            counts=counts,
        )
        n_tokens = write_tokens(chunks, raw)
        if n_tokens < seq_len + 1:
            raise _too_few_tokens(split.name, n_tokens, seq_len, estimated=False)
        blocks, kept = pack_stream(
            raw,
            staging / f"{short}.npy",
            n_tokens,
            seq_len=seq_len,
            keep_remainder=keep_remainder,
            pad_id=tokenizer.pad_id,
            dtype=dtype,
        )
        raw.unlink()
        return blocks, n_tokens, kept, counts
    return _pack_files(
        staging / f"{short}.npy", split, tokenizer, seq_len, keep_remainder, add_bos, dtype, num_proc
    )


def _pack_files(
    npy: Path,
    split: CorpusSplit,
    tokenizer: TokenizerRef,
    seq_len: int,
    keep_remainder: bool,
    add_bos: bool,
    dtype: np.dtype,
    num_proc: int,
) -> tuple[int, int, int, dict[str, int]]:
    """A local files' split from the token cache (tokenizing the parts it lacks in `num_proc` threads)."""
    parts = _parts(split)
    keys = [part_key(part, tokenizer, add_bos, dtype.name) for part in parts]
    root = token_store.tokens_dir()
    done = [token_cache.cached_counts(key, root) for key in keys]
    missing = [i for i, counts in enumerate(done) if counts is None]
    if missing:  # what a mapped run left untokenized (or all of it, outside a flow), in `num_proc` threads
        with ThreadPoolExecutor(max_workers=num_proc) as pool:
            fresh = pool.map(lambda i: tokenize_part(parts[i], tokenizer, add_bos, dtype.name), missing)
            for i, counts in zip(missing, fresh, strict=True):
                done[i] = counts
    n_tokens = sum(c["tokens"] for c in done)  # type: ignore[index]
    if n_tokens < seq_len + 1:
        raise _too_few_tokens(split.name, n_tokens, seq_len, estimated=False)
    blocks, n_tokens, kept = pack_parts(
        keys,
        [c["tokens"] for c in done],  # type: ignore[index]
        npy,
        seq_len=seq_len,
        keep_remainder=keep_remainder,
        pad_id=tokenizer.pad_id,
        dtype=dtype,
    )
    counts = {
        "documents": sum(c["documents"] for c in done),  # type: ignore[index]
        "bytes": sum(c["bytes"] for c in done),  # type: ignore[index]
    }
    return blocks, n_tokens, kept, counts


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
        blocks, n_tokens, kept, counts = _tokenize_split(
            staging,
            split,
            short,
            corpus,
            tokenizer,
            seq_len,
            keep_remainder=keep_remainder,
            add_bos=add_bos,
            dtype=dtype,
            num_proc=num_proc,
        )
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


def plan_tokenization(
    data: str | DataSettings | None,
    tokenizer: TokenizerRef,
    seq_len: int,
    *,
    val_fraction: float | None = None,
    val_data: str | None = None,
    text_field: str | None = None,
    keep_remainder: bool = False,
    add_bos: bool = False,
    shard_bytes: int | None = None,
) -> list[TokenShard]:
    """The shards of files whose tokens are not cached yet (none when the packed dataset exists, or for a
    Hugging Face dataset, which `build_dataset` tokenizes itself): map `tokenize_shard_task` over them."""
    corpus = resolve_corpus(data, val_fraction=val_fraction, val_data=val_data, text_field=text_field)
    fingerprint = dataset_fingerprint(corpus, tokenizer, seq_len, keep_remainder, add_bos)
    if is_complete(datasets_dir() / fingerprint):
        return []
    parts = [part for split in (corpus.val, corpus.train) if split.table is None for part in _parts(split)]
    dtype = token_dtype(tokenizer.vocab_size).name
    shards = plan_shards(
        parts,
        tokenizer,
        add_bos=add_bos,
        dtype=dtype,
        shard_bytes=shard_bytes or token_cache.SHARD_BYTES,  # read now: a test or benchmark may set it
    )
    data_logger().info(
        f"tokenizing {sum(len(s.parts) for s in shards)} of {len(parts)} files "
        f"({sum(s.bytes for s in shards):,} bytes) in {len(shards)} shards; the rest are cached"
    )
    return shards


def _dataset_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    args = dict(parameters)
    tokenizer = args["tokenizer"]
    if isinstance(tokenizer, dict):
        tokenizer = TokenizerRef(**tokenizer)
    corpus = corpus_of_parameters(args)
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
plan_tokenization_task = task(plan_tokenization, name="plan_tokenization")
tokenize_shard_task = task(tokenize_shard, name="tokenize_shard")
