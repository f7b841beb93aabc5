"""Peak resident memory of the data stage per corpus shape and thread count (issue 50, item 3): one large
Parquet shard (Hub shards are 0.5-2 GB), a corpus of many small files, and an `hf:` dataset.

    .venv/bin/python benchmarks/data_memory.py --parquet-bytes 2147483648 --threads 2 8 [--small-bytes N] [--hf-bytes N]

The corpora are made in a temporary directory from this machine's source and documentation files
(`benchmarks/make_corpus.py`'s list): the Parquet shard in row groups of 1000 files, the small files copied
as they are, the `hf:` dataset as a local data folder of JSONL that `datasets` prepares into its cache. Each
(corpus, threads) is one child process in a fresh LLAMAFLOW_HOME and datasets cache: a tokenizer trained on
an 8 MB sample (untimed shape: the tokenizer is not what is measured), then `build_dataset(num_proc=threads)`.
The resident memory of the child and every process it starts is summed and sampled every 0.2 s (psutil).
Appends rows to benchmarks/results/data_memory.json with the command, the CPU flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import RESULTS_DIR, cpu_isa_flags, cpu_model, load_average  # noqa: E402
from benchmarks.make_corpus import _files  # noqa: E402

RESULT = RESULTS_DIR / "data_memory.json"
_CHILD = """
import json, sys, time
from tasks.dataset import build_dataset
from tasks.tokenize import train_tokenizer
data, threads = sys.argv[1], int(sys.argv[2])
tokenizer = train_tokenizer(data, 4096, sample_bytes=8 << 20)
started = time.perf_counter()
ref = build_dataset(data, tokenizer, 512, num_proc=threads)
print(json.dumps({"seconds": round(time.perf_counter() - started, 1), "tokens": ref.stats["tokens"]}))
"""


def _texts(limit: int):
    """(path, text) of this machine's UTF-8 source files, distinct, until `limit` bytes."""
    total = 0
    for path in _files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            yield path, text
            total += len(text.encode())
            if total >= limit:
                return


def make_parquet(out: Path, limit: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer, batch = None, []
    for _, text in _texts(limit):
        batch.append(text)
        if len(batch) == 1000:
            table = pa.table({"text": batch})
            writer = writer or pq.ParquetWriter(out / "shard.parquet", table.schema)
            writer.write_table(table)
            batch = []
    if batch:
        table = pa.table({"text": batch})
        writer = writer or pq.ParquetWriter(out / "shard.parquet", table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()
    return str(out / "shard.parquet")


def make_small_files(out: Path, limit: int) -> str:
    root = out / "small"
    for index, (path, text) in enumerate(_texts(limit)):
        target = (
            root
            / f"{index // 1000:04d}"
            / f"{index:07d}{path.suffix if path.suffix in ('.py', '.md', '.txt') else '.txt'}"
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return str(root)


def make_hf(out: Path, limit: int) -> str:
    root = out / "hfdata"
    root.mkdir()
    with open(root / "train.jsonl", "w", encoding="utf-8") as handle:
        for _, text in _texts(limit):
            handle.write(json.dumps({"text": text}) + "\n")
    return f"hf:{root}"


def measure(data: str, threads: int, work: Path) -> dict[str, object]:
    home = work / f"home-{threads}-{abs(hash(data))}"
    env = {
        **os.environ,
        "LLAMAFLOW_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "hf"),
        "PYTHONPATH": str(RESULTS_DIR.parents[1]),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, data, str(threads)], env=env, stdout=subprocess.PIPE, text=True
    )
    process, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            tree = [process, *process.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.2)
    out = child.stdout.read() if child.stdout else ""
    if child.returncode:
        raise SystemExit(f"{data} at {threads} threads failed ({child.returncode})")
    shutil.rmtree(home, ignore_errors=True)
    return {"peak_rss_gib": round(peak / 2**30, 3), **json.loads(out.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parquet-bytes", type=int, default=0)
    parser.add_argument("--small-bytes", type=int, default=0)
    parser.add_argument("--hf-bytes", type=int, default=0)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="data-memory-") as tmp:
        work = Path(tmp)
        corpora = [
            (kind, limit, make(work, limit))
            for kind, limit, make in (
                ("parquet", args.parquet_bytes, make_parquet),
                ("small-files", args.small_bytes, make_small_files),
                ("hf", args.hf_bytes, make_hf),
            )
            if limit
        ]
        for kind, limit, data in corpora:
            for threads in args.threads:
                load = load_average()
                row = {
                    "corpus": kind,
                    "text_bytes": limit,
                    "threads": threads,
                    **measure(data, threads, work),
                }
                row |= {"load_before": load, "load_after": load_average()}
                print(json.dumps(row), flush=True)
                rows.append(row)
    previous = json.loads(RESULT.read_text()) if RESULT.is_file() else []
    previous.append(
        {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "cpu": cpu_model(),
            "cpu_flags": cpu_isa_flags(),
            "cores": len(os.sched_getaffinity(0)),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": rows,
        }
    )
    RESULT.write_text(json.dumps(previous, indent=2) + "\n")


if __name__ == "__main__":
    main()
