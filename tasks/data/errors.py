"""Shared by the data stages: the one error type, warnings, and stable hashes."""

from __future__ import annotations

import hashlib
import logging
from typing import Any


class DataError(ValueError):
    """Bad data input; the message names the problem and the fix."""


def not_utf8(path: str, err: UnicodeDecodeError) -> DataError:
    """The error for text inside a compressed file that is not UTF-8 (plain files are skipped with a warning)."""
    return DataError(f"{path} holds text that is not UTF-8 ({err.reason}); re-encode it as UTF-8.")


class DataWarning(UserWarning):
    """Something in the corpus was skipped."""


def blake(*parts: str | bytes) -> str:
    """A 32-hex-digit blake2b over length-prefixed parts (so ("ab", "c") != ("a", "bc"))."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return digest.hexdigest()


def unit_hash(key: str) -> float:
    """A stable number in [0, 1) for a split key (relative path or record index)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2**64


def data_logger() -> Any:
    """Prefect's run logger inside a flow or task run (so lines reach the UI), else a plain logger."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("llamaflow.data")
