"""Throughput of the training engine on the `demo` preset: eager fp32, eager bf16, compiled bf16, and
accumulation 1 vs 8 at the same effective batch (compiled bf16).

    .venv/bin/python benchmarks/train_engine.py [--steps 12] [--batch 8] [--seq-len 256] [--threads N]

Every variant runs the real engine, `tasks.training.fit` (loader, exact accumulation, AdamW, clipping, a
final checkpoint), on the main job's data (the stdlib corpus, tokenized and packed by the data stages). tokens/s is the steady state (the first step, which compiles, is
left out and reported as compile_time_s). Prints a markdown table and writes
benchmarks/results/train_engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from model import count_params, get_preset
from tasks.build import build_model
from tasks.dataset import build_dataset
from tasks.tokenize import train_tokenizer
from tasks.training import TrainSettings, fit

RESULTS = Path(__file__).resolve().parent / "results" / "train_engine.json"


def variants(batch: int) -> list[tuple[str, dict]]:
    return [
        ("eager fp32", dict(compile=False, dtype="fp32", micro_batch_size=batch, accumulate_steps=1)),
        ("eager bf16", dict(compile=False, dtype="bf16", micro_batch_size=batch, accumulate_steps=1)),
        ("compiled bf16", dict(compile=True, dtype="bf16", micro_batch_size=batch, accumulate_steps=1)),
        (
            f"compiled bf16, accumulation 8 x {batch // 8}",
            dict(compile=True, dtype="bf16", micro_batch_size=batch // 8, accumulate_steps=8),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per variant")
    parser.add_argument("--batch", type=int, default=8, help="effective batch in blocks (a multiple of 8)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch % 8:
        parser.error("--batch must be a multiple of 8 (the accumulation-8 variant splits it in 8)")

    config = get_preset("demo")
    work = Path(tempfile.mkdtemp(prefix="bench-train-engine-"))
    tokenizer = train_tokenizer(None, config.vocab_size)
    dataset = build_dataset(None, tokenizer, args.seq_len)
    model = build_model(config, seed=0)

    rows = []
    for name, overrides in variants(args.batch):
        settings = TrainSettings(
            **overrides,
            max_steps=args.steps,
            epochs=1.0,
            lr=1e-3,
            warmup_steps=2,
            device="cpu" if not torch.cuda.is_available() else "auto",
        )
        started = time.perf_counter()
        ref = fit(model, dataset, settings, work / name.replace(" ", "_").replace(",", ""), progress=False)
        rows.append(
            {
                "variant": name,
                "tokens_per_s": round(ref.metrics["tokens_per_s"]),
                "compile_time_s": round(ref.metrics["compile_time_s"], 2),
                "mfu": round(ref.metrics["mfu"], 4),
                "final_loss": round(ref.metrics["train_loss"], 4),
                "recompiles": int(ref.metrics["recompiles"]),
                "wall_s": round(time.perf_counter() - started, 1),
            }
        )
        print(rows[-1], flush=True)

    result = {
        "preset": "demo",
        "params": count_params(config),
        "seq_len": args.seq_len,
        "effective_batch": args.batch,
        "steps": args.steps,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "load_average_1min": round(os.getloadavg()[0], 2),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\ndemo preset ({result['params'] / 1e6:.1f}M params), batch {args.batch} x {args.seq_len}, "
        f"{args.steps} steps, torch {torch.__version__}, {result['threads']} threads, "
        f"load average {result['load_average_1min']}\n"
    )
    print("| variant | tokens/s | first step (compile) s | MFU | recompiles |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['tokens_per_s']} | {row['compile_time_s']} | {row['mfu']:.2%} | "
            f"{row['recompiles']} |"
        )
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
