"""Multi-node training through the Prefect pool across separate hosts (tests/hosts.py): the Prefect server,
the MLflow store and the pretrain run on the head, one process worker per host (`--limit 1`), the shared
directory holding LLAMAFLOW_HOME and the MLflow store. Node 0 publishes its own address (the head's, on the
route to the Prefect API) and hosts the store; node 1 runs on the other host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hosts import Cluster, cluster_for_test
from prefect_server import PREFECT_CLI, TINY_RUN, shared_checkout_prefect_file, stop_process_tree, tail
from stdlib_corpus import STDLIB

REPO = Path(__file__).resolve().parents[1]
PORT = 4200  # inside the head's own network namespace: nothing else listens there
# The pretrain run, on the head (the test's own process is on none of the hosts).
PRETRAIN = """
import json, sys
from flows.pretrain import pretrain
from flows.pretrain_config import PretrainConfig
result = pretrain(PretrainConfig.model_validate_json(sys.argv[1]))
print("RESULT", json.dumps({"step": result.checkpoint.step, "version": result.registered.version,
      "run_id": result.run_id, "run_dir": str(result.checkpoint.run_dir)}), flush=True)
"""
HEALTHY = """
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(sys.argv[1] + "/health", timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(1)
"""


def _env(hosts: Cluster, api_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    return {
        **env,
        "PYTHONPATH": str(REPO),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "LLAMAFLOW_HOME": str(hosts.shared / "home"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{hosts.shared / 'mlflow.db'}",
    }


def _prefect(hosts: Cluster, args: list[str], env: dict[str, str]) -> None:
    done = hosts["head"].run([PREFECT_CLI, *args], env=env, cwd=REPO, timeout=300)
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{(done.stdout + done.stderr)[-3000:]}"


@dataclass
class PoolHosts:
    hosts: Cluster
    root: Path
    env: dict[str, str]  # a client's: the API on the head, the shared LLAMAFLOW_HOME and MLflow store
    workers: dict[str, subprocess.Popen]
    logs: dict[str, Path]

    def start_worker(self, name: str, **env: str) -> None:
        self.logs[name] = self.root / f"worker-{name}-{len(self.workers)}.log"
        self.workers[name] = self.hosts[name].popen(
            [PREFECT_CLI, "worker", "start", "--pool", "gpu-pool", "--limit", "1"],
            env={**self.env, **env},
            cwd=self.hosts.local,
            stdout=self.logs[name].open("wb"),
            stderr=subprocess.STDOUT,
        )

    def pretrain(self, **overrides: object) -> tuple[int, str]:
        config = {**CONFIG, "model_name": f"hosts-{uuid.uuid4().hex[:8]}", **overrides}
        done = self.hosts["head"].run(
            [sys.executable, "-c", PRETRAIN, json.dumps(config)],
            env=self.env,
            cwd=self.hosts.local,
            timeout=900,
        )
        return done.returncode, done.stdout + done.stderr

    def worker_logs(self) -> str:
        return "\n".join(f"--- worker {log.name}\n{tail(log, 5000)}" for log in self.logs.values())


CONFIG = {
    **TINY_RUN,
    "max_steps": 4,
    "checkpoint_every": 2,
    "dtype": "fp32",
    "data": str(STDLIB / "email" / "*.py"),
    "val_data": str(STDLIB / "json" / "*.py"),
    "placement": "deployment",
    "nnodes": 2,
    "nproc_per_node": 1,
    "train_retries": 0,
    "rdzv_timeout_s": 180,
    "stop_grace_s": 20,
    "process_group_timeout_min": 3,
}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolHosts]:
    root = tmp_path_factory.mktemp("pool-hosts")
    with cluster_for_test(root, ["head", "node1"]) as hosts:
        head = hosts["head"]
        api_url = f"http://{head.address}:{PORT}/api"
        env = _env(hosts, api_url)
        server_log = root / "server.log"
        server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
        head.popen(
            [PREFECT_CLI, "server", "start", "--host", head.address, "--port", str(PORT), "--analytics-off"],
            env={**server_env, "PREFECT_HOME": str(hosts.local / "prefect-server")},
            stdout=server_log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        healthy = head.run([sys.executable, "-c", HEALTHY, api_url, "240"], timeout=300)
        assert healthy.returncode == 0, f"the Prefect server on the head never answered:\n{tail(server_log)}"
        client_env = {**env, "PREFECT_HOME": str(hosts.local / "prefect")}
        _prefect(hosts, ["work-pool", "create", "gpu-pool", "--type", "process"], client_env)
        deployments = shared_checkout_prefect_file(root)
        _prefect(
            hosts, ["--no-prompt", "deploy", "--name", "gpu", "--prefect-file", str(deployments)], client_env
        )
        pool = PoolHosts(hosts, root, client_env, {}, {})
        for name in ("head", "node1"):
            pool.start_worker(name)
        yield pool


@pytest.mark.e2e
def test_two_hosts_train_through_the_pool_and_register(pool: PoolHosts) -> None:
    started = time.monotonic()
    returncode, output = pool.pretrain()
    assert returncode == 0, f"{output[-5000:]}\n{pool.worker_logs()}"
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert result["step"] == 4 and result["version"] == "1", result
    # One node run on each host (which one where is the pool's choice).
    logs = sorted(tail(log, 200_000) for log in pool.logs.values())
    assert any("node 0: rendezvous at 198.18.0." in log for log in logs), pool.worker_logs()
    assert any("node 1: training ended at step 4" in log for log in logs), pool.worker_logs()
    print(f"2-host pool run: {time.monotonic() - started:.0f} s")
    uri = pool.env["MLFLOW_TRACKING_URI"]
    steps = [m.step for m in MlflowClient(uri).get_metric_history(result["run_id"], "train/loss")]
    assert sorted(steps) == [1, 2, 3, 4]


@pytest.mark.e2e
def test_a_host_whose_checkpoint_directory_is_node_local_is_refused_before_any_download(
    pool: PoolHosts,
) -> None:
    """node1's worker keeps LLAMAFLOW_HOME on its node-local disk and takes node 1's run (its worker starts
    after the head's took node 0's, the first created): node 1 is refused at once, naming the fix, before it
    looks for (or would fetch) the model and data it cannot see."""
    stop_process_tree(pool.workers["node1"])
    head_log = pool.logs["head"]
    seen = head_log.stat().st_size
    config = {**CONFIG, "model_name": f"hosts-{uuid.uuid4().hex[:8]}", "rdzv_timeout_s": 60}
    out = pool.root / "pretrain-node-local.log"
    pretrain = pool.hosts["head"].popen(
        [sys.executable, "-c", PRETRAIN, json.dumps(config)],
        env=pool.env,
        cwd=pool.hosts.local,
        stdout=out.open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while "node 0: rendezvous at" not in head_log.read_text(errors="replace")[seen:]:
        assert pretrain.poll() is None and time.monotonic() < deadline, f"{tail(out)}\n{pool.worker_logs()}"
        time.sleep(1)
    pool.start_worker("node1", LLAMAFLOW_HOME=str(pool.hosts.local / "home"))
    assert pretrain.wait(timeout=600) != 0, tail(out)
    node1 = tail(pool.logs["node1"], 200_000)
    assert "node 1: checkpoint directory" in node1 and "is not shared with node 0" in node1, node1[-5000:]
    assert "storage every node mounts at the same path" in node1
    assert "not found on this worker" not in node1 and "fetched" not in node1
