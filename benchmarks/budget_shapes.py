"""Which demo shape learns most in a fixed wall-clock budget on this host (issue 52 item 2).

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/budget_shapes.py \
        --budget 240 --tag budget_shapes_avx2

Every shape trains the demo recipe (its optimizer, learning rates, schedule shape) on the main job's data
(vocabulary 4,096, 128-token sequences: one dataset for all) with the real engine and `time_budget` set to
`--budget` seconds: the engine measures its step (compilation included) and plans the steps that fit, so the
shapes meet at equal wall clock, each with its schedule decayed at its own last step. Each final model is
scored on the same evenly spaced validation blocks (`speedrun.BitsPerByte`). The shapes run one after the
other, in one process: load on a shared host confounds them (the load average is recorded around each).
With the two variables above, torch and oneDNN dispatch AVX2 kernels and `dtype: auto` trains fp32, as on
an AVX2-only host: the timings are that emulation's, not a real AVX2 host's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402
from benchmarks.speedrun import CPU, BitsPerByte, token_byte_lengths  # noqa: E402
from flows.demo_shapes import DEMO_SHAPES  # noqa: E402
from flows.pretrain_config import PretrainConfig  # noqa: E402
from model import load_pretrained  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.data.packed import open_blocks  # noqa: E402
from tasks.dataset import build_dataset  # noqa: E402
from tasks.tokenize import train_tokenizer  # noqa: E402
from tasks.training import TrainSettings, fit, read_metrics  # noqa: E402
from tasks.training.budget import BudgetPlan  # noqa: E402
from tasks.training.checkpoint import load_trainer_state  # noqa: E402
from tasks.training.precision import resolve_dtype  # noqa: E402


def run_shape(name: str, budget_s: float, bpb: BitsPerByte, dataset: Any, work: Path) -> dict[str, Any]:
    config = PretrainConfig(preset="demo", **DEMO_SHAPES[name])
    model_ref = build_model(config.llama_config(), seed=config.seed)
    values = config.train_settings().model_dump()
    values.update(max_steps=None, time_budget=budget_s, checkpoint_every=0, device="cpu")
    load_before = load_average()
    started = time.perf_counter()
    ref = fit(model_ref, dataset, TrainSettings.model_validate(values), work / name, progress=False)
    wall = time.perf_counter() - started
    plan = BudgetPlan.from_dict(load_trainer_state(Path(ref.path))["run"]["budget"])
    logged = read_metrics(ref.run_dir)
    model = load_pretrained(ref.path).eval()
    return {
        "shape": name,
        "settings": DEMO_SHAPES[name],
        "parameters": sum(p.numel() for p in model.parameters()),
        "planned_steps": plan.steps,
        "measured_step_s": plan.step_s,
        "first_step_s": plan.first_step_s,
        "train_wall_s": wall,
        "tokens_seen": ref.tokens_seen,
        "final_lr": logged[ref.step]["train/lr"],
        "bits_per_byte": bpb(model),
        "load_before": load_before,
        "load_after": load_average(),
    }


def step_times(name: str, steps: int, dataset: Any, work: Path) -> dict[str, Any]:
    """`steps` eager steps of shape `name`: the wall time of each after the first, and the load."""
    config = PretrainConfig(preset="demo", **DEMO_SHAPES[name])
    values = config.train_settings().model_dump()
    values.update(max_steps=steps, warmup_steps=0, compile=False, checkpoint_every=0, device="cpu")
    load_before = load_average()
    model_ref = build_model(config.llama_config(), seed=config.seed)
    ref = fit(model_ref, dataset, TrainSettings.model_validate(values), work, progress=False)
    logged = read_metrics(ref.run_dir)
    times = [logged[s]["train/step_time_s"] for s in range(2, steps + 1)]
    tokens = logged[steps]["train/tokens_seen"] / steps
    print(
        f"{name:>10}: steady steps {[round(t, 2) for t in times]} s, {tokens:.0f} tokens per step", flush=True
    )
    return {
        "shape": name,
        "settings": DEMO_SHAPES[name],
        "steady_step_s": times,
        "tokens_per_step": tokens,
        "load_before": load_before,
        "load_after": load_average(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=240.0, help="seconds of training per shape")
    parser.add_argument("--shapes", nargs="+", default=list(DEMO_SHAPES))
    parser.add_argument("--eval-blocks", type=int, default=96)
    parser.add_argument("--tag", default="budget_shapes")
    parser.add_argument(
        "--step-times",
        type=int,
        default=0,
        help="instead: N steps of each shape, eager, in the order given then reversed (step time only)",
    )
    args = parser.parse_args()

    config = PretrainConfig(preset="demo", max_steps=1)
    tokenizer = train_tokenizer(config.data, config.vocab_size, val_fraction=config.val_fraction)
    dataset = build_dataset(config.data, tokenizer, config.seq_len, val_fraction=config.val_fraction)
    dtype = resolve_dtype(CPU, "auto")
    bpb = BitsPerByte(
        open_blocks(dataset.path, "val"),
        token_byte_lengths(tokenizer.path),
        tokenizer.pad_id,
        args.eval_blocks,
        dtype,
    )
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as work:
        if args.step_times:
            order = [*args.shapes, *reversed(args.shapes)]
            runs = [
                step_times(name, args.step_times, dataset, Path(work) / str(i))
                for i, name in enumerate(order)
            ]
        else:
            runs = [run_shape(name, args.budget, bpb, dataset, Path(work)) for name in args.shapes]
    result = {
        "command": " ".join(sys.argv),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "dtype": dtype,
        "budget_s": args.budget,
        "eval_blocks": args.eval_blocks,
        "machine": machine_info(CPU),
        "runs": runs,
    }
    path = write_json(RESULTS_DIR / f"{args.tag}.json", result)
    for run in runs if not args.step_times else []:
        print(
            f"{run['shape']:>14}: {run['planned_steps']:4d} steps of {run['measured_step_s']:.2f} s, "
            f"{run['tokens_seen']:,} tokens, {run['bits_per_byte']:.4f} bits/byte "
            f"(load {run['load_before']:.1f} -> {run['load_after']:.1f})"
        )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
