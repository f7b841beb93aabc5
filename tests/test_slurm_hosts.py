"""Pretraining as a SLURM job on a 2-node cluster built on namespaced hosts (tests/slurm_cluster.py on
tests/hosts.py): the command docs/production.md shows, run as it is shown (the harness has no GPUs: the one
change is `--gpus-per-node 0`, CPU ranks). MLflow is a SQLite store on the shared directory: only node 0
talks to MLflow, so no two hosts write it, and no MLflow server has to start (seconds the suite does not
spend). Prefect is a server on the head host, started while SLURM starts: node 0's flow of each job would
otherwise start and stop a temporary one (~20 s each on this machine)."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from hosts import Cluster, cluster_for_test
from prefect_server import PREFECT_CLI, TINY_RUN, tail
from slurm_cluster import KILL_WAIT_S, Slurm, slurm_cluster
from stdlib_corpus import STDLIB
from tasks.training.checkpoint import load_trainer_state

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "production.md"
PREFECT_PORT = 4200
STEPS = 40  # the first job is cancelled after its first checkpoint (step 5), a few steps later


def doc_command() -> list[str]:
    """The command of docs/production.md's SLURM section, as shown there."""
    section = DOC.read_text().split("### SLURM (`python -m flows.slurm`)", 1)[1]
    block = re.search(r"```bash\n(.*?)\n```", section, re.S)
    assert block is not None, "docs/production.md's SLURM section lost its command"
    return shlex.split(block.group(1))


def _config(hosts: Cluster, name: str) -> dict[str, object]:
    return {
        **TINY_RUN,
        "model_name": name,
        "max_steps": STEPS,
        "checkpoint_every": 5,
        "dtype": "fp32",
        "data": str(STDLIB / "email" / "*.py"),
        "val_data": str(STDLIB / "json" / "*.py"),
        "nproc_per_node": 1,
        "checkpoint_dir": str(hosts.shared / "run"),
        "rdzv_timeout_s": 180,
        "stop_grace_s": KILL_WAIT_S - 2,  # scancel's SIGKILL comes after the stop checkpoint
        "process_group_timeout_min": 3,
    }


def _submit(slurm: Slurm, command: list[str], env: dict[str, str], cwd: Path) -> str:
    done = slurm.hosts["head"].run(command, env=env, cwd=cwd, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    match = re.search(r"submitted job (\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    return match.group(1)


def _job_log(run: Path, job: str) -> str:
    path = run / f"slurm-{job}.out"
    return path.read_text(errors="replace")[-6000:] if path.exists() else f"(no {path})"


def _checkpoints(run: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in run.glob("step_*") if (p / "manifest.json").exists())


@pytest.fixture()
def short_root() -> Iterator[Path]:
    """The hosts' root: SLURM's step sockets are Unix sockets in it (at most 108 bytes of path), too long
    under pytest's tmp_path (longer still under xdist: .../popen-gw1/test_a_slurm_job_cancelled_mid0/)."""
    root = Path(tempfile.mkdtemp(prefix="llf-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.e2e
def test_a_slurm_job_cancelled_mid_run_is_resubmitted_resumes_and_registers(
    tmp_path: Path, short_root: Path
) -> None:
    command = doc_command()
    assert command[:3] == ["python", "-m", "flows.slurm"] and "--submit" in command, command
    command[0] = sys.executable
    command[command.index("--gpus-per-node") + 1] = "0"
    name = f"slurm-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with cluster_for_test(short_root, ["head", "node1"]) as hosts:
        api_url = _start_prefect_server(hosts, tmp_path / "prefect-server.log")  # while SLURM starts
        with slurm_cluster(hosts, partition_up=False) as slurm:
            ready = functools.partial(_wait_healthy, hosts, api_url, tmp_path / "prefect-server.log")
            run, log, cancelled_at = _cancel_and_resubmit(hosts, slurm, command, name, api_url, ready)
            print(f"SLURM cancel + resubmission: {time.monotonic() - started:.0f} s")
    _check_outcome(hosts, run, log, cancelled_at, name)


def _start_prefect_server(hosts: Cluster, log: Path) -> str:
    """A Prefect server on the head host (node 0 of the job runs there and talks to it): one server for both
    jobs instead of a temporary one each. The hosts' teardown stops it."""
    head = hosts["head"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    head.popen(
        [PREFECT_CLI, "server", "start", "--host", head.address, "--port", str(PREFECT_PORT), "--analytics-off",
         "--no-services", "--no-ui"],  # flow runs started by hand need neither
        env={**env, "PREFECT_HOME": str(hosts.local / "prefect-server")},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    return f"http://{head.address}:{PREFECT_PORT}/api"


def _wait_healthy(hosts: Cluster, api_url: str, log: Path) -> None:
    probe = (
        "import sys, time, urllib.request\n"
        "for _ in range(600):\n"
        "    try:\n"
        "        urllib.request.urlopen(sys.argv[1] + '/health', timeout=2).close(); sys.exit(0)\n"
        "    except OSError:\n"
        "        time.sleep(0.3)\n"
        "sys.exit(1)\n"
    )
    done = hosts["head"].run([sys.executable, "-c", probe, api_url], timeout=300)
    assert done.returncode == 0, f"the Prefect server on the head never answered:\n{tail(log)}"


def _cancel_and_resubmit(
    hosts: Cluster,
    slurm: Slurm,
    command: list[str],
    name: str,
    api_url: str,
    server_ready: Callable[[], None],
) -> tuple[Path, str, int]:
    work = hosts.shared / "work"
    work.mkdir()
    (work / command[3]).write_text(yaml.safe_dump(_config(hosts, name)))
    env = {
        **{k: v for k, v in slurm.env.items() if not k.startswith(("PREFECT_", "MLFLOW_"))},
        "PYTHONPATH": str(REPO),
        "LLAMAFLOW_HOME": str(hosts.shared / "home"),
        "MLFLOW_TRACKING_URI": _mlflow_uri(hosts),
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(hosts.local / "prefect"),
    }
    run = hosts.shared / "run"
    # A stop grace this cluster's KillWait (read with scontrol) cannot hold is refused before sbatch.
    (work / "long-grace.yaml").write_text(
        yaml.safe_dump({**_config(hosts, name), "stop_grace_s": KILL_WAIT_S})
    )
    long_grace = [*command[:3], "long-grace.yaml", *command[4:]]
    done = slurm.hosts["head"].run(long_grace, env=env, cwd=work, timeout=300)
    assert (
        done.returncode == 2 and f"does not fit in this cluster's KillWait={KILL_WAIT_S} s" in done.stderr
    ), done.stdout + done.stderr
    started = time.monotonic()
    first = _submit(slurm, command, env, work)  # queued while the Prefect server starts
    server_ready()
    slurm.open_partition()
    deadline = time.monotonic() + 400
    while not _checkpoints(run):
        state = slurm.job_state(first)
        assert state in {"PENDING", "RUNNING"} and time.monotonic() < deadline, (state, _job_log(run, first))
        time.sleep(0.5)
    print(f"first checkpoint {time.monotonic() - started:.0f} s after the first submission")
    done = slurm.client(["scancel", first])
    assert done.returncode == 0, done.stderr
    assert slurm.wait(first, {"CANCELLED"}, 60) == "CANCELLED"
    cancelled_at = max(_checkpoints(run))
    assert cancelled_at < STEPS, _job_log(run, first)
    # scancel's SIGTERM reaches each rank twice (from SLURM and from torchrun): still one stop request
    summary = load_trainer_state(run / f"step_{cancelled_at:06d}")["summary"]
    assert summary["stopped_early"] == 1.0, (summary, _job_log(run, first))
    print(f"cancelled {time.monotonic() - started:.0f} s after the first submission")

    second = _submit(slurm, command, env, work)
    requeued_at = _requeue_after_a_checkpoint(slurm, run, second, cancelled_at)
    state = slurm.wait(second, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 600)
    log = _job_log(run, second)
    assert state == "COMPLETED", log
    # the second incarnation of the same job id was a rendezvous of its own, and resumed
    assert "Restarts=1" in slurm.client(["scontrol", "-o", "show", "job", second]).stdout.split()
    assert _resumed_steps(run)[-1] == requeued_at, log
    return run, log, cancelled_at


def _requeue_after_a_checkpoint(slurm: Slurm, run: Path, job: str, after: int) -> int:
    """`scontrol requeue` once the job wrote a checkpoint past `after`: SLURM stops every node (SIGTERM, then
    SIGKILL after KillWait) and queues the same job id again, with SLURM_RESTART_COUNT=1."""
    deadline = time.monotonic() + 400
    while max(_checkpoints(run), default=0) <= after:
        assert slurm.job_state(job) in {"PENDING", "RUNNING"} and time.monotonic() < deadline, _job_log(
            run, job
        )
        time.sleep(0.5)
    done = slurm.client(["scontrol", "requeue", job])
    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.monotonic() + 120
    # PENDING once every process of the first incarnation has ended (it is COMPLETING meanwhile)
    while not {"Restarts=1", "JobState=PENDING"} <= set(
        (shown := slurm.client(["scontrol", "-o", "show", "job", job]).stdout).split()
    ):
        assert time.monotonic() < deadline, shown
        time.sleep(0.5)
    stopped_at = max(_checkpoints(run))
    summary = load_trainer_state(run / f"step_{stopped_at:06d}")["summary"]
    assert summary["stopped_early"] == 1.0, (summary, _job_log(run, job))
    # A requeued job waits for its BeginTime (Slurm sets it a while ahead); the test does not wait for it.
    slurm.client(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    print(f"requeued at step {stopped_at}")
    return stopped_at


def _resumed_steps(run: Path) -> list[int]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [e["event"]["step"] for e in events if "resumed_from" in e.get("event", {})]


def _mlflow_uri(hosts: Cluster) -> str:
    return f"sqlite:///{hosts.shared / 'mlflow.db'}"


def _check_outcome(hosts: Cluster, run: Path, log: str, cancelled_at: int, name: str) -> None:
    resumed = _resumed_steps(run)
    assert len(resumed) == 2 and resumed[0] == cancelled_at > 0 and resumed[1] > cancelled_at, (resumed, log)
    # node 1 ran on the other host, with node 0's endpoint
    assert f"node 1: trained to step {STEPS}" in log, log
    client = MlflowClient(_mlflow_uri(hosts))
    versions = client.search_model_versions(f"name='{name}'")
    assert [str(v.version) for v in versions] == ["1"], versions
    run_id = versions[0].run_id
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == list(range(1, STEPS + 1)), steps  # one MLflow run across both jobs, no step twice
