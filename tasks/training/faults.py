"""Fault injection for tests, read from one place: `LLAMAFLOW_FAULT_INJECT`.

Comma-separated `name=step` pairs, steps counted as completed optimizer steps (1-based):
- `nan_at_step=3`: the loss of step 3 becomes NaN (health check must stop the run).
- `crash_at_step=2`: raise RuntimeError once before step 2 runs (a marker file in the run directory makes
  it once per run directory, so a retry succeeds).
- `kill_at_step=5`: SIGKILL this process right after step 5 (before any checkpoint of step 5).
- `kill_in_checkpoint=4`: SIGKILL this process halfway through writing the checkpoint of step 4.
- `kill_rank_at_step=3`: the last rank of a torchrun job SIGKILLs itself right after step 3, once per run
  directory (a restarted group goes on).
- `kill_node_at_step=3`: the same, together with its torchrun agent: the node is gone.
- `checkpoint_delay_s=40`: every checkpoint write pauses 40 seconds halfway (a slow file system).
- `torchrun_delay_s=80`: the launcher waits 80 seconds before it first starts torchrun in a run directory
  (a head node still busy while the other nodes' torchrun already waits for its rendezvous store).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV_VAR = "LLAMAFLOW_FAULT_INJECT"
_KNOWN = (
    "nan_at_step",
    "crash_at_step",
    "kill_at_step",
    "kill_in_checkpoint",
    "kill_rank_at_step",
    "kill_node_at_step",
    "checkpoint_delay_s",
    "torchrun_delay_s",
)


def injected_faults() -> dict[str, int]:
    raw = os.environ.get(ENV_VAR, "").strip()
    faults: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, _, value = item.partition("=")
        if name not in _KNOWN or not value.strip().isdigit():
            raise ValueError(f"{ENV_VAR}={raw!r}: expected comma-separated NAME=STEP with NAME in {_KNOWN}")
        faults[name] = int(value)
    return faults


class FaultInjector:
    def __init__(self, run_dir: Path) -> None:
        self.faults = injected_faults()
        self.run_dir = run_dir

    def before_launch(self) -> None:
        delay = self.faults.get("torchrun_delay_s")
        if delay and self._first_time("torchrun_delay_s"):
            time.sleep(delay)

    def before_step(self, step: int) -> None:
        if self.faults.get("crash_at_step") == step:
            marker = self.run_dir / f".fault-crash-at-{step}"
            if not marker.exists():
                marker.touch()
                raise RuntimeError(f"injected crash before step {step} ({ENV_VAR})")

    def loss_is_nan(self, step: int) -> bool:
        return self.faults.get("nan_at_step") == step

    def after_step(self, step: int) -> None:
        if self.faults.get("kill_at_step") == step:
            os.kill(os.getpid(), signal.SIGKILL)
        last_rank = int(os.environ.get("RANK", 0)) == int(os.environ.get("WORLD_SIZE", 1)) - 1
        for name in ("kill_rank_at_step", "kill_node_at_step"):
            if self.faults.get(name) == step and last_rank and self._first_time(f"{name}-{step}"):
                if name == "kill_node_at_step":
                    os.kill(os.getppid(), signal.SIGKILL)  # the torchrun agent of this node
                os.kill(os.getpid(), signal.SIGKILL)

    def mid_checkpoint(self, step: int) -> None:
        if self.faults.get("kill_in_checkpoint") == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults.get("checkpoint_delay_s"):
            time.sleep(self.faults["checkpoint_delay_s"])

    def _first_time(self, name: str) -> bool:
        marker = self.run_dir / f".fault-{name}"
        if marker.exists():
            return False
        marker.touch()
        return True
