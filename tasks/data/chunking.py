"""Content-defined segments of a prose file: cut where the text says, not at a position.

A cut falls just after a whitespace byte (space, tab, newline) where a rolling hash of the `WINDOW` bytes
ending there has its top `MASK_BITS` bits zero, at least `MIN_BYTES` after the previous cut (about 64 KiB
apart on English prose). The hash is a gear-style window sum: a fixed random 64-bit value per byte value,
summed over the window (a difference of two cumulative sums, so numpy computes it a buffer at a time). It
depends only on the window's bytes, so an insertion moves the cuts near it and no other: every segment
after the next cut is the same text as before, with the same identity (the hash of its bytes) and the same
side of the split. Text with no cut for `MAX_BYTES` (a file with no whitespace) is cut there at a character
boundary, so no segment is larger, whatever the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import IO

import numpy as np

MIN_BYTES = 1 << 14
MAX_BYTES = 1 << 18
MASK_BITS = 13
WINDOW = 32
READ_BYTES = 1 << 20
_GEAR = np.random.default_rng(0x6C6C_616D_6166).integers(0, 2**64, size=256, dtype=np.uint64)
_CUT_AFTER = np.zeros(256, dtype=bool)
_CUT_AFTER[[ord(" "), ord("\t"), ord("\n")]] = True  # never after "\r": "\r\n" stays one line break
_SHIFT = np.uint64(64 - MASK_BITS)


def _candidates(buffer: np.ndarray) -> np.ndarray:
    """Offsets just after each byte where a segment may end (by the rolling hash), ascending."""
    sums = np.cumsum(_GEAR[buffer], dtype=np.uint64)  # wraps modulo 2**64, as a gear hash does
    window = sums.copy()
    window[WINDOW:] -= sums[:-WINDOW]
    hits = ((window >> _SHIFT) == 0) & _CUT_AFTER[buffer]
    hits[: WINDOW - 1] = False  # a window reaching before the buffer (never a cut: MIN_BYTES > WINDOW)
    return np.flatnonzero(hits) + 1


def _forced(buffer: np.ndarray, start: int) -> int:
    """Where a segment with no cut by `MAX_BYTES` ends: after its last whitespace, else at a character."""
    end = start + MAX_BYTES
    spaces = np.flatnonzero(_CUT_AFTER[buffer[start + MIN_BYTES : end]])
    if len(spaces):
        return start + MIN_BYTES + int(spaces[-1]) + 1
    while end > start + 1 and buffer[end] & 0xC0 == 0x80:  # not inside a UTF-8 sequence
        end -= 1
    return end


def _decoded(segment: bytes) -> tuple[str, str]:
    """(digest of the bytes, text with universal newlines, as Python reads a text file)."""
    text = segment.decode("utf-8")  # the caller names the file when this fails
    return hashlib.blake2b(segment, digest_size=16).hexdigest(), text.replace("\r\n", "\n").replace(
        "\r", "\n"
    )


def segments(raw: IO[bytes]) -> Iterator[tuple[str, str]]:
    """(digest of its bytes, text) of each segment of a prose file, read `READ_BYTES` at a time. A file
    shorter than `MIN_BYTES` is one segment, whose digest is the file's."""
    pending = b""
    while True:
        block = raw.read(READ_BYTES)
        buffer = pending + block
        if not block:
            if buffer:
                yield _decoded(buffer)
            return
        array = np.frombuffer(buffer, dtype=np.uint8)
        start = 0
        for cut in _candidates(array):
            while cut - start > MAX_BYTES:
                end = _forced(array, start)
                yield _decoded(buffer[start:end])
                start = end
            if cut - start >= MIN_BYTES:
                yield _decoded(buffer[start:cut])
                start = cut
        while len(buffer) - start > MAX_BYTES:
            end = _forced(array, start)
            yield _decoded(buffer[start:end])
            start = end
        pending = buffer[start:]
