"""A sweep's local trial: `python -m flows.pretrain` with the same arguments, ended when the sweep dies.

    python -m flows.sweep.child SWEEP_PID --config trial/config.yaml

On Linux the child asks to be told when its parent dies (PR_SET_PDEATHSIG), so a sweep killed with
kill -9 leaves no trial training on: each writes a checkpoint and ends, and the next sweep resumes it.
The kernel sends that signal each time the child is handed to another dying thread of the parent (a
multi-threaded sweep: once per thread), so it asks for SIGUSR1 and turns the first into one SIGTERM, the
engine's stop request; a second SIGTERM would mean "stop without a checkpoint".

The GPUs the trial sees (CUDA_VISIBLE_DEVICES, set by the sweep with gpus_per_trial) are recorded as a tag
of the MLflow run it creates, read here from the trial's own environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
TAG_DEVICES = "llamaflow.sweep.cuda_visible_devices"


def _parent_died(signum: int, frame: object) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the repeats
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    parent, args = int(argv[0]), argv[1:]
    if sys.platform == "linux":
        import ctypes

        signal.signal(signal.SIGUSR1, _parent_died)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGUSR1))
        if os.getppid() != parent:  # the sweep died before the request was in place
            return 130
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        context = json.loads(os.environ.get("MLFLOW_RUN_CONTEXT") or "{}")
        os.environ["MLFLOW_RUN_CONTEXT"] = json.dumps({**context, TAG_DEVICES: visible})
    from flows.pretrain import main as pretrain_main

    return pretrain_main(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
