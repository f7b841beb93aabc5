"""Which data-parallel mode and how many 80 GB GPUs each preset needs: arithmetic from the parameter counts.

    .venv/bin/python benchmarks/memory_plan.py [--gpu-gb 80] [--tokens 8192]

Counted per GPU, training in bf16 autocast with fp32 parameters (the engine on CUDA), P parameters:
  parameters 4P; gradients 4P; optimizer state: AdamW 8P (two fp32 moments), Muon 4P for the hidden
  matrices (one momentum) + 8 bytes for every other parameter (AdamW);
  DDP: all of it on every GPU, plus DDP's gradient buckets (4P);
  FSDP2 on N GPUs: parameters, gradients and optimizer state / N, plus the largest decoder block gathered
  whole in bf16, twice (the block in use and the next one prefetched), plus, when accumulating with
  `fsdp_gradient_sync: last_micro_batch`, the unsharded fp32 gradients FSDP2 keeps between micro-batches
  (4P: it reduces once per optimizer step; the default reduce-scatters every micro-batch and keeps none);
  activations of one micro-batch of `--tokens` tokens: 34 * hidden bytes per token and layer without
  activation checkpointing (Korthikanti et al. 2022, attention by a flash kernel, so no T x T term); with
  activation_checkpointing=full, 2 * hidden per token and layer (the block inputs, bf16) plus one block's
  34 * hidden; the logits, 6 bytes per token and vocabulary entry (bf16, then the float32 loss).
A GPU fits a configuration when the total stays under 90% of its memory (the CUDA context, the caching
allocator's fragmentation and NCCL buffers take the rest). Writes results/memory_plan.json; docs/scaling.md
shows its table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_common import RESULTS_DIR, markdown_table, write_json  # noqa: E402
from model import LlamaConfig, count_params, get_preset  # noqa: E402

PRESETS = ("125m", "350m", "1b", "7b")
GB = 1e9
USABLE = 0.9


def block_params(config: LlamaConfig) -> int:
    """Parameters of one decoder block."""
    return (count_params(config, non_embedding=True) - config.hidden_size) // config.num_hidden_layers


def hidden_params(config: LlamaConfig) -> int:
    """Parameters of the 2-D matrices inside the blocks (Muon's)."""
    return block_params(config) * config.num_hidden_layers - 2 * config.hidden_size * config.num_hidden_layers


def plan(
    config: LlamaConfig, tokens: int, gpu_gb: float, optimizer: str, accumulate: bool, checkpointing: bool
) -> dict:
    p = count_params(config)
    state = 8 * p if optimizer == "adamw" else 4 * hidden_params(config) + 8 * (p - hidden_params(config))
    sharded = 4 * p + 4 * p + state
    per_layer = 34 * config.hidden_size * tokens
    if checkpointing:
        activations = 2 * config.hidden_size * tokens * config.num_hidden_layers + per_layer
    else:
        activations = per_layer * config.num_hidden_layers
    activations += 6 * config.vocab_size * tokens
    ddp = sharded + 4 * p + activations
    budget = USABLE * gpu_gb * GB

    def fsdp(n: int) -> float:
        return sharded / n + 2 * 2 * block_params(config) + (4 * p if accumulate else 0) + activations

    fits = next((n for n in (1, 2, 4, 8, 16, 32, 64) if fsdp(n) <= budget), None)
    return {
        "params": p,
        "ddp_gb": ddp / GB,
        "ddp_fits": ddp <= budget,
        "fsdp_gb": {n: fsdp(n) / GB for n in (2, 4, 8)},
        "fsdp_min_gpus": fits,
        "activations_gb": activations / GB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of one micro-batch per GPU")
    args = parser.parse_args()
    rows, table = {}, []
    for name in PRESETS:
        config = get_preset(name)
        for optimizer in ("adamw", "muon"):
            for accumulate, checkpointing in ((False, False), (True, False), (True, True)):
                key = f"{name}/{optimizer}/{'accumulate-nosync' if accumulate else 'no-accumulation'}/{'ac' if checkpointing else 'no-ac'}"
                row = plan(config, args.tokens, args.gpu_gb, optimizer, accumulate, checkpointing)
                rows[key] = row
                if optimizer == "adamw" or not accumulate:
                    table.append(
                        [
                            name,
                            f"{row['params'] / 1e9:.2f}B",
                            optimizer,
                            "yes" if accumulate else "no",
                            "full" if checkpointing else "none",
                            f"{row['activations_gb']:.1f}",
                            f"{row['ddp_gb']:.1f}" + (" ✓" if row["ddp_fits"] else " ✗"),
                            " / ".join(f"{gb:.1f}" for gb in row["fsdp_gb"].values()),
                            row["fsdp_min_gpus"] or "> 64",
                        ]
                    )
    headers = [
        "preset",
        "params",
        "optimizer",
        "accumulate, last_micro_batch",
        "act. ckpt",
        "activations GB",
        "DDP GB/GPU",
        "FSDP2 GB/GPU at 2 / 4 / 8",
        "FSDP2: fewest GPUs",
    ]
    markdown = markdown_table(headers, table)
    write_json(
        RESULTS_DIR / "memory_plan.json",
        {
            "command": " ".join(sys.argv),
            "tokens": args.tokens,
            "gpu_gb": args.gpu_gb,
            "rows": rows,
            "markdown": markdown,
        },
    )
    print(markdown)


if __name__ == "__main__":
    main()
