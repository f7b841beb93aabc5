"""Under FSDP2: compile each decoder block, or the whole model (LossHead), or nothing? Training steps timed
side by side at N ranks.

    .venv/bin/python benchmarks/fsdp_compile.py [--preset demo] [--nproc 2] [--rounds 4] [--steps 3]

The ranks (torchrun, gloo, 127.0.0.1) build one model per variant through the engine's `parallelize`
(`compile=True` for the whole model; `compile=False` for eager, and for the blocks variant, which then
compiles each of `decoder_blocks` in place) and `build_optimizer`, then run the same
optimizer steps (`--micro-batches` micro-batches of `--batch` x `--seq-len` tokens per rank, forward,
backward, clip, step) in rounds, the variants taking turns within each round. The first two steps of each
variant (compilation) are timed apart. tokens/s = tokens of all ranks per step / the slowest rank's median
step time. Writes results/fsdp_compile[_TAG].json.
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
from model import LlamaConfig, get_preset  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.training.distributed import leave_process_group  # noqa: E402
from tasks.training.optim import build_optimizer  # noqa: E402
from tasks.training.parallelize import decoder_blocks, parallelize  # noqa: E402
from tasks.training.precision import autocast  # noqa: E402
from tasks.training.settings import TrainSettings  # noqa: E402

VARIANTS = {"eager": None, "compile-blocks": "blocks", "compile-model": "model"}


def rank_side(weights: Path, args: argparse.Namespace, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True)  # as the engine trains on CPU
    config = LlamaConfig.from_dict(json.loads((weights / "config.json").read_text()))
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(rank)
    batches = [
        torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1), generator=generator)
        for _ in range(args.micro_batches)
    ]
    n_tokens = args.batch * args.seq_len * args.micro_batches * dist.get_world_size()
    runs = {}
    for name, scope in VARIANTS.items():
        settings = TrainSettings(
            data_parallel="fsdp", compile=scope == "model", dtype=args.dtype, device="cpu"
        )  # type: ignore[arg-type]
        parallel = parallelize(config, weights, settings, cpu, eos_id=None)
        if scope == "blocks":  # the variant the engine does not build: each decoder block compiled alone
            for block in decoder_blocks(parallel.plain):
                block.compile(dynamic=False)
        runs[name] = (parallel, build_optimizer(parallel.plain, settings, cpu), settings)

    def step(name: str) -> float:
        parallel, optimizer, settings = runs[name]
        dist.barrier()
        start = time.perf_counter()
        for i, batch in enumerate(batches):
            with parallel.micro_batch(last=i == len(batches) - 1):
                with autocast(cpu, settings.dtype):
                    loss = parallel.model(batch[:, :-1], batch[:, 1:])
                (loss / n_tokens).backward()
        parallel.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    report: dict[str, dict[str, list[float]]] = {name: {"first": [], "timed": []} for name in VARIANTS}
    for name in VARIANTS:
        report[name]["first"] = [step(name), step(name)]
    for _ in range(args.rounds):
        for name in VARIANTS:
            report[name]["timed"] += [step(name) for _ in range(args.steps)]
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    leave_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--tag", default="")
    parser.add_argument("--rank-side", nargs=2, metavar=("WEIGHTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        rank_side(Path(args.rank_side[0]), args, Path(args.rank_side[1]))
        return
    config = get_preset(args.preset)
    load_before = load_average()
    # Not --nproc: torchrun would take it for its own --nproc-per-node.
    forwarded = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("rank_side", "tag", "nproc")
    ]
    with tempfile.TemporaryDirectory() as tmp:
        weights, out = Path(build_model(config, seed=0).path), Path(tmp) / "out"
        out.mkdir()
        run_ranks(Path(__file__), args.nproc, [*forwarded, "--rank-side", str(weights), str(out)])
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    tokens = args.batch * args.seq_len * args.micro_batches * args.nproc
    summary = {}
    for name in VARIANTS:
        median = max(statistics.median(r[name]["timed"]) for r in ranks)
        summary[name] = {
            "tokens_per_s": tokens / median,
            "median_step_s": median,
            "first_two_steps_s": max(sum(r[name]["first"]) for r in ranks),
        }
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_info(torch.device("cpu")),
        "load_average": {"before": load_before, "after": load_average()},
        "preset": args.preset,
        "settings": {k: v for k, v in vars(args).items() if k != "rank_side"},
        "variants": summary,
        "per_rank": ranks,
    }
    name = f"fsdp_compile_{args.tag}.json" if args.tag else "fsdp_compile.json"
    write_json(RESULTS_DIR / name, result)
    for variant, row in summary.items():
        print(
            f"{variant:>15}: {row['tokens_per_s']:8.0f} tokens/s, median step {row['median_step_s'] * 1e3:7.1f} ms, "
            f"first two steps {row['first_two_steps_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
