"""Each rank's random generators in a checkpoint (`rng_rank_<r>.pt`): captured at a save, restored at a
resume, so the data order and any sampling continue as if the run had never stopped."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank}.pt"


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generators; on a GPU only its own device's (a host with other GPUs can restore it)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore `capture_rng_state`'s generators; a CUDA state goes to `device` (skipped on a CPU)."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def load_rng_state(path: Path, rank: int) -> dict[str, Any] | None:
    """Rank `rank`'s RNG state in checkpoint `path`, or None when the checkpoint was written by fewer ranks."""
    file = path / rng_file(rank)
    return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else None
