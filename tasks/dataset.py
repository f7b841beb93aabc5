"""Packed token datasets: corpus + tokenizer → `train.npy` / `val.npy` blocks, cached by fingerprint.

The directory also holds `split_manifest.json` (`tasks.data.split`): each whole-file document's side, which a
run continued from this one's model carries forward (`split_from`).

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
`tokenize_shard_task` runs over the shards `plan_tokenization` returns (on the flow's task runner: threads or
Dask); `build_dataset` alone tokenizes whatever is missing in `num_proc` threads. Hugging Face datasets
(`hf:NAME`) go through `datasets.map` (`tasks.data.hf_tokens`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from model.atomic import atomic_dir
from tasks import home
from tasks.data import packing, token_store
from tasks.data import tokens as token_cache
from tasks.data.cache import build_lock, prefect_cache_key
from tasks.data.corpus import Corpus, DataError, DataSettings, blake, corpus_of_parameters, resolve_corpus
from tasks.data.cpus import usable_cpus
from tasks.data.errors import data_logger
from tasks.data.packed import FORMAT_VERSION, load_dataset_ref, token_dtype, write_meta
from tasks.data.packing import parts_of, too_few_tokens
from tasks.data.slot import is_complete
from tasks.data.split import MANIFEST_NAME
from tasks.data.tokens import TokenShard, plan_shards, tokenize_shard
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


def _early_checks(corpus: Corpus, seq_len: int, add_bos: bool) -> None:
    """Byte-level BPE emits at most one token per byte, so text bytes bound the token count."""
    for split in (*corpus.train.leaves(), *corpus.val.leaves()):
        if split.bytes is None:
            continue
        documents = max(len(split.parts), 1)
        bound = split.bytes + documents * (1 + int(add_bos))
        if split.bytes == 0 or bound < seq_len + 1:
            raise too_few_tokens(split, bound if split.bytes else 0, seq_len, estimated=bool(split.bytes))


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
        return min(2, usable_cpus())
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
            meta = packing.build_into(
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
            meta["stats"]["duplicates_removed"] = corpus.duplicates
            shutil.copyfile(tokenizer.path, staged.path / "tokenizer.json")
            corpus.manifest.write(staged.path / MANIFEST_NAME)  # what a continued run's split carries
            write_meta(staged.path, meta)
    ref = load_dataset_ref(directory)
    data_logger().info(
        f"dataset {fingerprint}: {ref.stats['documents']} documents, {ref.stats['tokens']:,} tokens, "
        f"{ref.train_blocks} train + {ref.val_blocks} val blocks of {seq_len + 1}, {ref.stats['seconds']} s"
        f" ({ref.stats.get('duplicates_removed', 0)} duplicate documents removed)"
    )
    return ref


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
    splits = (*corpus.val.leaves(), *corpus.train.leaves())
    parts = [part for split in splits if split.table is None for part in parts_of(split)]
    dtype = token_dtype(tokenizer.vocab_size).name
    shards = plan_shards(
        parts,
        tokenizer,
        add_bos=add_bos,
        dtype=dtype,
        shard_bytes=shard_bytes or token_cache.SHARD_BYTES,  # read now: a test or benchmark may set it
    )
    data_logger().info(
        f"tokenizing {sum(s.files for s in shards)} of {len(token_cache.file_groups(parts))} files "
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
