"""Mixing the packed blocks of several sources into one split, by weight (`data: [{source, weight}, ...]`).

Training: the mixture has as many blocks as its sources together; each block's source is drawn with
probability = its weight (a generator seeded by the mixture's fingerprint, so the same sources and weights
always give the same sequence), and a source hands out its own blocks in a seeded permutation of all of them,
starting that order again when it runs out (a source weighted above its share of the text is repeated: its
epochs are recorded and logged, with a warning beyond `REPEAT_WARNING`; one below its share gives blocks drawn
from across all its text, not a prefix). Validation: every source's own held-out blocks, each once, in the order the sources are
listed (not weighted: every held-out document is scored).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPEAT_WARNING = 10.0  # epochs of one source in one epoch of the mixture beyond which a run is warned
_CHUNK_ROWS = 1 << 15  # blocks copied at a time: bounded memory whatever the corpus size


def mixture_seed(fingerprint: str) -> int:
    return int(fingerprint[:16], 16)


def source_choices(blocks: int, weights: Sequence[float], seed: int) -> np.ndarray:
    """For each of `blocks` positions the index of the source it is drawn from (deterministic)."""
    p = np.asarray(weights, dtype=np.float64)
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.choice(len(p), size=blocks, p=p / p.sum()).astype(np.int32)


def source_orders(lengths: Sequence[int], seed: int) -> list[np.ndarray]:
    """For each source the order its blocks are handed out in: a permutation (seeded by the mixture), so a
    source weighted below its share gives blocks from across all of it, not its first files."""
    rng = np.random.Generator(np.random.PCG64(seed + 1))
    return [rng.permutation(length) for length in lengths]


def mix_blocks(
    sources: Sequence[np.ndarray], weights: Sequence[float], out_path: Path, seed: int
) -> list[int]:
    """Write the weighted mixture of `sources` (each `(n_i, width)`, n_i >= 1) to `out_path` (.npy);
    returns how many blocks each source gave."""
    width, dtype = sources[0].shape[1], sources[0].dtype
    total = sum(len(s) for s in sources)
    choices = source_choices(total, weights, seed)
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=dtype, shape=(total, width))
    taken = [0] * len(sources)
    orders = source_orders([len(source) for source in sources], seed)
    for start in range(0, total, _CHUNK_ROWS):
        chunk = choices[start : start + _CHUNK_ROWS]
        for index, source in enumerate(sources):
            rows = np.flatnonzero(chunk == index)
            if rows.size == 0:
                continue
            order = orders[index][(taken[index] + np.arange(rows.size)) % len(source)]
            out[start + rows] = source[order]
            taken[index] += rows.size
    out.flush()
    del out
    return taken


def concat_blocks(sources: Sequence[np.ndarray], out_path: Path) -> None:
    """Write the blocks of `sources` one after the other to `out_path` (.npy)."""
    width, dtype = sources[0].shape[1], sources[0].dtype
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=dtype, shape=(sum(map(len, sources)), width))
    offset = 0
    for source in sources:
        for start in range(0, len(source), _CHUNK_ROWS):
            rows = source[start : start + _CHUNK_ROWS]
            out[offset : offset + len(rows)] = rows
            offset += len(rows)
    out.flush()
    del out
