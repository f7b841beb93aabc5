"""Exact validation bits per byte of a checkpoint on the main job's held-out stdlib split.

    LLAMAFLOW_HOME=<the run's home> python benchmarks/recipe/checkpoint_bpb.py RUN_DIR/step_000600 [--first 256]

Summed token cross-entropy in bits over the UTF-8 bytes of the scored targets (a token's bytes: its length in
the byte-level alphabet; special tokens 0), eager bf16. `--first N` scores the first N blocks (what the
flow's evaluate scores with eval_max_blocks=N); by default every held-out block.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.speedrun import token_byte_lengths  # noqa: E402
from flows.config import PretrainConfig  # noqa: E402
from model import load_pretrained  # noqa: E402
from tasks.data.packed import open_blocks  # noqa: E402
from tasks.dataset import build_dataset  # noqa: E402
from tasks.tokenize import train_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--first", type=int, default=0, help="score the first N blocks (default: all)")
    parser.add_argument("--preset", default="demo", help="the run's preset (its data, vocabulary, seq_len)")
    args = parser.parse_args()
    config = PretrainConfig(preset=args.preset)
    tokenizer = train_tokenizer(config.data, config.vocab_size, val_fraction=config.val_fraction)
    dataset = build_dataset(config.data, tokenizer, config.seq_len, val_fraction=config.val_fraction)
    val = np.asarray(open_blocks(dataset.path, "val"))
    blocks = torch.from_numpy(val[: args.first or len(val)].astype(np.int64))
    byte_len = torch.from_numpy(token_byte_lengths(tokenizer.path))
    model = load_pretrained(args.checkpoint).eval()
    nats = tokens = n_bytes = 0.0
    with torch.no_grad():
        for start in range(0, len(blocks), 16):
            batch = blocks[start : start + 16]
            targets = batch[:, 1:]
            scored = targets != tokenizer.pad_id
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
            nats += float(
                F.cross_entropy(
                    logits.float().flatten(0, 1),
                    targets.masked_fill(~scored, -100).flatten(),
                    reduction="sum",
                    ignore_index=-100,
                )
            )
            tokens += float(scored.sum())
            n_bytes += float(byte_len[targets].masked_fill(~scored, 0).sum())
    print(
        f"{args.checkpoint}: {len(blocks)} blocks, {tokens:.0f} tokens, {n_bytes:.0f} bytes "
        f"({n_bytes / tokens:.3f} bytes/token): {nats / tokens:.4f} nats/token, "
        f"{nats / math.log(2) / n_bytes:.4f} bits/byte"
    )


if __name__ == "__main__":
    main()
