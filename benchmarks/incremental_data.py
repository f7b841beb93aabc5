"""The data stage of a continued run on a corpus that grew: only the new files are tokenized.

    .venv/bin/python benchmarks/incremental_data.py [--workers 1 2] [--runners threads processes] [--grow 0.01]

The corpus is the interpreter's standard library (the default corpus) copied into a temporary directory,
less a held-back `--grow` share of its files; a tokenizer is trained on it once, untimed (a continued run
takes its parent's tokenizer). The data stage is `tasks.prepare_data.build_data` inside a Prefect flow: plan the
shards of files not yet tokenized, map `tokenize_shard` over them on the flow's task runner, pack. The flows
report to a Prefect server the script starts on a free local port (a process pool's workers must reach
the same API; with the ephemeral API each would start its own server).

Rows:
- cold: a fresh LLAMAFLOW_HOME, each task runner and worker count (tokenization throughput);
- grown: the first runner's home again after the held-back files were added (the incremental run), and
  its time as a share of the cold run's (the goal: at most 5%).
Prints a table and writes benchmarks/results/incremental_data.json with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import RESULTS_DIR, cpu_model, load_average, markdown_table, write_json  # noqa: E402

RESULT = RESULTS_DIR / "incremental_data.json"


def _task_runner(kind: str, workers: int) -> Any:
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    return (ThreadPoolTaskRunner if kind == "threads" else ProcessPoolTaskRunner)(max_workers=workers)


def data_stage(corpus: str, tokenizer_path: str, kind: str, workers: int, home: Path) -> dict[str, Any]:
    """One timed data stage in its own flow run, with `home` as LLAMAFLOW_HOME."""
    os.environ["LLAMAFLOW_HOME"] = str(home)
    from prefect import flow

    from flows.pretrain_config import PretrainConfig
    from tasks.dataset import plan_tokenization
    from tasks.prepare_data import build_data
    from tasks.tokenize import import_tokenizer

    @flow(name="incremental-data-bench", task_runner=_task_runner(kind, workers), log_prints=False)
    def stage() -> dict[str, Any]:
        tokenizer = import_tokenizer(tokenizer_path)
        config = PretrainConfig(preset="demo", data=corpus, tokenizer=tokenizer_path)
        planned = plan_tokenization(corpus, tokenizer, config.seq_len)
        started = time.perf_counter()
        dataset = build_data(config.data_settings(), tokenizer, config.seq_len, seed=config.seed)
        seconds = time.perf_counter() - started
        return {
            "files_tokenized": sum(len(s.parts) for s in planned),
            "bytes_tokenized": sum(s.bytes for s in planned),
            "shards": len(planned),
            "seconds": round(seconds, 3),
            "tokens": int(dataset.stats["tokens"]),
            "documents": int(dataset.stats["documents"]),
        }

    return stage()


@contextlib.contextmanager
def prefect_server(root: Path) -> Iterator[None]:
    """A local `prefect server` for the run, its URL exported before Prefect is imported here."""
    from flows.services.processes import free_port, start_detached, stop_tree, wait_http

    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = root / "prefect-server.log"
    pid = start_detached(
        [
            str(Path(sys.executable).with_name("prefect")),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--analytics-off",
        ],
        env,
        log,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", pid, log, "prefect server", 180)
        os.environ["PREFECT_HOME"] = env["PREFECT_HOME"]
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        yield
    finally:
        stop_tree(pid)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--runners", nargs="+", choices=["threads", "processes"], default=["threads", "processes"]
    )
    parser.add_argument("--grow", type=float, default=0.01, help="share of the corpus's files added later")
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from tasks.data.sources.stdlib import stdlib_files, stdlib_root
    from tasks.home import apply_embedded_defaults

    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="llamaflow-incremental-") as tmp, prefect_server(Path(tmp)):
        root = Path(tmp)
        os.environ["LLAMAFLOW_HOME"] = str(root / "tokenizer-home")
        apply_embedded_defaults()
        from tasks.tokenize import train_tokenizer

        files = stdlib_files()
        held = files[:: max(1, round(1 / args.grow))]  # spread over the tree, as new files would be
        corpus, later = root / "corpus", root / "later"
        for path in files:
            target = (later if path in held else corpus) / path.relative_to(stdlib_root())
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        tokenizer = train_tokenizer(str(corpus), args.vocab_size)

        rows = []
        for kind in args.runners:
            for workers in args.workers:
                home = root / f"home-{kind}-{workers}"
                row = data_stage(str(corpus), tokenizer.path, kind, workers, home)
                rows.append({"run": "cold", "runner": kind, "workers": workers, **row})
        first = rows[0]
        shutil.copytree(later, corpus, dirs_exist_ok=True)  # the corpus grew
        grown = data_stage(
            str(corpus), tokenizer.path, first["runner"], first["workers"], root / f"home-{first['runner']}-1"
        )
        rows.append({"run": "grown", "runner": first["runner"], "workers": first["workers"], **grown})

    for row in rows:
        row["tokens_per_s"] = round(row["tokens"] / row["seconds"]) if row["run"] == "cold" else None
    share = grown["seconds"] / first["seconds"]
    print(
        markdown_table(
            ["run", "runner", "workers", "files tokenized", "shards", "seconds", "tokens", "tokens/s"],
            [
                [
                    r["run"],
                    r["runner"],
                    r["workers"],
                    r["files_tokenized"],
                    r["shards"],
                    r["seconds"],
                    f"{r['tokens']:,}",
                    r["tokens_per_s"] or "",
                ]
                for r in rows
            ],
        )
    )
    print(
        f"\ngrown by {len(held)} of {len(files)} files ({args.grow:.0%}): {grown['seconds']:.2f} s = "
        f"{share:.1%} of the cold data stage ({first['seconds']:.2f} s); goal <= 5%"
    )
    write_json(
        RESULT,
        {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_1m": {"before": load_before, "after": load_average()},
            "files": len(files),
            "added_files": len(held),
            "grown_share_of_cold": round(share, 4),
            "rows": rows,
        },
    )
    print(f"load average before/after: {load_before} / {load_average()}; written to {RESULT}")


if __name__ == "__main__":
    main()
