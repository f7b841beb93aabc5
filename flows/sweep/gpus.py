"""GPUs for local trials: each trial of a spec with `gpus_per_trial` gets devices of its own, given to the
child as CUDA_VISIBLE_DEVICES, and as many trials run at once as the host's GPUs allow (at most `parallel`
when it is given).

The host's GPUs: those the sweep itself may use (its CUDA_VISIBLE_DEVICES), else torch's count;
LLAMAFLOW_SWEEP_GPUS (a count) overrides both, for a host torch cannot see into or a test without GPUs.
"""

from __future__ import annotations

import os
import threading

from flows.sweep.spec import SweepSpec

GPUS_ENV = "LLAMAFLOW_SWEEP_GPUS"


def host_gpus() -> list[str]:
    """The device ids trials may be given."""
    if os.environ.get(GPUS_ENV):
        return [str(i) for i in range(int(os.environ[GPUS_ENV]))]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def trials_at_once(spec: SweepSpec, gpus: list[str] | None = None) -> int:
    """How many trials run side by side: `parallel` (default 1), or with `gpus_per_trial` as many as the
    GPUs hold (no more than `parallel` when it is given)."""
    if spec.gpus_per_trial == 0 or spec.launch != "local":
        return spec.parallel or 1
    gpus = host_gpus() if gpus is None else gpus
    fit = len(gpus) // spec.gpus_per_trial
    if fit == 0:
        raise ValueError(
            f"gpus_per_trial={spec.gpus_per_trial} but this host has {len(gpus)} GPU(s) a sweep may use: lower "
            f"gpus_per_trial, or run the sweep where the GPUs are (or set {GPUS_ENV})"
        )
    return min(fit, spec.parallel or fit)


class GpuPool:
    """The host's GPUs, handed to trials `per_trial` at a time and taken back when they end."""

    def __init__(self, gpus: list[str], per_trial: int) -> None:
        self.free, self.per_trial = list(gpus), per_trial
        self.lock = threading.Lock()

    def take(self) -> list[str]:
        with self.lock:
            if len(self.free) < self.per_trial:  # trials_at_once keeps the in-flight count within the GPUs
                raise RuntimeError(f"no {self.per_trial} free GPU(s) left of {self.free}")
            taken, self.free = self.free[: self.per_trial], self.free[self.per_trial :]
            return taken

    def give_back(self, taken: list[str]) -> None:
        with self.lock:
            self.free.extend(taken)
