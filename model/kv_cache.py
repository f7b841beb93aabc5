"""Preallocated key/value cache for incremental decoding."""

from __future__ import annotations

import torch

from model.config import LlamaConfig


class KVCache:
    """Keys and values of every layer, shape (batch, kv_heads, max_len, head_dim), filled left to right.

    The model writes each layer's new keys/values with `update` and moves `length` on with `advance` once
    all layers have run.
    """

    def __init__(self, config: LlamaConfig, batch_size: int, max_len: int) -> None:
        if max_len > config.max_position_embeddings:
            raise ValueError(
                f"cache length {max_len} exceeds max_position_embeddings {config.max_position_embeddings}; "
                "generate fewer tokens or use a shorter prompt"
            )
        self.shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
        # Allocated on first use with the dtype and device of the keys (bf16 under autocast).
        self.keys: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values (batch, kv_heads, seq, head_dim); return everything cached so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache overflow: {end} positions needed, {self.max_len} allocated")
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or keys.dtype != k.dtype:
            if self.length:
                raise ValueError(
                    "KVCache dtype changed mid-generation; keep autocast on or off for all steps"
                )
            keys = torch.zeros(self.shape, dtype=k.dtype, device=k.device)
            values = torch.zeros(self.shape, dtype=v.dtype, device=v.device)
            self.keys[layer], self.values[layer] = keys, values
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, seq: int) -> None:
        self.length += seq

    def reorder(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in `index` (e.g. to drop finished sequences)."""
        self.keys = [None if k is None else k.index_select(0, index) for k in self.keys]
        self.values = [None if v is None else v.index_select(0, index) for v in self.values]
        self.shape = (len(index), *self.shape[1:])
