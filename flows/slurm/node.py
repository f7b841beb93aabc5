"""What each node of a SLURM pretraining job runs: `python -m flows.node` (flows/node.py), which reads the
node's place from SLURM's environment. This name is kept for batch scripts written before that command:

    python -m flows.slurm.node CONFIG.yaml --nnodes N --nproc-per-node P --checkpoint-dir RUN
"""

from __future__ import annotations

import sys

from flows.node import head_address
from flows.node import main as node_main

__all__ = ["head_address", "main"]


def main(argv: list[str] | None = None) -> int:
    return node_main(argv, prog="python -m flows.slurm.node")


if __name__ == "__main__":
    sys.exit(main())
