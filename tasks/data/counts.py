"""What a piece of a token stream holds, one type wherever it is counted: a cache entry, a mapped shard's
result, a split of a packed dataset."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class TokenCounts(BaseModel):
    """Tokens (EOS, and BOS when added, included), the documents they came from, and those documents' UTF-8
    bytes. Its JSON is a token cache entry's `.json`."""

    model_config = ConfigDict(extra="forbid")

    tokens: int = 0
    documents: int = 0
    bytes: int = 0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(
            tokens=self.tokens + other.tokens,
            documents=self.documents + other.documents,
            bytes=self.bytes + other.bytes,
        )


class ShardReport(BaseModel):
    """What one mapped tokenizing task did, and where it ran (its process and thread)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parts: int
    counts: TokenCounts
    seconds: float
    pid: int
    thread: int
