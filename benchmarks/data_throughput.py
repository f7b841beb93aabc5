"""Tokenization + packing throughput on the default corpus (the interpreter's standard library).

Every measurement starts cold: a fresh llamaflow home and datasets cache in a temporary directory,
so no cached tokenizer, Arrow file or packed dataset is reused.

    .venv/bin/python benchmarks/data_throughput.py [--num-proc 1 2] [--seq-len 256] [--vocab-size 8192]

Prints a markdown table and writes benchmarks/results/data_throughput.json.
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


def measure(num_procs: list[int], seq_len: int, vocab_size: int, streaming: bool) -> list[dict[str, object]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    rows = []
    for num_proc in num_procs:
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
            rows.append({
                "num_proc": num_proc, "streaming": streaming, "seq_len": seq_len, "vocab_size": vocab_size,
                "documents": int(ref.stats["documents"]), "tokens": tokens,
                "bytes_per_token": float(ref.stats["bytes_per_token"]),
                "train_blocks": ref.train_blocks, "val_blocks": ref.val_blocks,
                "tokenizer_s": round(tokenizer_s, 2), "tokenize_pack_s": round(build_s, 2),
                "tokens_per_s": round(tokens / build_s),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--streaming", action="store_true")
    args = parser.parse_args()
    rows = measure(args.num_proc, args.seq_len, args.vocab_size, args.streaming)
    print("| num_proc | streaming | documents | tokens | bytes/token | tokenizer s | tokenize+pack s | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_proc']} | {r['streaming']} | {r['documents']} | {r['tokens']:,} | {r['bytes_per_token']} "
              f"| {r['tokenizer_s']} | {r['tokenize_pack_s']} | {r['tokens_per_s']:,} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "python": platform.python_version(), "cpus": os.cpu_count(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                                   time.gmtime()),
        "rows": rows,
    }, indent=2))
    print(f"\nwritten to {RESULTS}")


if __name__ == "__main__":
    main()
