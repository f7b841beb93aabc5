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
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hosts import Cluster, cluster_for_test
from prefect_server import PREFECT_CLI, TINY_RUN, shared_checkout_prefect_file, tail

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(json.__file__).resolve().parents[1]
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


@pytest.mark.e2e
def test_two_hosts_train_through_the_pool_and_register(tmp_path: Path) -> None:
    with cluster_for_test(tmp_path, ["head", "node1"]) as hosts:
        head = hosts["head"]
        api_url = f"http://{head.address}:{PORT}/api"
        env = _env(hosts, api_url)
        server_log = tmp_path / "server.log"
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
        deployments = shared_checkout_prefect_file(tmp_path)
        _prefect(
            hosts, ["--no-prompt", "deploy", "--name", "gpu", "--prefect-file", str(deployments)], client_env
        )
        logs = {}
        for name in ("head", "node1"):
            logs[name] = tmp_path / f"worker-{name}.log"
            hosts[name].popen(
                [PREFECT_CLI, "worker", "start", "--pool", "gpu-pool", "--limit", "1"],
                env=client_env,
                cwd=hosts.local,
                stdout=logs[name].open("wb"),
                stderr=subprocess.STDOUT,
            )
        config = {
            **TINY_RUN,
            "max_steps": 4,
            "checkpoint_every": 2,
            "dtype": "fp32",
            "data": str(STDLIB / "email" / "*.py"),
            "val_data": str(STDLIB / "json" / "*.py"),
            "model_name": f"hosts-{uuid.uuid4().hex[:8]}",
            "placement": "deployment",
            "nnodes": 2,
            "nproc_per_node": 1,
            "train_retries": 0,
            "rdzv_timeout_s": 180,
            "stop_grace_s": 20,
            "process_group_timeout_min": 3,
        }
        started = time.monotonic()
        done = head.run(
            [sys.executable, "-c", PRETRAIN, json.dumps(config)], env=client_env, cwd=hosts.local, timeout=900
        )
        output = done.stdout + done.stderr
        where = "\n".join(f"--- worker on {n}\n{tail(log, 5000)}" for n, log in logs.items())
        assert done.returncode == 0, f"{output[-5000:]}\n{where}"
        result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
        assert result["step"] == 4 and result["version"] == "1", result
        # Node 1 trained on the other host: its worker ran the node-1 flow run.
        assert "node 1: training ended at step 4" in tail(logs["node1"], 200_000), where
        print(f"2-host pool run: {time.monotonic() - started:.0f} s")

        uri = env["MLFLOW_TRACKING_URI"]
        steps = [m.step for m in MlflowClient(uri).get_metric_history(result["run_id"], "train/loss")]
        assert sorted(steps) == [1, 2, 3, 4]
