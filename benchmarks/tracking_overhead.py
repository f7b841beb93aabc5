"""What logging training metrics to MLflow costs the training loop: `tasks.tracking.sink.MlflowSink` (a
sender thread of its own, one batch a second) against MLflow's asynchronous batched logging (what the sink
used before it had to ride out server outages), a hand-written synchronous buffer and plain synchronous
calls.

    .venv/bin/python benchmarks/tracking_overhead.py [--steps 200] [--step-ms 30] [--rounds 3]

A simulated training loop: each step is `--step-ms` of single-threaded torch matmuls (so background
logging threads compete for the CPU as they would with real training), then the step's 11 metrics (the
keys the engine logs) go to the sink. Variants, each on a fresh run, interleaved in rounds:
  * sync:         `MlflowClient.log_batch(synchronous=True)` per step
  * hand-buffer:  the previous MlflowSink: buffered, one synchronous `log_batch` every 50 steps or 10 s
  * async:        `log_batch(synchronous=False)` per step (MLflow's queue, batches sent by its threads)
  * async-merge:  the same with MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS=1 (MLflow merges queued batches)
  * sink:         `MlflowSink`, the one training uses
Stores: the embedded SQLite store and a local `mlflow server` (HTTP, SQLite backend). Reported per variant:
the loop's overhead per step over the bare loop (median over rounds), the time `close()` then waits for
the store, and whether every point arrived. Writes benchmarks/results/tracking_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from mlflow.entities import Metric  # noqa: E402

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, markdown_table, write_json  # noqa: E402

KEYS = (
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/tokens_per_s",
    "train/mfu",
    "train/step_time_s",
    "train/tokens_seen",
    "train/peak_mem_mb",
    "train/total_steps",
    "train/epoch",
    "train/recompiles",
)


class HandBufferedSink:
    """The replaced design (tasks/tracking/sink.py before issue 13.6): a buffer flushed synchronously with
    `log_batch` every `flush_every_steps` steps or `flush_every_s` seconds, and at close."""

    def __init__(self, client: Any, run_id: str, flush_every_steps: int = 50, flush_every_s: float = 10.0):
        self.client, self.run_id = client, run_id
        self.flush_every_steps, self.flush_every_s = flush_every_steps, flush_every_s
        self.buffer: list[Metric] = []
        self.steps = 0
        self.last = time.monotonic()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.steps += 1
        if self.steps >= self.flush_every_steps or time.monotonic() - self.last >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        for start in range(0, len(self.buffer), 1000):
            self.client.log_batch(self.run_id, metrics=self.buffer[start : start + 1000], synchronous=True)
        self.buffer, self.steps, self.last = [], 0, time.monotonic()

    def close(self) -> None:
        self.flush()


class SyncSink:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )

    def close(self) -> None:
        pass


class MlflowAsyncSink:
    """MLflow's asynchronous logging, one `log_batch(synchronous=False)` per step; close waits for all."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.operations: list[Any] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.operations.append(self.client.log_batch(self.run_id, metrics=entries, synchronous=False))

    def close(self) -> None:
        for operation in self.operations:
            operation.wait()


def _sink(uri: str, run_id: str) -> Any:
    from tasks.tracking.sink import MlflowSink

    return MlflowSink(run_id, uri=uri)


@contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _calibrated_work(step_ms: float) -> Callable[[], None]:
    """A function that keeps one core busy with torch matmuls for about `step_ms`."""
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(50):
        a @ a
    per_call = (time.perf_counter() - start) / 50
    calls = max(1, round(step_ms / 1000 / per_call))

    def work() -> None:
        for _ in range(calls):
            a @ a

    return work


def _loop(sink: Any, steps: int, work: Callable[[], None]) -> tuple[float, float]:
    """(loop seconds, close seconds)."""
    start = time.perf_counter()
    for step in range(1, steps + 1):
        work()
        if sink is not None:
            sink.log_metrics({k: float(step) * 0.001 + i for i, k in enumerate(KEYS)}, step)
    loop = time.perf_counter() - start
    start = time.perf_counter()
    if sink is not None:
        sink.close()
    return loop, time.perf_counter() - start


@contextmanager
def _server(root: Path) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port)]
        + ["--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'server.db'}"]
        + ["--artifacts-destination", str(root / "artifacts")],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tasks.tracking import store

    torch.set_num_threads(1)
    work = _calibrated_work(args.step_ms)
    variants: dict[str, Callable[[str, str], Any]] = {
        "sync": lambda uri, run_id: SyncSink(store.get_client(uri), run_id),
        "hand-buffer": lambda uri, run_id: HandBufferedSink(store.get_client(uri), run_id),
        "async": lambda uri, run_id: MlflowAsyncSink(store.get_client(uri), run_id),
        "async-merge": lambda uri, run_id: MlflowAsyncSink(store.get_client(uri), run_id),
        "sink": _sink,
    }
    results: dict[str, Any] = {"load_before": load_average(), "stores": {}}
    with tempfile.TemporaryDirectory(prefix="tracking-bench-") as tmp, _server(Path(tmp)) as server:
        stores = {"sqlite": f"sqlite:///{Path(tmp) / 'mlflow.db'}", "server": server}
        for store_name, uri in stores.items():
            bare, rows = [], {name: [] for name in variants}
            for _ in range(args.rounds):
                bare.append(_loop(None, args.steps, work)[0])
                for name, make in variants.items():
                    run_id = store.start_run("tracking-overhead", run_name=name, uri=uri)
                    merge = "1" if name == "async-merge" else None
                    with _env("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", merge):
                        loop, close = _loop(make(uri, run_id), args.steps, work)
                    arrived = len(store.get_client(uri).get_metric_history(run_id, "train/loss"))
                    rows[name].append({"loop_s": loop, "close_s": close, "arrived": arrived})
            base = statistics.median(bare)
            results["stores"][store_name] = {
                "bare_loop_s": bare,
                "variants": {
                    name: {
                        "overhead_ms_per_step": 1000
                        * (statistics.median(r["loop_s"] for r in runs) - base)
                        / args.steps,
                        "close_s": statistics.median(r["close_s"] for r in runs),
                        "all_points_arrived": all(r["arrived"] == args.steps for r in runs),
                        "rounds": runs,
                    }
                    for name, runs in rows.items()
                },
            }
    results["load_after"] = load_average()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=30.0, help="simulated compute per step")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    results = run(args)
    results.update({"args": vars(args), "machine": machine_info(torch.device("cpu"))})
    path = write_json(RESULTS_DIR / "tracking_overhead.json", results)
    for store_name, data in results["stores"].items():
        rows = [
            [name, f"{v['overhead_ms_per_step']:.2f}", f"{v['close_s']:.2f}", v["all_points_arrived"]]
            for name, v in data["variants"].items()
        ]
        print(
            f"\n{store_name}: {args.steps} steps × {len(KEYS)} metrics, {args.step_ms:.0f} ms simulated compute per step"
        )
        print(markdown_table(["variant", "overhead ms/step", "close s", "all points"], rows))
    print(f"\nload {results['load_before']} → {results['load_after']}; written {path}")


if __name__ == "__main__":
    main()
