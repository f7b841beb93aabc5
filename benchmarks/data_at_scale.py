"""The whole flow on a large corpus (issue 40, item 3): peak resident memory of the flow's process tree, wall
time, and a second run on the unchanged corpus that must tokenize nothing.

    .venv/bin/python benchmarks/make_corpus.py /tmp/c1g --bytes 1073741824
    .venv/bin/python benchmarks/data_at_scale.py --data /tmp/c1g --label 1GiB [--runs 2]

Each run is `python -m flows.pretrain --preset tiny --max-steps 1 --data DATA` in one fresh temporary home
(MLflow, Prefect and the caches all under it), the second in the same home. The resident memory of the flow
and every process it starts is summed and sampled every 0.2 s (psutil); the flow's own log says how many
files it tokenized. Appends a row per run to benchmarks/results/data_at_scale.json with the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "data_at_scale.json"
_PLAN = re.compile(r"tokenizing (\d+) of (\d+) files \(([\d,]+) bytes\)")
_DATASET = re.compile(r"dataset \w+: (\d+) documents, ([\d,]+) tokens.*?, ([\d.]+) s")


def _tree_rss(process: psutil.Process) -> dict[str, int]:
    """Resident bytes of the process and each of its descendants, by "pid name"."""
    rss = {}
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            command = p.cmdline()
            name = " ".join(a for a in command[1:4] if not a.startswith("/")) or p.name()
            rss[f"{p.pid} {name[:60]}"] = p.memory_info().rss
    return rss


def _stage_lines(text: str) -> list[str]:
    """The log lines that time the stages: each task's end (of the mapped shards only the first and last)."""
    lines = [line for line in text.splitlines() if "Finished in state" in line or "tokenizer " in line]
    shards = [i for i, line in enumerate(lines) if "tokenize_shard" in line]
    middle = set(shards[1:-1])
    return [line for i, line in enumerate(lines) if i not in middle]


def run_flow(data: str, home: Path, extra: list[str]) -> dict[str, object]:
    env = {
        **os.environ,
        "LLAMAFLOW_HOME": str(home / "llamaflow"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "PREFECT_HOME": str(home / "prefect"),
        "PYTHONPATH": str(ROOT),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",  # a loaded host starts it slowly
    }
    command = [sys.executable, "-m", "flows.pretrain", "--preset", "tiny", "--max-steps", "1", "--data", data]
    started = time.perf_counter()
    log = home / f"run-{time.time_ns()}.log"
    with log.open("w") as out:
        child = subprocess.Popen([*command, *extra], cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT)
        process = psutil.Process(child.pid)
        peak, at, breakdown = 0, 0.0, {}
        while child.poll() is None:
            rss = _tree_rss(process)
            if sum(rss.values()) > peak:
                peak, at, breakdown = sum(rss.values()), time.perf_counter() - started, rss
            time.sleep(0.2)
    wall = time.perf_counter() - started
    text = log.read_text(errors="replace")
    if child.returncode != 0:
        raise SystemExit(f"flow failed ({child.returncode}):\n{text[-4000:]}")
    plan = _PLAN.search(text)
    dataset = _DATASET.search(text)
    return {
        "wall_s": round(wall, 1),
        "peak_rss_gib": round(peak / 2**30, 3),
        "peak_at_s": round(at, 1),  # since the flow started: find its stage in the log lines' times
        "peak_by_process_gib": {name: round(b / 2**30, 3) for name, b in breakdown.items() if b > 2**26},
        "started_at": time.strftime("%H:%M:%S", time.localtime(time.time() - wall)),
        "files_tokenized": int(plan.group(1)) if plan else 0,
        "files": int(plan.group(2)) if plan else None,
        "bytes_tokenized": int(plan.group(3).replace(",", "")) if plan else 0,
        "dataset_tokens": int(dataset.group(2).replace(",", "")) if dataset else None,
        "dataset_build_s": float(dataset.group(3)) if dataset else None,
        "dataset_cached": "cached at" in text and not dataset,
        "log_lines": _stage_lines(text),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="more flags for the flow")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="llamaflow-scale-") as tmp:
        for run in range(args.runs):
            load = [round(x, 1) for x in os.getloadavg()]
            row = {
                "label": args.label,
                "run": run + 1,
                "load_before": load,
                **run_flow(args.data, Path(tmp), args.extra),
            }
            row["load_after"] = [round(x, 1) for x in os.getloadavg()]
            print(json.dumps(row), flush=True)
            rows.append(row)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    previous["rows"] = [*previous["rows"], *rows]
    previous["cpu"] = f"{os.cpu_count()} cores"
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(previous, indent=2) + "\n")


if __name__ == "__main__":
    main()
