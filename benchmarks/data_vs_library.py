"""The data stage's tokens per second against the `tokenizers` library's own `encode_batch_fast` on the same
text and threads, in one run (issue 40, item 3): a ratio, so a shared machine's load cancels out as far as it
can. Every data-stage measurement starts from an empty llamaflow home (nothing cached).

    .venv/bin/python benchmarks/data_vs_library.py [--data PATH] [--threads 2] [--repeats 2]

The library side encodes every document of the corpus (both splits) in batches of 1,024 with
RAYON_NUM_THREADS=threads; the data stage is `build_dataset` (listing, hashing while reading, tokenizing into
the part cache in `threads` threads, packing). Writes benchmarks/results/data_vs_library.json with the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "data_vs_library.json"


def _library_seconds(texts: list[str], tokenizer_path: str) -> tuple[float, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(texts), 1024):
        for encoding in tokenizer.encode_batch_fast(texts[start : start + 1024], add_special_tokens=False):
            tokens += len(encoding.ids) + 1  # + EOS, as the data stage counts
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default=None, help="corpus (default: the stdlib)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--sample-bytes", type=int, default=None, help="tokenizer training sample (default: the flow's)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before tokenizers starts its pool
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tasks.data.corpus import resolve_corpus
    from tasks.dataset import build_dataset
    from tasks.tokenize import train_tokenizer

    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="llamaflow-bench-") as tmp:
        os.environ["LLAMAFLOW_HOME"] = str(Path(tmp) / "tokenizer-home")
        sample = {} if args.sample_bytes is None else {"sample_bytes": args.sample_bytes}
        tokenizer = train_tokenizer(args.data, args.vocab_size, **sample)
        corpus = resolve_corpus(args.data)
        texts = [*corpus.val.texts(), *corpus.train.texts()]
        for repeat in range(args.repeats):
            library_s, library_tokens = _library_seconds(texts, tokenizer.path)
            os.environ["LLAMAFLOW_HOME"] = str(Path(tmp) / f"home-{repeat}")  # cold: no cached parts
            started = time.perf_counter()
            ref = build_dataset(args.data, tokenizer, 256, num_proc=args.threads)
            stage_s = time.perf_counter() - started
            assert int(ref.stats["tokens"]) == library_tokens, (ref.stats["tokens"], library_tokens)
            rows.append(
                {
                    "library_tokens_per_s": round(library_tokens / library_s),
                    "data_stage_tokens_per_s": round(library_tokens / stage_s),
                    "ratio": round(library_s / stage_s, 3),
                }
            )
    result = {
        "command": "python benchmarks/data_vs_library.py " + " ".join(sys.argv[1:]),
        "corpus": corpus.train.description,
        "bytes": sum(len(t.encode()) for t in texts),
        "tokens": library_tokens,
        "threads": args.threads,
        "tokenizer_sample_bytes": args.sample_bytes,
        "cpu": os.cpu_count(),
        "load_before": [round(x, 1) for x in load_before],
        "load_after": [round(x, 1) for x in os.getloadavg()],
        "rows": rows,
    }
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
