"""GPUs for local trials: each trial of a spec with `gpus_per_trial` gets devices of its own, given to the
child as CUDA_VISIBLE_DEVICES, and as many trials run at once as the host's GPUs allow (at most `parallel`
when it is given).

The host's GPUs: those the sweep itself may use (its CUDA_VISIBLE_DEVICES), else torch's count;
LLAMAFLOW_SWEEP_GPUS (a count) overrides both, for a host torch cannot see into or a test without GPUs.

A trial's GPUs are leased host-wide, so that two sweeps on one host never hand out the same device: a lock
file per device (`flock` on `<LLAMAFLOW_SWEEP_GPU_LOCKS, else $TMPDIR/llamaflow-gpu-locks>/gpu-<id>.lock`,
a host-local directory) held by the sweep process for the trial's life. The kernel drops it when that process
dies, so a kill -9 never leaves a device leased.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path

from flows.sweep.spec import SweepSpec

GPUS_ENV = "LLAMAFLOW_SWEEP_GPUS"
LOCKS_ENV = "LLAMAFLOW_SWEEP_GPU_LOCKS"


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


def lock_dir() -> Path:
    return Path(os.environ.get(LOCKS_ENV) or Path(tempfile.gettempdir()) / "llamaflow-gpu-locks")


class GpuPool:
    """The host's GPUs, leased to trials `per_trial` at a time (host-wide: see the module) and given back
    when they end."""

    def __init__(self, gpus: list[str], per_trial: int, locks: Path | None = None) -> None:
        self.gpus, self.per_trial = list(gpus), per_trial
        self.locks = locks or lock_dir()
        self.held: dict[str, int] = {}  # device -> the open lock file this process flocks
        self.lock = threading.Lock()

    def take(self, stopping: threading.Event | None = None, poll_s: float = 2.0) -> list[str]:
        """`per_trial` devices no other trial on this host holds, waiting while other sweeps hold them;
        [] when `stopping` is set first."""
        told = False
        while True:
            with self.lock:
                taken = self._lease()
            if taken:
                return taken
            if not told:
                print(
                    f"waiting for {self.per_trial} GPU(s) of {self.gpus}: other sweeps on this host hold them"
                )
                told = True
            if stopping is not None and stopping.wait(poll_s):
                return []
            if stopping is None:
                time.sleep(poll_s)

    def _lease(self) -> list[str]:
        self.locks.mkdir(parents=True, exist_ok=True)
        with suppress(OSError):  # every user's sweeps share the directory
            os.chmod(self.locks, 0o1777)
        got: dict[str, int] = {}
        for device in (d for d in self.gpus if d not in self.held):
            fd = os.open(self.locks / f"gpu-{device}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            got[device] = fd
            if len(got) == self.per_trial:
                self.held.update(got)
                return list(got)
        for fd in got.values():
            os.close(fd)  # too few: none taken
        return []

    def give_back(self, taken: list[str]) -> None:
        with self.lock:
            for device in taken:
                if (fd := self.held.pop(device, None)) is not None:
                    os.close(fd)  # releases the flock
