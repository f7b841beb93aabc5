"""Multi-node training through the Prefect pool across separate hosts (tests/hosts.py): the Prefect server,
the MLflow store and the pretrain run on the head, one process worker per host (`--limit 1`), the shared
directory holding LLAMAFLOW_HOME and the MLflow store. The first worker to poll takes node 0's flow run (the
first created), so a test decides which host is node 0 by the order it starts the workers in."""

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
from tasks.training.faults import ENV_VAR as FAULTS_ENV
from tasks.training.metrics import METRICS_FILE, read_metrics

REPO = Path(__file__).resolve().parents[1]
PORT = 4200  # inside the head's own network namespace: nothing else listens there
HEAD_LATE_S = 140  # node 0's torchrun starts this late; see the test
NODE_LATE_S = 90  # in the retry, node1's worker starts this long after node 0 opened the rendezvous
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
        self.logs[name] = self.root / f"worker-{name}-{len(list(self.root.glob('worker-*.log')))}.log"
        self.workers[name] = self.hosts[name].popen(
            [PREFECT_CLI, "worker", "start", "--pool", "gpu-pool", "--limit", "1"],
            env={**self.env, **env},
            cwd=self.hosts.local,
            stdout=self.logs[name].open("wb"),
            stderr=subprocess.STDOUT,
        )

    def restart_worker(self, name: str, **env: str) -> None:
        stop_process_tree(self.workers[name])
        self.start_worker(name, **env)

    def start_pretrain(self, name: str, **overrides: object) -> tuple[subprocess.Popen, Path]:
        """The pretrain run on the head, in the background; its output goes to the returned log."""
        config = {**CONFIG, "model_name": name, **overrides}
        out = self.root / f"pretrain-{name}.log"
        process = self.hosts["head"].popen(
            [sys.executable, "-c", PRETRAIN, json.dumps(config)],
            env=self.env,
            cwd=self.hosts.local,
            stdout=out.open("wb"),
            stderr=subprocess.STDOUT,
        )
        return process, out

    def wait_in_log(self, name: str, text: str, pretrain: subprocess.Popen, out: Path, seen: int = 0) -> None:
        """Until worker `name`'s log shows `text` past byte `seen`; fails if the pretrain run ends first."""
        deadline = time.monotonic() + 300
        while text not in self.logs[name].read_text(errors="replace")[seen:]:
            assert pretrain.poll() is None and time.monotonic() < deadline, (
                f"{tail(out)}\n{self.worker_logs()}"
            )
            time.sleep(0.5)

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


def _result(pretrain: subprocess.Popen, out: Path, pool: PoolHosts) -> dict:
    assert pretrain.wait(timeout=900) == 0, f"{tail(out)}\n{pool.worker_logs()}"
    return json.loads(out.read_text().split("RESULT ", 1)[1].splitlines()[0])


def _history(pool: PoolHosts, run_id: str) -> list[int]:
    history = MlflowClient(pool.env["MLFLOW_TRACKING_URI"]).get_metric_history(run_id, "train/loss")
    return sorted(m.step for m in history)


@pytest.mark.e2e
def test_a_late_head_and_a_host_killed_mid_run_at_an_explicit_endpoint(pool: PoolHosts) -> None:
    """One 2-host run through the three things a real cluster does to it.

    The endpoint: node 0 runs on the head at the rdzv_endpoint the config gives (the head's address, a port of
    the config's choosing, not one node 0 picks), on the first try and on the retry.

    A late head: node 0's first torchrun starts HEAD_LATE_S late (a fault stands in for a head still busy), so
    node 1's torchrun on node1, a c10d client, waits that long for the head's store. With torch's default
    read_timeout (60 s) the client's connect gives up after 60 s plus one jittered retry (torch 2.13: a 74 s
    wait survived, the retry came 50 s late; a 122 s one failed, backoffs are capped near 64 s), so the wait
    is kept over 130 s.

    A host killed: node1's checkpoint writes pause 8 s halfway; while it writes the checkpoint of step 4, every
    process on node1 is SIGKILLed (its worker, the flow run, torchrun, the rank). node1's flow run, which
    nothing can end any more, is marked Crashed after the group's bounded wait; the group's retry (node1's
    worker back NODE_LATE_S after node 0 opened the rendezvous: a late host) resumes from step 2, the newest valid
    checkpoint; the run completes and registers, and MLflow holds each step once."""
    started = time.monotonic()
    endpoint = f"{pool.hosts['head'].address}:29517"
    stop_process_tree(pool.workers["node1"])
    pool.restart_worker("head", **{FAULTS_ENV: f"torchrun_delay_s={HEAD_LATE_S}"})
    name = f"hosts-{uuid.uuid4().hex[:8]}"
    run_dir = pool.hosts.shared / "home" / "killed" / name
    seen = pool.logs["head"].stat().st_size
    pretrain, out = pool.start_pretrain(
        name,
        rdzv_endpoint=endpoint,
        max_steps=6,
        train_retries=1,
        checkpoint_dir=str(run_dir),
        stop_grace_s=10,
    )
    pool.wait_in_log("head", "submitting flow run", pretrain, out, seen)  # node 0's, the first created
    pool.start_worker("node1", **{FAULTS_ENV: "checkpoint_delay_s=8"})  # so it takes node 1's
    opened = f"node 0: rendezvous at {endpoint} for 2 nodes"
    pool.wait_in_log("head", opened, pretrain, out, seen)
    head_torchrun = time.monotonic() + HEAD_LATE_S
    pool.wait_in_log("node1", f"node 1: joining node 0's rendezvous at {endpoint}", pretrain, out)
    # node 1's torchrun starts at once and waits for the store until the head's starts.
    assert head_torchrun - time.monotonic() > 130, "node1 joined too late to outwait torch's default"

    deadline = time.monotonic() + 600
    while 4 not in read_metrics(run_dir):
        assert pretrain.poll() is None and time.monotonic() < deadline, f"{tail(out)}\n{pool.worker_logs()}"
        time.sleep(0.2)
    pool.hosts["node1"].kill_all()  # the machine is gone, in the middle of writing the checkpoint of step 4
    retry = pool.logs["head"].stat().st_size
    pool.wait_in_log("head", opened, pretrain, out, retry)
    time.sleep(NODE_LATE_S)
    pool.start_worker("node1")  # back, NODE_LATE_S after the head opened the rendezvous (rdzv_timeout_s 180)

    result = _result(pretrain, out, pool)
    assert result["step"] == 6 and result["version"] == "1", result
    output = out.read_text()
    assert "starting the 2 nodes again (retry 1 of 1)" in output, tail(out)
    assert "did not stop within 70 s (host or worker gone?): marked Crashed" in output, tail(out)
    assert "node 1: training ended at step 6" in tail(pool.logs["node1"], 200_000), pool.worker_logs()
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines if '"event"' in line]
    assert [e["step"] for e in events if "resumed_from" in e] == [2], events
    assert _history(pool, result["run_id"]) == [1, 2, 3, 4, 5, 6]  # complete, each step once
    print(f"late head, host killed, resumed: {time.monotonic() - started:.0f} s")


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
