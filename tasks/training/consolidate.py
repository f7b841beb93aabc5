"""Write a sharded (FSDP2) checkpoint's model.safetensors from its slices, e.g. before exporting it:

    python -m tasks.training.consolidate runs/RUN/step_000400   # prints .../step_000400/model.safetensors
    python -m tasks.training.consolidate s3://bucket/RUN/step_000400   # writes the file beside the slices

Evaluation, registration and `init_from` do this themselves (`checkpoint_weights.whole_weights`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from model.weights import WEIGHTS_FILE
from tasks.training.checkpoint_weights import whole_weights
from tasks.training.storage import fetch_checkpoint, is_remote, upload_file


def main(argv: list[str]) -> None:
    if len(argv) == 1 and is_remote(argv[0]):  # fetched and verified, consolidated here, put back beside it
        url = argv[0].rstrip("/")
        print(upload_file(whole_weights(fetch_checkpoint(url)), f"{url}/{WEIGHTS_FILE}"))
        return
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        sys.exit("usage: python -m tasks.training.consolidate CHECKPOINT_DIR (a step_* directory or its URL)")
    print(whole_weights(Path(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
