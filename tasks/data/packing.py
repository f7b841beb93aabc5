"""Writing a packed dataset's splits into its staging directory: each split's token stream (the per-file
token cache for local files, `datasets.map` for table sources) cut into blocks, a mixture's sources packed
one by one and mixed by weight (`tasks.data.mixture`). `tasks.dataset` decides when to build and caches it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tasks.data.corpus import Corpus, CorpusSplit, DataError
from tasks.data.counts import TokenCounts
from tasks.data.errors import DataWarning, data_logger
from tasks.data.hf_tokens import pack_stream, token_chunks, write_tokens
from tasks.data.mixture import REPEAT_WARNING, concat_blocks, mix_blocks, mixture_seed
from tasks.data.packed import FORMAT_VERSION
from tasks.data.tokens import PartSpec, pack_parts, part_key, tokenize_missing
from tasks.refs import TokenizerRef


def too_few_tokens(split: CorpusSplit, tokens: int, seq_len: int, *, estimated: bool) -> DataError:
    amount = f"at most {tokens}" if estimated else f"{tokens}"
    source = split.extra.get("mixture_source")
    which = f"{split.name} split" + (f" of the mixture's source {source!r}" if source else "")
    return DataError(
        f"The {which} has {amount} tokens, fewer than one block of seq_len + 1 = {seq_len + 1}. "
        f"Use a smaller seq_len (at most {max(tokens - 1, 1)}), more data, or a larger val_fraction / val_data "
        "for the validation split."
    )


def parts_of(split: CorpusSplit) -> list[PartSpec]:
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
    cached: dict[str, TokenCounts],
) -> tuple[int, int, TokenCounts]:
    """Write `<short>.npy`; returns (blocks, stream tokens kept, what the stream holds). `cached`: the token
    cache's counts of every file part, by part key (`build_into` tokenized what was missing)."""
    if split.table is not None:
        counts = TokenCounts()
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
        counts.tokens = write_tokens(chunks, raw)
        if counts.tokens < seq_len + 1:
            raise too_few_tokens(split, counts.tokens, seq_len, estimated=False)
        blocks, kept = pack_stream(
            raw,
            staging / f"{short}.npy",
            counts.tokens,
            seq_len=seq_len,
            keep_remainder=keep_remainder,
            pad_id=tokenizer.pad_id,
            dtype=dtype,
        )
        raw.unlink()
        return blocks, kept, counts
    return _pack_files(
        staging / f"{short}.npy", split, tokenizer, seq_len, keep_remainder, add_bos, dtype, cached
    )


def _pack_files(
    npy: Path,
    split: CorpusSplit,
    tokenizer: TokenizerRef,
    seq_len: int,
    keep_remainder: bool,
    add_bos: bool,
    dtype: np.dtype,
    cached: dict[str, TokenCounts],
) -> tuple[int, int, TokenCounts]:
    """A local files' split from the token cache (every part of it tokenized already)."""
    keys = [part_key(part, tokenizer, add_bos, dtype.name) for part in parts_of(split)]
    done = [cached[key] for key in keys]
    total = sum(done, TokenCounts())
    if total.tokens < seq_len + 1:
        raise too_few_tokens(split, total.tokens, seq_len, estimated=False)
    blocks, _, kept = pack_parts(
        keys,
        [c.tokens for c in done],
        npy,
        seq_len=seq_len,
        keep_remainder=keep_remainder,
        pad_id=tokenizer.pad_id,
        dtype=dtype,
    )
    return blocks, kept, total


@dataclass
class _Packed:
    """One split as written: blocks, targets the loss sees, stream tokens, and what it was made of."""

    blocks: int
    targets: int
    stream_tokens: int
    dropped_tokens: int
    documents: int
    bytes: int
    sources: list[dict[str, Any]] = field(default_factory=list)


def _pack_leaf(staging: Path, split: CorpusSplit, short: str, corpus: Corpus, **kwargs: Any) -> _Packed:
    blocks, kept, counts = _tokenize_split(staging, split, short, corpus, **kwargs)
    # row[0] of a block is never a target
    return _Packed(blocks, kept - blocks, counts.tokens, counts.tokens - kept, counts.documents, counts.bytes)


def _count_targets(blocks: np.ndarray, pad_id: int) -> int:
    return sum(int((blocks[i : i + 4096, 1:] != pad_id).sum()) for i in range(0, len(blocks), 4096))


def _pack_mixture(staging: Path, split: CorpusSplit, short: str, corpus: Corpus, **kwargs: Any) -> _Packed:
    """Each source's split packed alone, then mixed by weight (training) or concatenated (validation)."""
    leaves = [
        _pack_leaf(staging, leaf, f"{short}.{i}", corpus, **kwargs) for i, leaf in enumerate(split.leaves())
    ]
    paths = [staging / f"{short}.{i}.npy" for i in range(len(leaves))]
    arrays = [np.load(path, mmap_mode="r", allow_pickle=False) for path in paths]
    out = staging / f"{short}.npy"
    if short == "train":
        taken = mix_blocks(arrays, [w for _, w, _ in split.components], out, mixture_seed(split.fingerprint))
    else:
        taken = [len(a) for a in arrays]
        concat_blocks(arrays, out)
    del arrays
    for path in paths:
        path.unlink()
    mixed = np.load(out, mmap_mode="r", allow_pickle=False)
    packed = _Packed(
        len(mixed),
        _count_targets(mixed, kwargs["tokenizer"].pad_id),
        *(sum(getattr(leaf, name) for leaf in leaves) for name in ("stream_tokens", "dropped_tokens")),
        *(sum(getattr(leaf, name) for leaf in leaves) for name in ("documents", "bytes")),
    )
    for (source, weight, part), leaf, blocks in zip(split.components, leaves, taken, strict=True):
        epochs = round(
            blocks / leaf.blocks, 3
        )  # how often the source's own blocks are seen per mixture epoch
        if short == "train" and epochs > REPEAT_WARNING:
            message = (
                f"the mixture's source {source!r} is repeated {epochs:.1f} times per epoch (weight {weight:.3g}, "
                f"{leaf.blocks} blocks of its own): it may be memorized; give it more text or a smaller weight"
            )
            data_logger().warning(message)
            warnings.warn(message, DataWarning, stacklevel=2)
        packed.sources.append(
            {
                "source": source,
                "weight": weight,
                "fingerprint": part.fingerprint,
                "stream_tokens": leaf.stream_tokens,
                "blocks": blocks,
                "epochs": epochs,
            }
        )
    return packed


def build_into(
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
    options = {
        "tokenizer": tokenizer,
        "seq_len": seq_len,
        "keep_remainder": keep_remainder,
        "add_bos": add_bos,
        "dtype": dtype,
        "num_proc": num_proc,
    }
    leaves = [leaf for split in (corpus.val, corpus.train) for leaf in split.leaves() if leaf.table is None]
    files = [part for leaf in leaves for part in parts_of(leaf)]
    # Both sides of a file in one read: what a mapped run left untokenized (or all of it, outside a flow).
    options["cached"] = tokenize_missing(
        files, tokenizer, add_bos=add_bos, dtype=dtype.name, num_proc=num_proc
    )
    mixture: dict[str, list[dict[str, Any]]] = {}
    # Validation first: it is small, and a too-small val split fails before the long train packing (its
    # tokens stay cached: a rerun with a smaller seq_len tokenizes nothing).
    for split, short in ((corpus.val, "val"), (corpus.train, "train")):
        pack = _pack_mixture if split.components else _pack_leaf
        packed = pack(staging, split, short, corpus, **options)
        meta[f"{short}_blocks"], meta[f"{short}_tokens"] = packed.blocks, packed.targets
        stats.update(
            {
                f"{short}_documents": packed.documents,
                f"{short}_stream_tokens": packed.stream_tokens,
                f"{short}_bytes": packed.bytes,
                f"{short}_dropped_tokens": packed.dropped_tokens,
            }
        )
        if packed.sources:
            mixture[short] = packed.sources
    stream = stats["train_stream_tokens"] + stats["val_stream_tokens"]
    stats["documents"] = stats["train_documents"] + stats["val_documents"]
    stats["tokens"] = stream
    stats["blocks"] = meta["train_blocks"] + meta["val_blocks"]
    stats["bytes_per_token"] = round((stats["train_bytes"] + stats["val_bytes"]) / stream, 4)
    meta["stats"] = stats
    if mixture:
        meta["mixture"] = [
            {**train, "val_stream_tokens": val["stream_tokens"], "val_blocks": val["blocks"]}
            for train, val in zip(mixture["train"], mixture["val"], strict=True)
        ]
    return meta
