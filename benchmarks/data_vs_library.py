"""The data stage's tokens per second against the `tokenizers` library's own `encode_batch_fast` on the same
text and threads (issue 40, item 3): a ratio of the two measured side by side.

    .venv/bin/python benchmarks/data_vs_library.py [--data PATH] [--threads 2] [--pairs 4]

Each measurement runs in a fresh process, and the two sides alternate (library first in even pairs, the
data stage first in odd ones): on these hosts a long tokenizing process slows down as it runs (the library
alone lost 25% over four back-to-back passes in one process, none across fresh processes), so sides
measured one after the other in one process are not comparable. The library side encodes every document of
the corpus (both splits, read before the clock starts) in batches of 1,024 with RAYON_NUM_THREADS=threads;
the data stage is `build_dataset` from an empty llamaflow home (listing, hashing while reading, tokenizing
into the part cache in `threads` threads, packing). The tokenizer is trained once, before the pairs.
Writes benchmarks/results/data_vs_library.json: every pair, the median of the pairs' ratios, and the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "data_vs_library.json"


def _tokenizer(data: str | None, vocab_size: int, sample_bytes: int | None):  # -> TokenizerRef
    from tasks.tokenize import train_tokenizer

    return train_tokenizer(
        data, vocab_size, **({} if sample_bytes is None else {"sample_bytes": sample_bytes})
    )


def _library_side(data: str | None, tokenizer_path: str) -> dict[str, float]:
    from tokenizers import Tokenizer

    from tasks.data.corpus import resolve_corpus

    corpus = resolve_corpus(data)
    texts = [*corpus.val.texts(), *corpus.train.texts()]
    tokenizer = Tokenizer.from_file(tokenizer_path)
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(texts), 1024):
        for encoding in tokenizer.encode_batch_fast(texts[start : start + 1024], add_special_tokens=False):
            tokens += len(encoding.ids) + 1  # + EOS, as the data stage counts
    return {
        "seconds": time.perf_counter() - started,
        "tokens": tokens,
        "bytes": sum(len(t.encode()) for t in texts),
    }


def _stage_side(data: str | None, tokenizer, threads: int, home: Path) -> dict[str, float]:
    from tasks.dataset import build_dataset

    os.environ["LLAMAFLOW_HOME"] = str(home)  # cold: no cached parts
    started = time.perf_counter()
    ref = build_dataset(data, tokenizer, 256, num_proc=threads)
    return {"seconds": time.perf_counter() - started, "tokens": int(ref.stats["tokens"])}


def _side(args: argparse.Namespace) -> None:
    """One measurement, in this (fresh) process; prints its JSON."""
    tokenizer = _tokenizer(args.data, args.vocab_size, args.sample_bytes)  # cached: the parent trained it
    if args.side == "library":
        result = _library_side(args.data, tokenizer.path)
    else:
        result = _stage_side(args.data, tokenizer, args.threads, Path(args.stage_home))
    print(json.dumps(result))


def _run_side(args: argparse.Namespace, side: str, home: Path, stage_home: Path) -> dict[str, float]:
    command = [sys.executable, __file__, "--side", side, "--stage-home", str(stage_home), *args.passthrough]
    env = {
        **os.environ,
        "LLAMAFLOW_HOME": str(home),
        "RAYON_NUM_THREADS": str(args.threads),  # before tokenizers starts its pool
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {side} side failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default=None, help="corpus (default: the stdlib)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--sample-bytes", type=int, default=None, help="tokenizer training sample (default: the flow's)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--side", choices=("library", "stage"), help=argparse.SUPPRESS)
    parser.add_argument("--stage-home", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.passthrough = [
        *(["--data", args.data] if args.data else []),
        "--threads", str(args.threads),
        "--vocab-size", str(args.vocab_size),
        *(["--sample-bytes", str(args.sample_bytes)] if args.sample_bytes is not None else []),
    ]  # fmt: skip
    sys.path.insert(0, str(ROOT))
    if args.side:
        _side(args)
        return

    load_before = os.getloadavg()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="llamaflow-bench-") as tmp:
        home = Path(tmp) / "tokenizer-home"
        os.environ["LLAMAFLOW_HOME"] = str(home)
        tokenizer = _tokenizer(args.data, args.vocab_size, args.sample_bytes)
        for pair in range(args.pairs):
            order = ("library", "stage") if pair % 2 == 0 else ("stage", "library")
            sides = {side: _run_side(args, side, home, Path(tmp) / f"stage-{pair}") for side in order}
            library, stage = sides["library"], sides["stage"]
            if library["tokens"] != stage["tokens"]:
                raise SystemExit(
                    f"the sides counted different tokens: {library['tokens']} != {stage['tokens']}"
                )
            row = {
                "first": order[0],
                "library_tokens_per_s": round(library["tokens"] / library["seconds"]),
                "data_stage_tokens_per_s": round(stage["tokens"] / stage["seconds"]),
                "ratio": round(library["seconds"] / stage["seconds"], 3),
            }
            print(json.dumps(row), flush=True)
            pairs.append(row)
    result = {
        "command": "python benchmarks/data_vs_library.py " + " ".join(sys.argv[1:]),
        "corpus": args.data or "stdlib",
        "bytes": library["bytes"],
        "tokens": library["tokens"],
        "threads": args.threads,
        "tokenizer_sample_bytes": args.sample_bytes,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "cpu": os.cpu_count(),
        "load_before": [round(x, 1) for x in load_before],
        "load_after": [round(x, 1) for x in os.getloadavg()],
        "pairs": pairs,
        "median_ratio": round(statistics.median(p["ratio"] for p in pairs), 3),
    }
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
