"""Per-rank bytes of parameters + gradients + optimizer state under DDP and FSDP2, counted from the tensors.

    .venv/bin/python benchmarks/fsdp_memory.py [--preset small] [--nproc 2] [--optimizer adamw|muon]

Each mode runs as `--nproc` gloo ranks (torchrun, 127.0.0.1) through the engine's own pieces: `parallelize`
(the model as the ranks share it) and `build_optimizer` (from the parameters after wrapping), then one
optimizer step on a random batch, so that gradients and optimizer state exist. Each rank then counts the
bytes of the tensors it holds: the parameters (a DTensor by its local shard, a tied weight once), their
gradients, and its optimizer state. DDP's gradient buckets (a second copy of the gradients inside DDP's
reducer) and activations are not counted. Writes results/fsdp_memory[_TAG].json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, run_ranks, write_json  # noqa: E402
from model import LlamaConfig, count_params, get_preset  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.training.distributed import leave_process_group  # noqa: E402
from tasks.training.optim import build_optimizer  # noqa: E402
from tasks.training.parallelize import parallelize  # noqa: E402
from tasks.training.settings import TrainSettings  # noqa: E402

GOAL = 0.55  # FSDP2's per-rank parameter + gradient + optimizer bytes at 2 ranks, as a share of DDP's


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def rank_side(mode: str, optimizer_name: str, weights: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = LlamaConfig.from_dict(json.loads((weights / "config.json").read_text()))
    settings = TrainSettings(
        data_parallel=mode, optimizer=optimizer_name, compile=False, dtype="fp32", device="cpu"
    )  # type: ignore[arg-type]
    cpu = torch.device("cpu")
    parallel = parallelize(config, weights, settings, cpu, eos_id=None)
    optimizer = build_optimizer(parallel.plain, settings, cpu)
    tokens = torch.randint(0, config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(rank))
    with parallel.micro_batch(last=True):
        (parallel.model(tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()).backward()
    optimizer.step()
    params = list(parallel.plain.parameters())  # a tied weight once
    counted = {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": sum(
            local_bytes(value)
            for part in optimizer.optimizers
            for state in part.state.values()
            for value in state.values()
            if torch.is_tensor(value)
        ),
    }
    counted["total"] = sum(counted.values())
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(counted))
    leave_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--rank-side", nargs=4, metavar=("MODE", "OPTIMIZER", "WEIGHTS", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.rank_side:
        mode, optimizer_name, weights, out = args.rank_side
        rank_side(mode, optimizer_name, Path(weights), Path(out))
        return

    config = get_preset(args.preset)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        weights, out = Path(build_model(config, seed=0).path), Path(tmp) / "counts"
        out.mkdir()
        for mode in ("ddp", "fsdp"):
            run_ranks(
                Path(__file__), args.nproc, ["--rank-side", mode, args.optimizer, str(weights), str(out)]
            )
        per_rank = {
            mode: [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(args.nproc)]
            for mode in ("ddp", "fsdp")
        }
    worst = {mode: max(r["total"] for r in ranks) for mode, ranks in per_rank.items()}
    ratio = worst["fsdp"] / worst["ddp"]
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_info(torch.device("cpu")),
        "load_average": {"before": load_before, "after": load_average()},
        "preset": args.preset,
        "params": count_params(config),
        "nproc": args.nproc,
        "optimizer": args.optimizer,
        "bytes_per_rank": per_rank,
        "fsdp_over_ddp": ratio,
        "goal": GOAL,
        "goal_met": ratio <= GOAL,
    }
    name = f"fsdp_memory_{args.tag}.json" if args.tag else "fsdp_memory.json"
    write_json(RESULTS_DIR / name, result)
    for mode, ranks in per_rank.items():
        for r, counts in enumerate(ranks):
            print(f"{mode} rank {r}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in counts.items()))
    print(f"FSDP2 / DDP per-rank bytes (largest rank): {ratio:.3f} (goal <= {GOAL})")


if __name__ == "__main__":
    main()
