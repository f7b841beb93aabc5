"""A real Prefect server and process worker for end-to-end tests, started and stopped cleanly.

Prefect 3.9's process worker starts every flow run in its own session, so killing the worker's
process group leaves the flow runs alive: `stop_process_tree` stops every descendant too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.services.processes import free_port, stop_tree

PREFECT_CLI = str(Path(sys.executable).with_name("prefect"))
REPO = Path(__file__).resolve().parents[1]
POOL = "gpu-pool"  # prefect.yaml's work pool
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# The pretrain config of a deployed test run. Orchestration is under test there, not speed: the tiny model,
# small eager steps (test_pipeline_e2e.py covers torch.compile), and enough steps and checkpoints for a crash
# to have something to resume from.
TINY_RUN = {
    "preset": "tiny",
    "max_steps": 6,
    "warmup_steps": 1,
    "checkpoint_every": 2,
    "seq_len": 64,
    "micro_batch_size": 4,
    "accumulate_steps": 1,
    "compile": False,
    "eval_max_blocks": 8,
    "num_samples": 1,
    "sample_max_new_tokens": 8,
}


def git(args: list[str], cwd: Path) -> str:
    identity = ["-c", "user.name=llamaflow-test", "-c", "user.email=test@llamaflow.invalid"]
    done = subprocess.run(["git", *identity, *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def publish_snapshot(root: Path) -> Path:
    """A bare repository (the remote) holding this working tree as one commit, tracked files and new ones."""
    files = git(["ls-files", "--cached", "--others", "--exclude-standard", "-z"], REPO).split("\0")
    snapshot = root / "snapshot"
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, snapshot / name)
    git(["init", "-q", "-b", "main"], snapshot)
    git(["add", "-A"], snapshot)
    git(["commit", "-q", "-m", "snapshot under test"], snapshot)
    origin = root / "origin.git"
    git(["clone", "-q", "--bare", str(snapshot), str(origin)], root)
    shutil.rmtree(snapshot)
    return origin


def shared_checkout_prefect_file(root: Path) -> Path:
    """prefect.yaml's deployments, run from this checkout (the development set-up): no build steps, no clone,
    `set_working_directory` here. Written under `root`; pass it to `prefect deploy --prefect-file`."""
    import yaml

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    spec["build"] = None
    spec["pull"] = [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    path = root / "prefect-shared-checkout.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def stop_process_tree(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stop `proc` and every process it started (flows.services.processes.stop_tree), then reap it."""
    if proc.poll() is None:
        stop_tree(proc.pid, grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def start(args: list[str], env: Mapping[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start a long-running command in its own session, output appended to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            args, env=dict(env), cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_healthy(api_url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{tail(log)}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(f"{api_url}/health", timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy after {timeout_s:.0f} s:\n{tail(log)}")


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def prefect(args: list[str], env: Mapping[str, str], cwd: Path, timeout_s: float = 180.0) -> str:
    """Run one `prefect` CLI command to completion; its output, or an error that shows it."""
    done = subprocess.run(
        [PREFECT_CLI, *args], env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} failed ({done.returncode}):\n{output[-4000:]}")
    return output


def deployment_run_cli(
    deployment: str,
    params: Mapping[str, object],
    env: Mapping[str, str],
    cwd: Path,
    *,
    job_variables: Mapping[str, object] | None = None,
    timeout_s: float = 300.0,
) -> tuple[UUID, str]:
    """`prefect deployment run DEPLOYMENT --param k=JSON ... --watch`, as an operator types it.

    Returns the flow run id and the CLI's output; the exit status (0 only for Completed) is left
    to the caller, who reads the run's state from the API.
    """
    args = [PREFECT_CLI, "deployment", "run", deployment, "--watch", "--watch-timeout", str(int(timeout_s))]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    for key, value in (job_variables or {}).items():
        args += ["--job-variable", f"{key}={json.dumps(value)}"]
    done = subprocess.run(
        args, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout_s + 60
    )
    output = done.stdout + done.stderr
    found = re.search(r"UUID: ([0-9a-f-]{36})", output)
    if found is None:
        raise RuntimeError(f"no flow run created ({done.returncode}):\n{output[-4000:]}")
    return UUID(found.group(1)), output


@contextlib.contextmanager
def prefect_server(
    home: Path, base_env: Mapping[str, str], *, health_timeout_s: float = 240.0
) -> Iterator[tuple[str, dict[str, str]]]:
    """A `prefect server` on a free port with its own PREFECT_HOME; yields (api_url, client env)."""
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **base_env,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
    }
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    log = home / "server.log"
    proc = start(
        [PREFECT_CLI, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"],
        server_env,
        home,
        log,
    )
    try:
        wait_healthy(api_url, proc, log, health_timeout_s)
        yield api_url, env
    finally:
        drain_prefect_clients()
        stop_process_tree(proc)


def drain_prefect_clients(timeout_s: float = 30.0) -> None:
    """Send and stop this process's Prefect event and log workers while their server is still up.

    Prefect keeps one events worker per client type, not per API URL: one that a test's in-process calls
    started against this server would keep sending every later module's events here after it stopped,
    each send timing out (and prefect_test_harness's drain hanging on them). prefect_test_harness drains
    them at its end; a test server started here does the same."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (EventsWorker, APILogWorker):
        service.drain_all(timeout=timeout_s)


@contextlib.contextmanager
def prefect_worker(
    pool: str, env: Mapping[str, str], cwd: Path, log: Path, *, limit: int | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`prefect worker start --pool POOL [--limit N]`; stops it and every flow-run process it started."""
    args = [PREFECT_CLI, "worker", "start", "--pool", pool, *(["--limit", str(limit)] if limit else [])]
    proc = start(args, env, cwd, log)
    try:
        yield proc
    finally:
        stop_process_tree(proc)


def wait_for_flow_run(flow_run_id: UUID, timeout_s: float, worker_log: Path | None = None):  # noqa: ANN201
    """Poll the API until the flow run reaches a final state; returns the FlowRun."""
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.type.value in FINAL_STATES:
                return run
            if time.monotonic() > deadline:
                state = run.state.name if run.state else None
                logs = tail(worker_log) if worker_log else ""
                raise TimeoutError(f"flow run {flow_run_id} still {state} after {timeout_s:.0f} s\n{logs}")
            time.sleep(1.0)


@dataclass
class PoolServer:
    api_url: str
    env: dict[str, str]  # for `prefect` commands and workers: this server's API, the MLflow store below
    tracking_uri: str


@contextlib.contextmanager
def pool_server(
    root: Path, extra_env: Mapping[str, str] | None = None, *, health_timeout_s: float = 240.0
) -> Iterator[PoolServer]:
    """A Prefect server with the process work pool POOL and an MLflow store under `root`; this process's
    Prefect client points at it while it lasts. Deploy (`deploy_from_checkout`) and start workers inside."""
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    base_env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking_uri,
        # How soon the server cancels subflows of a cancelled run (default 20 s).
        "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_LOOP_SECONDS": "2",
        # How often a worker asks for scheduled runs (default 10 s): each run waits for one poll.
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        **(extra_env or {}),
    }
    with prefect_server(root / "prefect", base_env, health_timeout_s=health_timeout_s) as (api_url, env):
        prefect(["work-pool", "create", POOL, "--type", "process"], env, REPO)
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            yield PoolServer(api_url, env, tracking_uri)


def deploy_from_checkout(root: Path, env: Mapping[str, str], *names: str) -> None:
    """`prefect deploy` of prefect.yaml's deployments NAMES (all when none are named), run from this checkout."""
    which = [arg for name in names for arg in ("--name", name)] or ["--all"]
    prefect(
        ["--no-prompt", "deploy", *which, "--prefect-file", str(shared_checkout_prefect_file(root))],
        env,
        REPO,
    )


def idle_train_deployment(env: Mapping[str, str]) -> UUID:
    """`remote-train/idle`: the train flow deployed on a pool no worker serves (its runs never start)."""
    prefect(["work-pool", "create", "idle-pool", "--type", "process"], env, REPO)
    with get_client(sync_client=True) as client:
        gpu = client.read_deployment_by_name("remote-train/gpu")
        return client.create_deployment(
            flow_id=gpu.flow_id,
            name="idle",
            work_pool_name="idle-pool",
            entrypoint=gpu.entrypoint,
            pull_steps=gpu.pull_steps,
            parameter_openapi_schema=gpu.parameter_openapi_schema,
        )


def child_flow_runs(flow_run_id: UUID) -> list:
    """The flow runs started under `flow_run_id` (its subflows and the deployment runs it started), oldest first."""
    parent = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        return sorted(client.read_flow_runs(flow_run_filter=parent), key=lambda r: r.created)


def flow_run_logs(flow_run_id: UUID) -> list[str]:
    """The messages a flow run logged to the API."""
    with get_client(sync_client=True) as client:
        return [
            r.message for r in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        ]


def cli_flags(config: dict[str, object]) -> list[str]:
    """`python -m flows.pretrain`'s flags for a run configuration (`TINY_RUN`'s keys)."""
    flags = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{key.replace('_', '-')}")
        else:
            flags += [flag, str(value)]
    return flags
