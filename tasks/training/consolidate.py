"""Write a sharded (FSDP2) checkpoint's model.safetensors from its slices, e.g. before exporting it:

    python -m tasks.training.consolidate runs/RUN/step_000400   # prints .../step_000400/model.safetensors

Evaluation, registration and `init_from` do this themselves (`checkpoint_weights.whole_weights`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tasks.training.checkpoint_weights import whole_weights


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        sys.exit("usage: python -m tasks.training.consolidate CHECKPOINT_DIR (a step_* directory)")
    print(whole_weights(Path(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
