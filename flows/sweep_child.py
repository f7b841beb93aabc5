"""A sweep's local trial: `python -m flows.pretrain` with the same arguments, ended when the sweep dies.

    python -m flows.sweep_child SWEEP_PID --config trial/config.yaml

On Linux the child asks for SIGTERM when its parent dies (PR_SET_PDEATHSIG), so a sweep killed with
kill -9 leaves no trial training on: each writes a checkpoint and ends, and the next sweep resumes it.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    parent, args = int(argv[0]), argv[1:]
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the sweep died before the request was in place
            return 130
    from flows.pretrain import main as pretrain_main

    return pretrain_main(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
