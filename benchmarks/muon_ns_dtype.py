"""Muon's step on the demo's hidden matrices with Newton-Schulz in bf16 (torch.optim.Muon) and in fp32
(ShardedMuon(ns_dtype=float32), what build_optimizer picks where bf16 matmuls are emulated), alternated round
by round in one process.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/muon_ns_dtype.py --tag avx2
    .venv/bin/python benchmarks/muon_ns_dtype.py --tag native

The two variables make torch and oneDNN dispatch the AVX2 kernels on an AVX-512/AMX host: an AVX2 CPU's
code paths (bf16 matmuls converted to fp32 in software), not its clock or memory. Writes
benchmarks/results/muon_ns_dtype[_TAG].json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402
from flows.pretrain_config import PretrainConfig  # noqa: E402
from model import LlamaForPretraining, get_preset  # noqa: E402
from tasks.training.muon import ShardedMuon  # noqa: E402
from tasks.training.optim import parameter_roles  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per variant and round")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    config = PretrainConfig(preset="demo")
    settings = config.train_settings()
    torch.manual_seed(0)
    model = LlamaForPretraining(
        get_preset(config.model, vocab_size=config.vocab_size, **config.model_overrides)
    )
    hidden = parameter_roles(model)["hidden"]
    options = {
        "lr": settings.muon_lr,
        "weight_decay": settings.muon_weight_decay,
        "ns_steps": settings.muon_ns_steps,
    }
    variants = {
        "bf16 (torch.optim.Muon)": torch.optim.Muon(hidden, **options),
        "fp32 (ShardedMuon)": ShardedMuon(hidden, **options, ns_dtype=torch.float32),
    }
    for param in hidden:
        param.grad = torch.randn_like(param)
    load_before = load_average()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 1):
        for name, optimizer in variants.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                optimizer.step()
            if round_:  # the first round warms up
                times[name].append((time.perf_counter() - start) / args.steps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    bf16, fp32 = medians.values()
    result = {
        "command": " ".join(
            [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ]
            + ["python benchmarks/muon_ns_dtype.py", *sys.argv[1:]]
        ),
        "machine": machine_info(torch.device("cpu")),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_before_after": [load_before, load_average()],
        "matrices": [list(p.shape) for p in hidden],
        "ns_steps": settings.muon_ns_steps,
        "step_ms_median": {name: round(s * 1e3, 2) for name, s in medians.items()},
        "step_ms_all": {name: [round(s * 1e3, 2) for s in t] for name, t in times.items()},
        "fp32_speedup_over_bf16": round(bf16 / fp32, 2),
    }
    print(result)
    write_json(RESULTS_DIR / f"muon_ns_dtype{'_' + args.tag if args.tag else ''}.json", result)


if __name__ == "__main__":
    main()
