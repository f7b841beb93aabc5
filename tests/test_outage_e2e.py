"""Training through a two-minute outage of both servers: a real Prefect server and a real MLflow server (SQLite
behind each) are stopped while a pretrain run trains, and started again on the same ports and databases two
minutes later. Training must not wait for them (its progress bar and metrics sinks warn and hold on), the
run must complete, and MLflow must hold every step, once."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.services.processes import free_port, wait_http
from prefect_server import PREFECT_CLI, start, stop_process_tree, tail, wait_healthy
from registry_world import corpus, stdlib_text
from tasks.training.metrics import METRICS_FILE, read_metrics

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
OUTAGE_S = 120.0
# Training runs this long (max_time_s), from about when the outage starts: it ends after the servers come
# back, so the run's later stages find them (Prefect's client retries its calls for about a minute more).
TRAINING_S = OUTAGE_S + 8
STALL_S = 20.0  # no new step for this long during the outage: training waited for a sink


@dataclass
class Servers:
    """Both servers' processes, restartable on the same ports and data."""

    root: Path
    prefect_port: int
    mlflow_port: int
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]]

    @property
    def prefect_api_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    @property
    def mlflow_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    def start(self) -> None:
        prefect_home = self.root / "prefect-server"
        prefect_home.mkdir(exist_ok=True)
        server_env = {
            **self.env,
            "PREFECT_HOME": str(prefect_home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        server_env.pop("PREFECT_API_URL", None)
        self.procs["prefect"] = start(
            [PREFECT_CLI, "server", "start", "--host", "127.0.0.1", "--port", str(self.prefect_port)],
            server_env,
            prefect_home,
            self.root / "prefect-server.log",
        )
        mlflow_cli = str(Path(sys.executable).with_name("mlflow"))
        self.procs["mlflow"] = start(
            [mlflow_cli, "server", "--host", "127.0.0.1", "--port", str(self.mlflow_port), "--workers", "1"]
            + ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
            + ["--artifacts-destination", str(self.root / "mlflow-artifacts")],
            self.env,
            self.root,
            self.root / "mlflow-server.log",
        )
        wait_healthy(self.prefect_api_url, self.procs["prefect"], self.root / "prefect-server.log", 240)
        wait_http(
            f"{self.mlflow_uri}/health",
            self.procs["mlflow"].pid,
            self.root / "mlflow-server.log",
            "mlflow",
            240,
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process_tree(proc, grace_s=5)


@pytest.fixture()
def servers(tmp_path: Path) -> Iterator[Servers]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    servers = Servers(tmp_path, free_port(), free_port(), env, {})
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


def _steps_done(run_dir: Path) -> int:
    path = run_dir / METRICS_FILE
    return path.read_text().count('"step"') if path.is_file() else 0


def test_training_goes_on_through_a_two_minute_outage_of_both_servers(
    servers: Servers, tmp_path: Path
) -> None:
    data = corpus(
        tmp_path,
        "corpus",
        stdlib_text(("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "bisect.py"), 8000),
    )
    run_dir = tmp_path / "run"
    # fp32: the engine times a bf16 matmul for its MFU figure, which takes minutes on one CPU thread.
    flags = ["--preset", "tiny", "--no-compile", "--dtype", "fp32", "--data", data, "--val-fraction", "0.2"]
    flags += ["--max-steps", "1000000", "--max-time-s", str(TRAINING_S), "--checkpoint-every", "0"]
    flags += ["--seq-len", "64", "--micro-batch-size", "4", "--accumulate-steps", "1", "--warmup-steps", "1"]
    flags += ["--eval-max-blocks", "4", "--num-samples", "0", "--checkpoint-dir", str(run_dir)]
    flags += ["--experiment", "outage-e2e", "--model-name", "outage-e2e"]
    env = {
        **servers.env,
        "PYTHONPATH": str(REPO),
        "PREFECT_API_URL": servers.prefect_api_url,
        "MLFLOW_TRACKING_URI": servers.mlflow_uri,
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "flow.log"
    flow = start([sys.executable, "-m", "flows.pretrain", *flags], env, REPO, log)
    try:
        deadline = time.monotonic() + 600
        while _steps_done(run_dir) < 2:
            assert flow.poll() is None and time.monotonic() < deadline, tail(log)
            time.sleep(0.2)

        servers.stop()
        went_down, samples = time.monotonic(), [(0.0, _steps_done(run_dir))]
        while (now := time.monotonic() - went_down) < OUTAGE_S:
            assert flow.poll() is None, f"the run ended during the outage:\n{tail(log)}"
            time.sleep(1.0)
            samples.append((now, _steps_done(run_dir)))
        servers.start()

        assert flow.wait(timeout=420) == 0, tail(log, 6000)
    finally:
        with contextlib.suppress(ProcessLookupError):
            stop_process_tree(flow, grace_s=5)
    longest, last_new = 0.0, samples[0]  # the longest stretch of the outage without a new step
    for sample in samples[1:]:
        if sample[1] != last_new[1]:
            last_new = sample
        longest = max(longest, sample[0] - last_new[0])
    assert longest < STALL_S, f"training made no step for {longest:.0f} s during the outage: {samples}"

    steps = sorted(read_metrics(run_dir))
    client = MlflowClient(servers.mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("outage-e2e").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/lr"):
        logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert logged == steps == list(range(1, steps[-1] + 1)), f"{key}: {len(logged)} of {len(steps)} steps"
    trained_during_outage = samples[-1][1] - samples[0][1]
    print(f"{trained_during_outage} steps during the {OUTAGE_S:.0f} s outage, {steps[-1]} in all")
