"""Tokenization + packing throughput on the default corpus (the interpreter's standard library).

Every measurement starts cold: a fresh llamaflow home and datasets cache in a temporary directory,
so no cached tokenizer, Arrow file or packed dataset is reused.

    .venv/bin/python benchmarks/data_throughput.py [--num-proc 1 2] [--no-streaming] [--seq-len 256]

Rows: one per `--num-proc` value, plus one with `streaming=True` (single process: the datasets
IterableDataset map has no num_proc). Prints a markdown table and writes
benchmarks/results/data_throughput.json, with the load average, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "data_throughput.json"


def _fresh_environment(root: Path) -> None:
    os.environ["LLAMAFLOW_HOME"] = str(root / "home")
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf-datasets")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def measure(variants: list[tuple[int, bool]], seq_len: int, vocab_size: int) -> list[dict[str, object]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    rows = []
    for num_proc, streaming in variants:
        with tempfile.TemporaryDirectory(prefix="llamaflow-bench-") as tmp:
            _fresh_environment(Path(tmp))
            import datasets

            datasets.config.HF_DATASETS_CACHE = Path(tmp) / "hf-datasets"
            datasets.disable_progress_bars()
            from tasks.dataset import build_dataset
            from tasks.tokenize import train_tokenizer

            started = time.perf_counter()
            tokenizer = train_tokenizer(None, vocab_size)
            tokenizer_s = time.perf_counter() - started
            started = time.perf_counter()
            ref = build_dataset(None, tokenizer, seq_len, num_proc=num_proc, streaming=streaming)
            build_s = time.perf_counter() - started
            tokens = int(ref.stats["tokens"])
            rows.append(
                {
                    "num_proc": num_proc,
                    "streaming": streaming,
                    "seq_len": seq_len,
                    "vocab_size": vocab_size,
                    "documents": int(ref.stats["documents"]),
                    "tokens": tokens,
                    "bytes_per_token": float(ref.stats["bytes_per_token"]),
                    "train_blocks": ref.train_blocks,
                    "val_blocks": ref.val_blocks,
                    "tokenizer_s": round(tokenizer_s, 2),
                    "tokenize_pack_s": round(build_s, 2),
                    "tokens_per_s": round(tokens / build_s),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--no-streaming", action="store_true", help="skip the streaming row")
    args = parser.parse_args()
    variants = [(n, False) for n in args.num_proc] + ([] if args.no_streaming else [(1, True)])
    load_before = os.getloadavg()[0]
    rows = measure(variants, args.seq_len, args.vocab_size)
    print(
        "| num_proc | streaming | documents | tokens | bytes/token | tokenizer s | tokenize+pack s | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['num_proc']} | {r['streaming']} | {r['documents']} | {r['tokens']:,} | {r['bytes_per_token']} "
            f"| {r['tokenizer_s']} | {r['tokenize_pack_s']} | {r['tokens_per_s']:,} |"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "load_average_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
                "rows": rows,
            },
            indent=2,
        )
    )
    print(
        f"\n1-minute load average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs; written to {RESULTS}"
    )


if __name__ == "__main__":
    main()
