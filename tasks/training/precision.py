"""Numeric precision of training and evaluation: the one autocast rule."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def autocast(device: torch.device, dtype: str) -> AbstractContextManager[object]:
    """bf16 autocast for `dtype="bf16"` (matmuls in bf16, weights and reductions in fp32), else nothing."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
