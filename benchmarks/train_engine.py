"""Throughput of the training engine on the `demo` preset: eager fp32, eager bf16, compiled bf16, and
accumulation 1 vs 8 at the same effective batch (compiled bf16).

    .venv/bin/python benchmarks/train_engine.py [--steps 12] [--batch 8] [--seq-len 256] [--threads N]
    .venv/bin/python benchmarks/train_engine.py --vs-bare [--rounds 4]     # engine / bare compiled step

`--vs-bare` alternates, round by round, the engine (compiled bf16, accumulation 1) and a bare compiled step of
the same model on the same blocks: `LossHead` compiled, bf16 autocast, backward, `clip_grad_norm_`, fused
AdamW, `loss.item()`, deterministic algorithms as the engine sets on CPU, no loader, no logging, no
checkpoint. The engine's figure is its wall-clock tokens/s (everything included); the ratio of the medians
over rounds is printed and written to benchmarks/results/train_engine_vs_bare.json.

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
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bare_step import bare_step  # noqa: E402
from model import count_params, get_preset, load_pretrained  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.data.packed import open_blocks, read_meta  # noqa: E402
from tasks.dataset import build_dataset  # noqa: E402
from tasks.tokenize import train_tokenizer  # noqa: E402
from tasks.training import TrainSettings, fit  # noqa: E402
from tasks.training.loader import BlockLoader  # noqa: E402
from tasks.training.loss import LossHead, count_targets  # noqa: E402
from tasks.training.optim import build_optimizer  # noqa: E402

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


def bare_step_tokens_per_s(model_ref, dataset_ref, batch: int, steps: int, settings: TrainSettings) -> float:
    """Median tokens/s of a bare compiled training step of the engine's model on the engine's blocks."""
    device = torch.device("cpu")
    torch.use_deterministic_algorithms(True)
    plain = load_pretrained(model_ref.path).train()
    optimizer = build_optimizer(plain, settings, device)  # the engine's optimizer, from the same settings
    meta = read_meta(dataset_ref.path)
    eos = meta["eos_id"] if settings.document_mask else None
    step_fn = torch.compile(LossHead(plain, eos_id=eos), dynamic=False)
    loader = BlockLoader(
        open_blocks(dataset_ref.path, "train"), pad_id=meta["pad_id"], micro_batch_size=batch,
        accumulate_steps=1, seed=settings.seed,
    )  # fmt: skip
    params = [p for p in plain.parameters() if p.requires_grad]
    times = []
    for i in range(steps + 1):
        batches = loader.next_step().micro_batches
        start = time.perf_counter()
        bare_step(step_fn, params, optimizer, batches, settings.grad_clip)
        if i:  # the first step compiles
            times.append(count_targets([t for _, t in batches]) / (time.perf_counter() - start))
    return statistics.median(times)


def vs_bare(args: argparse.Namespace, model, dataset, work: Path) -> None:
    settings = TrainSettings(
        compile=True, dtype="bf16", micro_batch_size=args.batch, accumulate_steps=1, max_steps=args.steps,
        lr=1e-3, warmup_steps=2, device="cpu", document_mask=args.document_mask,
    )  # fmt: skip
    engine, bare, loads = [], [], []
    for r in range(args.rounds):
        ref = fit(model, dataset, settings, work / f"engine_{r}", progress=False)
        engine.append(ref.metrics["tokens_per_s"])
        bare.append(bare_step_tokens_per_s(model, dataset, args.batch, args.steps, settings))
        loads.append(round(os.getloadavg()[0], 2))
        print(
            f"round {r + 1}: engine {engine[-1]:,.0f} tokens/s, bare {bare[-1]:,.0f}, load {loads[-1]}",
            flush=True,
        )
    ratio = statistics.median(engine) / statistics.median(bare)
    result = {
        "preset": "demo", "batch": args.batch, "seq_len": args.seq_len, "steps_per_round": args.steps,
        "document_mask": args.document_mask, "engine_tokens_per_s": engine, "bare_tokens_per_s": bare,
        "ratio_engine_over_bare": round(ratio, 3), "load_average_1min": loads, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or "cpu",
    }  # fmt: skip
    out = args.out.with_name("train_engine_vs_bare.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nengine / bare compiled step: {ratio:.3f} (medians over {args.rounds} rounds); written {out}")


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
    parser.add_argument("--vs-bare", action="store_true", help="engine vs a bare compiled step, in rounds")
    parser.add_argument("--rounds", type=int, default=4, help="--vs-bare: rounds")
    parser.add_argument("--document-mask", action="store_true", help="--vs-bare: train with document_mask")
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
    if args.vs_bare:
        vs_bare(args, model, dataset, work)
        return

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
