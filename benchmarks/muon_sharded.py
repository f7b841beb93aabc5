"""What Muon's whole-matrix update costs under FSDP2: `ShardedMuon.step()` at N ranks against
torch.optim.Muon in one process holding the whole model.

    .venv/bin/python benchmarks/muon_sharded.py [--preset small] [--nproc 2] [--steps 10]

The ranks (torchrun, gloo, 127.0.0.1) build the preset through the engine's `parallelize` (FSDP2) and
`build_optimizer` (Muon for the hidden matrices), take one backward pass on a random batch, then time
`steps` Muon steps on those gradients (a barrier before each). Beside it each rank times the Newton-Schulz
of the matrices it owns alone (its compute share, no communication); step minus that share is the
gather/scatter and the elementwise work. Rank 0 first times torch.optim.Muon on the whole model in one
process while the other ranks wait. Writes results/muon_sharded[_TAG].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, run_ranks, write_json  # noqa: E402
from model import LlamaConfig, get_preset, load_pretrained  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.training.distributed import leave_process_group  # noqa: E402
from tasks.training.loss import LossHead  # noqa: E402
from tasks.training.muon import newton_schulz  # noqa: E402
from tasks.training.optim import build_optimizer, parameter_roles  # noqa: E402
from tasks.training.parallelize import parallelize  # noqa: E402
from tasks.training.settings import TrainSettings  # noqa: E402

SETTINGS = dict(optimizer="muon", compile=False, dtype="fp32", device="cpu")


def timed(function: object, steps: int, *, together: bool = True) -> list[float]:
    """Seconds of each of `steps` calls; `together`: every rank calls it, after a barrier."""
    times = []
    for _ in range(steps):
        if together:
            dist.barrier()
        start = time.perf_counter()
        function()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return times


def rank_side(weights: Path, steps: int, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig.from_dict(json.loads((weights / "config.json").read_text()))
    cpu = torch.device("cpu")
    tokens = torch.randint(0, config.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0))
    report: dict[str, object] = {}
    if rank == 0:
        plain = load_pretrained(config, weights)
        optimizer = build_optimizer(plain, TrainSettings(**SETTINGS), cpu)  # type: ignore[arg-type]
        LossHead(plain)(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.parts["muon"].step()  # warm-up
        report["one_process_s"] = timed(optimizer.parts["muon"].step, steps, together=False)
        report["matrices"] = len(parameter_roles(plain)["hidden"])
    dist.barrier()
    settings = TrainSettings(data_parallel="fsdp", **SETTINGS)  # type: ignore[arg-type]
    parallel = parallelize(config, weights, settings, cpu, eos_id=None)
    optimizer = build_optimizer(parallel.plain, settings, cpu)
    muon = optimizer.parts["muon"]
    with parallel.micro_batch(last=True):
        parallel.model(tokens[:, :-1], tokens[:, 1:]).backward()
    muon.step()  # warm-up
    report["sharded_step_s"] = timed(muon.step, steps)
    group = muon.param_groups[0]
    owned = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
        for k, p in enumerate(group["params"])
        if k % world == rank
    ]

    def own_share() -> None:
        for matrix in owned:
            newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

    report["own_newton_schulz_s"] = timed(own_share, steps)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    leave_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tag", default="")
    parser.add_argument("--rank-side", nargs=2, metavar=("WEIGHTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        rank_side(Path(args.rank_side[0]), args.steps, Path(args.rank_side[1]))
        return
    config = get_preset(args.preset)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        weights, out = Path(build_model(config, seed=0).path), Path(tmp) / "out"
        out.mkdir()
        run_ranks(
            Path(__file__), args.nproc, ["--steps", str(args.steps), "--rank-side", str(weights), str(out)]
        )
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    median = statistics.median
    one = median(ranks[0]["one_process_s"])
    sharded = max(median(r["sharded_step_s"]) for r in ranks)
    share = max(median(r["own_newton_schulz_s"]) for r in ranks)
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_info(torch.device("cpu")),
        "load_average": {"before": load_before, "after": load_average()},
        "preset": args.preset,
        "nproc": args.nproc,
        "matrices": ranks[0]["matrices"],
        "median_ms": {
            "one_process_torch_muon": 1e3 * one,
            "sharded_muon_step": 1e3 * sharded,
            "own_newton_schulz_share": 1e3 * share,
            "gather_scatter_and_elementwise": 1e3 * (sharded - share),
        },
        "sharded_over_one_process": sharded / one,
        "per_rank": ranks,
    }
    name = f"muon_sharded_{args.tag}.json" if args.tag else "muon_sharded.json"
    write_json(RESULTS_DIR / name, result)
    print(json.dumps(result["median_ms"], indent=2), f"\nsharded / one process: {sharded / one:.2f}")


if __name__ == "__main__":
    main()
