"""Token arrays cached per corpus file, by content: a corpus that grew by a few files tokenizes only those.

Each part of a split (a whole file, or the documents of a file that fall on one side) is tokenized once per
(file content, selection, text field, tokenizer file, special ids, BOS choice, dtype)
into `<home>/cache/tokens/<key[:2]>/<key>.bin` (the raw token stream: each document's ids followed by EOS,
optionally preceded by BOS) with `<key>.json` beside it (counts; written last, so it marks a complete
entry). The content is the digest of the bytes actually read: a file that changed after the corpus was
listed fails its read (`tasks.data.documents`) before its entry is published. An entry's `.json`
modification time is its last use (`tasks.data.token_store` shows and prunes by it). Packing a dataset concatenates the entries of its parts in corpus order: the same stream as
tokenizing the whole split at once, so the dataset's content and fingerprint do not depend on what was
cached.

Parts still to tokenize are grouped into shards of about `SHARD_BYTES` (`plan_shards`); the pipeline maps
a Prefect task over them (`tasks.dataset.tokenize_shard_task`), so they run on whatever task runner the flow
has: threads here, a Dask or Ray cluster with prefect-dask / prefect-ray (the workers must see the corpus
files and LLAMAFLOW_HOME at the same paths: a shared file system).
"""

from __future__ import annotations

import array
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from model.atomic import atomic_file, write_text_atomic
from tasks.data.documents import part_texts
from tasks.data.errors import blake
from tasks.data.files import FilePart, SourceFile
from tasks.data.formats import RECORD_SUFFIXES, split_suffix
from tasks.data.progress import Progress
from tasks.data.token_store import entry_paths, tokens_dir
from tasks.refs import TokenizerRef

CACHE_VERSION = "part-tokens-v2"  # v2: stored only when the bytes read are the bytes keyed
SHARD_BYTES = 1 << 20  # text per mapped task: ~0.3 s of tokenizing here, small against a task's overhead
# Text per encode_batch_fast call: long enough to keep every core busy, few returns to Python.
ENCODE_BATCH_BYTES = 1 << 20
_TYPECODES = {"uint16": "H", "uint32": "I"}
_LOCAL = threading.local()


class PartSpec(BaseModel):
    """One part of a split, as it travels to a tokenizing task (plain values: any task runner ships it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    relpath: str
    digest: str
    size: int
    select: tuple[str, float] | None = None
    text_field: str = "text"

    @classmethod
    def of(cls, part: FilePart, text_field: str) -> PartSpec:
        f = part.file
        return cls(
            path=f.path,
            relpath=f.relpath,
            digest=f.digest,
            size=f.size,
            select=part.select,
            text_field=text_field,
        )

    def file_part(self) -> FilePart:
        return FilePart(SourceFile(self.path, self.relpath, self.digest, self.size), self.select)


class TokenShard(BaseModel):
    """Parts tokenized by one task, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parts: tuple[PartSpec, ...]
    tokenizer: TokenizerRef
    add_bos: bool
    dtype: str

    @property
    def bytes(self) -> int:
        return sum(p.size for p in self.parts)


def _tokenizer_identity(tokenizer: TokenizerRef) -> str:
    sha = tokenizer.sha256
    if sha is None:
        import hashlib

        sha = hashlib.sha256(Path(tokenizer.path).read_bytes()).hexdigest()
    return f"{sha}:{tokenizer.bos_id}:{tokenizer.eos_id}"


def part_key(part: PartSpec, tokenizer: TokenizerRef, add_bos: bool, dtype: str) -> str:
    """The cache key of a part's tokens: its content and everything that shapes its token stream."""
    kind, codec = split_suffix(part.path)
    records = kind in RECORD_SUFFIXES
    # A whole file's tokens depend on its bytes only, wherever it lies; one side of a file's documents on
    # the side's rule too, and a prose file's segments on its relative path (their identity).
    selection = (
        ""
        if part.select is None
        else f"{'' if records else part.relpath}:{part.select[0]}:{part.select[1]!r}"
    )
    field = part.text_field if records else ""
    return blake(
        CACHE_VERSION,
        part.digest,
        kind + codec,
        selection,
        field,
        _tokenizer_identity(tokenizer),
        str(add_bos),
        dtype,
    )


def cached_counts(key: str, root: Path | None = None) -> dict[str, int] | None:
    """The counts of a complete cache entry ({"tokens", "documents", "bytes"}), or None. `root`: the token
    cache's directory (`tokens_dir()`, computed once by callers that look up many parts)."""
    _, meta = entry_paths(key, root)
    try:
        with open(meta) as handle:
            counts = json.load(handle)
        os.utime(meta)  # its last use: what `python -m flows.cache prune` goes by
    except (FileNotFoundError, ValueError):
        return None
    return counts


def _tokenizer(path: str) -> Any:
    """One loaded tokenizer per thread and file (a Tokenizer is not shared across threads here)."""
    loaded = getattr(_LOCAL, "tokenizers", None)
    if loaded is None:
        loaded = _LOCAL.tokenizers = {}
    if path not in loaded:
        from tokenizers import Tokenizer

        loaded[path] = Tokenizer.from_file(path)
    return loaded[path]


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    """Non-empty texts in batches of about `size` characters."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        if text:
            batch.append(text)
            chars += len(text)
        if chars >= size:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_part(part: PartSpec, tokenizer: TokenizerRef, add_bos: bool, dtype: str) -> dict[str, int]:
    """Tokenize one part into its cache entry (at once when it is there); returns its counts."""
    key = part_key(part, tokenizer, add_bos, dtype)
    if (counts := cached_counts(key)) is not None:
        return counts
    encoder = _tokenizer(tokenizer.path)
    data, meta = entry_paths(key)
    os.makedirs(os.path.dirname(data), exist_ok=True)
    counts = {"tokens": 0, "documents": 0, "bytes": 0}
    with atomic_file(data) as tmp, open(tmp, "wb") as out:
        for batch in _batches(part_texts(part.file_part(), part.text_field), ENCODE_BATCH_BYTES):
            ids = array.array(_TYPECODES[dtype])  # from a list in C: faster than numpy from Python ints
            for encoding in encoder.encode_batch_fast(batch, add_special_tokens=False):
                if add_bos:
                    ids.append(tokenizer.bos_id)
                ids.fromlist(encoding.ids)
                ids.append(tokenizer.eos_id)
            out.write(ids.tobytes())
            counts["tokens"] += len(ids)
            counts["documents"] += len(batch)
            counts["bytes"] += sum(len(text.encode("utf-8")) for text in batch)
    write_text_atomic(meta, json.dumps(counts))  # last: the entry is complete
    return counts


def tokenize_shard(shard: TokenShard) -> dict[str, float]:
    """Tokenize every part of a shard that is not cached yet; returns what it did."""
    started = time.perf_counter()
    totals = {"parts": 0, "tokens": 0, "documents": 0, "bytes": 0}
    for part in shard.parts:
        counts = tokenize_part(part, shard.tokenizer, shard.add_bos, shard.dtype)
        totals["parts"] += 1
        for name in ("tokens", "documents", "bytes"):
            totals[name] += counts[name]
    return {
        **totals,
        "seconds": round(time.perf_counter() - started, 3),
        "pid": os.getpid(),
        "thread": threading.get_ident(),
    }


def plan_shards(
    parts: Sequence[PartSpec],
    tokenizer: TokenizerRef,
    *,
    add_bos: bool,
    dtype: str,
    shard_bytes: int = SHARD_BYTES,
) -> list[TokenShard]:
    """The parts whose tokens are not cached, grouped in corpus order into shards of about `shard_bytes`."""
    shards: list[TokenShard] = []
    group: list[PartSpec] = []
    size = 0
    root = tokens_dir()
    for part in parts:
        if cached_counts(part_key(part, tokenizer, add_bos, dtype), root) is not None:
            continue
        group.append(part)
        size += part.size
        if size >= shard_bytes:
            shards.append(TokenShard(parts=tuple(group), tokenizer=tokenizer, add_bos=add_bos, dtype=dtype))
            group, size = [], 0
    if group:
        shards.append(TokenShard(parts=tuple(group), tokenizer=tokenizer, add_bos=add_bos, dtype=dtype))
    return shards


def pack_parts(
    keys: Sequence[str],
    lengths: Sequence[int],
    npy_path: Path,
    *,
    seq_len: int,
    keep_remainder: bool,
    pad_id: int,
    dtype: np.dtype,
) -> tuple[int, int, int]:
    """Write the concatenated cached streams of `keys` (`lengths` tokens each) as (n_blocks, seq_len + 1)
    rows of an .npy, one copy; returns (blocks, stream tokens, stream tokens kept). The tail shorter than a
    block is dropped, or with `keep_remainder` right-padded with `pad_id` into a last block when it holds at
    least 2 tokens."""
    n_tokens = sum(lengths)
    width = seq_len + 1
    full, remainder = divmod(n_tokens, width)
    keep_tail = keep_remainder and remainder >= 2
    blocks = full + int(keep_tail)
    kept = full * width + (remainder if keep_tail else 0)
    out = np.lib.format.open_memmap(npy_path, mode="w+", dtype=dtype, shape=(blocks, width))
    flat = out.reshape(-1)
    root = tokens_dir()
    offset = 0
    with Progress(f"packing {npy_path.name}", kept, unit=" tokens") as progress:
        for key, length in zip(keys, lengths, strict=True):
            if offset == kept:
                break
            take = min(length, kept - offset)
            if take == 0:  # a part without tokens (an empty file): the parts after it still count
                continue
            data, _ = entry_paths(key, root)
            flat[offset : offset + take] = np.fromfile(data, dtype=dtype, count=take)
            offset += take
            progress.update(take)
    flat[offset:] = pad_id
    out.flush()
    del out
    return blocks, n_tokens, kept
