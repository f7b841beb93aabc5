"""Token arrays cached per corpus file, by content: a corpus that grew by a few files tokenizes only those.

Each part of a split (a whole file, or the documents of a file that fall on one side) is tokenized once per
(file content, selection, text field, tokenizer file, special ids, BOS choice, dtype)
into `<home>/cache/tokens/<key[:2]>/<key>.bin` (the raw token stream: each document's ids followed by EOS,
optionally preceded by BOS) with `<key>.json` beside it (counts; written last, so it marks a complete
entry). The content is the digest of the bytes actually read: a file that changed after the corpus was
listed fails its read (`tasks.data.documents`) before its entry is published. An entry's `.json`
modification time is its last use (`tasks.data.token_store` shows and prunes by it). Packing a dataset
concatenates the entries of its parts in corpus order: the same stream as tokenizing the whole split at once,
so the dataset's content and fingerprint do not depend on what was cached.

A file's parts are tokenized together, in one read of the file (`tokenize_file`): a record file with
documents on both sides of the split is parsed once, not once per side. Parts still to tokenize are grouped,
a file's parts together, into shards of about `SHARD_BYTES` of file (`plan_shards`); the pipeline maps
a Prefect task over them (`tasks.dataset.tokenize_shard_task`), so they run on whatever task runner the flow
has: threads, or a Dask cluster with prefect-dask (the workers must see the corpus
files and LLAMAFLOW_HOME at the same paths: a shared file system).
"""

from __future__ import annotations

import array
import contextlib
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from model.atomic import atomic_file, write_text_atomic
from tasks import home
from tasks.data.counts import ShardReport, TokenCounts
from tasks.data.documents import routed_texts
from tasks.data.errors import DataError, blake
from tasks.data.files import FilePart, SourceFile
from tasks.data.formats import RECORD_SUFFIXES, split_suffix
from tasks.data.packed import copy_chunked
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
    filters: str = ""  # tasks.data.filters.DocFilter.key

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
            filters=part.filters,
        )

    def file_part(self) -> FilePart:
        return FilePart(
            SourceFile(self.path, self.relpath, self.digest, self.size), self.select, self.filters
        )


class TokenShard(BaseModel):
    """Parts tokenized by one task, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parts: tuple[PartSpec, ...]
    tokenizer: TokenizerRef
    add_bos: bool
    dtype: str
    home: str = Field(default_factory=lambda: str(home.home()))  # the planning process's LLAMAFLOW_HOME

    @property
    def files(self) -> int:
        return len(file_groups(self.parts))

    @property
    def bytes(self) -> int:
        """Of the files read (a file with parts on both sides of the split counts once)."""
        return sum(group[0].size for group in file_groups(self.parts))


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
        *([part.filters] if part.filters else []),  # a part with no filter keeps the key it always had
    )


def cached_counts(key: str, root: Path | None = None) -> TokenCounts | None:
    """The counts of a complete cache entry, or None. `root`: the token cache's directory (`tokens_dir()`,
    computed once by callers that look up many parts)."""
    _, meta = entry_paths(key, root)
    try:
        with open(meta) as handle:
            counts = TokenCounts.model_validate_json(handle.read())
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


def file_groups(parts: Sequence[PartSpec]) -> list[list[PartSpec]]:
    """`parts` grouped by the file they read, in first-seen order (each part once): a file's parts (its
    documents on either side of the split) are tokenized in one read of it."""
    groups: dict[tuple[str, str, str, str], list[PartSpec]] = {}
    for part in parts:
        group = groups.setdefault((part.path, part.digest, part.text_field, part.filters), [])
        if part not in group:
            group.append(part)
    return list(groups.values())


class _EntryWriter:
    """One part's token stream on its way into a cache entry: each document's ids (BOS, EOS) appended, and
    written to `out` after every batch."""

    def __init__(self, tokenizer: TokenizerRef, add_bos: bool, dtype: str, out: BinaryIO) -> None:
        self.bos = tokenizer.bos_id if add_bos else None
        self.eos = tokenizer.eos_id
        self.typecode = _TYPECODES[dtype]
        self.out = out
        self.ids = array.array(self.typecode)  # from a list in C: faster than numpy from Python ints
        self.counts = TokenCounts()

    def take(self, text: str, ids: list[int]) -> None:
        before = len(self.ids)
        if self.bos is not None:
            self.ids.append(self.bos)
        self.ids.fromlist(ids)
        self.ids.append(self.eos)
        self.counts.tokens += len(self.ids) - before
        self.counts.documents += 1
        self.counts.bytes += len(text.encode("utf-8"))

    def spill(self) -> None:
        self.out.write(self.ids.tobytes())
        self.ids = array.array(self.typecode)


class _Batch:
    """Documents of any entries, encoded in one `encode_batch_fast` call once they hold
    `ENCODE_BATCH_BYTES` of text (or at `flush`)."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.items: list[tuple[_EntryWriter, str]] = []
        self.chars = 0

    def add(self, writer: _EntryWriter, text: str) -> None:
        if text:
            self.items.append((writer, text))
            self.chars += len(text)
            if self.chars >= ENCODE_BATCH_BYTES:
                self.flush()

    def flush(self) -> None:
        if not self.items:
            return
        texts = [text for _, text in self.items]
        encodings = self.encoder.encode_batch_fast(texts, add_special_tokens=False)
        for (writer, text), encoding in zip(self.items, encodings, strict=True):
            writer.take(text, encoding.ids)
        for writer in {id(w): w for w, _ in self.items}.values():  # each once
            writer.spill()
        self.items, self.chars = [], 0


def tokenize_file(
    parts: Sequence[PartSpec], tokenizer: TokenizerRef, add_bos: bool, dtype: str
) -> list[TokenCounts]:
    """Tokenize the parts of one file (a group of `file_groups`) into their cache entries, reading the file
    once; returns each part's counts (a cached part's at once, without reading)."""
    keys = [part_key(part, tokenizer, add_bos, dtype) for part in parts]
    found = {i: counts for i, key in enumerate(keys) if (counts := cached_counts(key)) is not None}
    todo = [i for i in range(len(parts)) if i not in found]
    if not todo:
        return [found[i] for i in range(len(parts))]
    batch = _Batch(_tokenizer(tokenizer.path))
    with contextlib.ExitStack() as stack:  # on any error every staged entry is removed
        writers = []
        for i in todo:
            tmp = stack.enter_context(atomic_file(entry_paths(keys[i])[0]))
            out = stack.enter_context(open(tmp, "wb"))
            writers.append(_EntryWriter(tokenizer, add_bos, dtype, out))
        first = parts[todo[0]]
        selects = [parts[i].select for i in todo]
        for index, text in routed_texts(first.file_part().file, selects, first.text_field, first.filters):
            batch.add(writers[index], text)
        batch.flush()
    for i, writer in zip(todo, writers, strict=True):
        write_text_atomic(entry_paths(keys[i])[1], writer.counts.model_dump_json())  # last: complete
        found[i] = writer.counts
    return [found[i] for i in range(len(parts))]


def tokenize_missing(
    parts: Sequence[PartSpec], tokenizer: TokenizerRef, *, add_bos: bool, dtype: str, num_proc: int
) -> dict[str, TokenCounts]:
    """The counts of every part by its key (`part_key`), tokenizing those not cached a file at a time in
    `num_proc` threads."""
    root = tokens_dir()
    keys = [part_key(part, tokenizer, add_bos, dtype) for part in parts]
    found = {key: counts for key in keys if (counts := cached_counts(key, root)) is not None}
    missing = file_groups([part for part, key in zip(parts, keys, strict=True) if key not in found])
    if missing:
        size = sum(group[0].size for group in missing)
        with ThreadPoolExecutor(max_workers=num_proc) as pool, Progress("tokenizing", size) as progress:
            done = pool.map(lambda group: tokenize_file(group, tokenizer, add_bos, dtype), missing)
            for group, counts in zip(missing, done, strict=True):
                for part, part_counts in zip(group, counts, strict=True):
                    found[part_key(part, tokenizer, add_bos, dtype)] = part_counts
                progress.update(group[0].size)
    return found


def tokenize_shard(shard: TokenShard) -> ShardReport:
    """Tokenize every part of a shard that is not cached yet; returns what it did. A worker whose
    LLAMAFLOW_HOME is not the planner's is refused: its tokens would land in a cache the flow never reads."""
    if str(home.home()) != shard.home:
        raise DataError(
            f"This worker's LLAMAFLOW_HOME is {home.home()} but the flow's is {shard.home}: tokens written here "
            f"would never reach the flow. Set LLAMAFLOW_HOME={shard.home} on every worker (the same path, on a "
            "shared file system)."
        )
    started = time.perf_counter()
    total = TokenCounts()
    for group in file_groups(shard.parts):
        total = sum(tokenize_file(group, shard.tokenizer, shard.add_bos, shard.dtype), total)
    return ShardReport(
        parts=len(shard.parts),
        counts=total,
        seconds=round(time.perf_counter() - started, 3),
        pid=os.getpid(),
        thread=threading.get_ident(),
    )


def lost_parts(shards: Sequence[TokenShard]) -> list[PartSpec]:
    """The parts of mapped `shards` whose tokens are not in this process's token cache after the map."""
    root = tokens_dir()
    return [
        part
        for shard in shards
        for part in shard.parts
        if cached_counts(part_key(part, shard.tokenizer, shard.add_bos, shard.dtype), root) is None
    ]


def plan_shards(
    parts: Sequence[PartSpec],
    tokenizer: TokenizerRef,
    *,
    add_bos: bool,
    dtype: str,
    shard_bytes: int = SHARD_BYTES,
) -> list[TokenShard]:
    """The parts whose tokens are not cached, a file's parts together, grouped in corpus order into shards of
    about `shard_bytes` of file."""
    shards: list[TokenShard] = []
    group: list[PartSpec] = []
    size = 0
    root = tokens_dir()
    for parts_of_file in file_groups(parts):
        missing = [
            p for p in parts_of_file if cached_counts(part_key(p, tokenizer, add_bos, dtype), root) is None
        ]
        if not missing:
            continue
        group.extend(missing)
        size += missing[0].size
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
            stream = np.memmap(data, dtype=dtype, mode="r", shape=(take,))
            # Chunk by chunk: never a whole entry in memory.
            copy_chunked(flat[offset : offset + take], stream, progress.update)
            del stream
            offset += take
    flat[offset:] = pad_id
    out.flush()
    del out
    return blocks, n_tokens, kept
