"""Production across machines, end to end (issue 13.4), with authentication on (issue 32): real PostgreSQL,
Prefect server and MLflow server from `flows.services` (authenticated by default); `prefect deploy` from a clone of the
repository; that clone deleted; a worker in another directory, with its own environment, home and caches and
the least-privilege MLflow user's credentials (given inside its URIs: taken out at its door), that clones and
installs the deployed commit; a tiny adhoc run; the registered model loaded and served from a third
directory that knows only the MLflow URL and a user; no password in anything the worker printed.

The worker's environment: a virtual environment of its own that sees the test environment's installed
dependencies read-only (a `.pth` line, like a pre-built worker image); the pull step installs the project
into it from the clone, with no package index and no build isolation, so the test downloads nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flows import services as stores
from flows.services.processes import free_port, stop_tree, wait_http
from prefect_server import TINY_RUN, deployment_run_cli, prefect, start, tail, wait_for_flow_run
from prefect_server import git as _git
from prefect_server import publish_snapshot as _publish_snapshot

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 420
# fp32: CPUs without AVX-512 BF16 run bf16 matmuls at a fraction of fp32's speed; precision is not under test.
CONFIG = {**TINY_RUN, "max_steps": 4, "dtype": "fp32"}
# What a worker, a deployer or a registry user must not inherit from the test session.
PRIVATE = ("PYTHONPATH", "VIRTUAL_ENV", "LLAMAFLOW_HOME", "LLAMAFLOW_MLRUNS", "TORCHINDUCTOR_CACHE_DIR")


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in PRIVATE and not k.startswith(("PREFECT_", "MLFLOW_"))
    }
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_CLI_PROMPT": "false", **extra})
    return env


def _worker_venv(path: Path) -> Path:
    """A virtual environment of the worker's own; the dependencies come from the test environment, read-only."""
    import setuptools

    if tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (70, 1):
        pytest.fail(
            f"setuptools {setuptools.__version__} cannot build the project without build isolation: "
            "install the dev extra (make install), which asks for setuptools>=70.1"
        )
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(path)], check=True)
    purelib = subprocess.run(
        [str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A plain path line: the directory joins sys.path, its own .pth files (the editable llamaflow) do not run.
    Path(purelib, "llamaflow-worker-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path / "bin" / "python"


def _processes_under(root: Path) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        cwd = proc.info["cwd"] or ""
        if str(root) in cmdline or cwd.startswith(str(root)):
            found.append(f"{proc.info['pid']} {cmdline[:200]}")
    return found


@pytest.fixture()
def root() -> Iterator[Path]:
    # Not pytest's tmp_path: PostgreSQL runs as an unprivileged user, who must be able to enter it.
    path = Path(tempfile.mkdtemp(prefix="llamaflow-production-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.e2e
def test_a_worker_sharing_only_the_network_trains_and_registers_a_model_served_elsewhere(root: Path) -> None:
    services = stores.up(root / "services")  # authenticated by default
    worker = None
    try:
        admin = services.client_env()
        api = {k: admin[k] for k in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
        name = f"prod-{uuid.uuid4().hex[:8]}"
        # The worker's MLflow user: EDIT on the experiment and the two models this test registers, nothing else.
        worker_file = stores.add_user(
            services, "worker", experiments=["llamaflow-tiny"], models=[name, f"{name}-split"]
        )
        worker_creds = dict(line.split("=", 1) for line in worker_file.read_text().splitlines())
        password = worker_creds["MLFLOW_TRACKING_PASSWORD"]
        # The registering flow runs on this worker: its promotion step moves the alias as the promoter (the
        # worker's own user cannot), whose credentials this machine holds besides the worker's.
        promoter_file = stores.add_user(
            services,
            "promoter",
            experiments=["llamaflow-tiny"],
            models=[name, f"{name}-split"],
            promoter=True,
        )
        promoter = {
            key: value
            for key, value in (line.split("=", 1) for line in promoter_file.read_text().splitlines())
            if key.startswith("LLAMAFLOW_PROMOTER_")
        }

        # The deployer: a clone of the remote, `prefect deploy` from it, then the clone is gone.
        origin = _publish_snapshot(root)
        deployer = root / "deployer"
        _git(["clone", "-q", str(origin), str(deployer)], root)
        deploy_env = _env(
            **api, PREFECT_HOME=str(root / "deployer-prefect"), PYTHONPATH=str(deployer), PWD=str(deployer)
        )  # as a shell in the deployer's checkout has them
        prefect(["work-pool", "create", "gpu-pool", "--type", "process"], deploy_env, deployer)
        prefect(["--no-prompt", "deploy", "--all"], deploy_env, deployer)
        commit = _git(["rev-parse", "HEAD"], deployer)
        shutil.rmtree(deployer)

        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        prefect_settings = {
            PREFECT_API_URL: services.prefect_api_url,
            PREFECT_API_AUTH_STRING: api["PREFECT_API_AUTH_STRING"],
        }
        with temporary_settings(updates=prefect_settings), get_client(sync_client=True) as client:
            adhoc = client.read_deployment_by_name("pretrain/adhoc")
        clone_step, install_step = adhoc.pull_steps
        assert clone_step["prefect.deployments.steps.git_clone"]["repository"] == str(origin)
        assert clone_step["prefect.deployments.steps.git_clone"]["commit_sha"] == commit
        assert "pip_install_requirements" in next(iter(install_step))
        assert str(deployer) not in json.dumps(adhoc.model_dump(mode="json"))

        # The worker: another directory, its own environment (the project installed from a checkout that is
        # then gone), home and caches; it reaches the servers only, its credentials given inside the URIs.
        place = root / "worker"
        python = _worker_venv(place / "venv")
        checkout = root / "worker-checkout"
        _git(["clone", "-q", str(origin), str(checkout)], root)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                "--no-build-isolation",
                str(checkout),
            ],
            check=True,
            capture_output=True,
        )
        shutil.rmtree(checkout)
        scheme, rest = services.mlflow_tracking_uri.split("://", 1)
        api_scheme, api_rest = services.prefect_api_url.split("://", 1)
        worker_env = _env(
            PREFECT_API_URL=f"{api_scheme}://{api['PREFECT_API_AUTH_STRING']}@{api_rest}",
            MLFLOW_TRACKING_URI=f"{scheme}://worker:{password}@{rest}",
            PATH=f"{python.parent}{os.pathsep}{os.environ['PATH']}",
            PREFECT_HOME=str(place / "prefect"),
            LLAMAFLOW_HOME=str(place / "home"),
            HF_DATASETS_CACHE=str(place / "hf-datasets"),
            PREFECT_WORKER_QUERY_SECONDS="2",
            **promoter,
            PIP_NO_INDEX="1",  # nothing to download: the dependencies are there, the project comes from the clone
            PIP_NO_BUILD_ISOLATION="0",  # pip's spelling of --no-build-isolation (use the installed setuptools)
        )
        worker_log = root / "worker.log"
        worker = start(
            [str(python), "-m", "flows.pool.worker", "--pool", "gpu-pool"],
            worker_env,
            place,
            worker_log,
        )

        # An operator triggers the run from yet another place.
        operator = root / "operator"
        operator.mkdir()
        flow_run_id, output = deployment_run_cli(
            "pretrain/adhoc",
            {"config": {**CONFIG, "model_name": name}},
            _env(**api, PREFECT_HOME=str(root / "operator-prefect")),
            operator,
            timeout_s=RUN_TIMEOUT_S,
        )
        with temporary_settings(updates=prefect_settings):
            run = wait_for_flow_run(flow_run_id, 30, worker_log)
        assert run.state.type.value == "COMPLETED", (
            f"{run.state.message}\n{output[-3000:]}\n{tail(worker_log)}"
        )
        checkpoints = list((place / "home" / "runs" / str(flow_run_id)).glob("step_*/model.safetensors"))
        assert checkpoints, f"no checkpoint in the worker's own home\n{tail(worker_log)}"
        installed = subprocess.run(
            [str(python), "-c", "import tasks; print(tasks.__file__)"],
            cwd=place,
            env=worker_env,
            capture_output=True,
            text=True,
        ).stdout
        # The pull step installed the project into the worker's own environment, not editable.
        assert installed.startswith(str(place / "venv" / "lib")), installed

        # Split placement with no shared disk: the pretrain run keeps its data in another home (a data
        # machine), the training run uses the worker's; inputs and checkpoint travel as MLflow artifacts.
        data_home = root / "data-machine-home"
        split_config = {**CONFIG, "seq_len": 48, "model_name": f"{name}-split", "placement": "deployment"}
        first_output = output
        split_id, output = deployment_run_cli(
            "pretrain/adhoc",
            {"config": split_config},
            _env(**api, PREFECT_HOME=str(root / "operator-prefect")),
            operator,
            job_variables={"env": {"LLAMAFLOW_HOME": str(data_home)}},
            timeout_s=RUN_TIMEOUT_S,
        )
        with temporary_settings(updates=prefect_settings):
            split = wait_for_flow_run(split_id, 30, worker_log)
        assert split.state.type.value == "COMPLETED", (
            f"{split.state.message}\n{output[-3000:]}\n{tail(worker_log)}"
        )
        (dataset,) = (data_home / "cache" / "datasets").iterdir()
        assert (place / "home" / "cache" / "datasets" / dataset.name / "train.npy").is_file()  # fetched
        trained = sorted((place / "home" / "runs" / str(split_id)).glob("step_*"))
        handed_back = sorted((data_home / "runs" / str(split_id)).glob("step_*"))
        assert [p.name for p in handed_back] == [trained[-1].name]  # only the final checkpoint came back

        # A registry user: only the MLflow URL and a read-only user, in a third directory.
        user = root / "user"
        user.mkdir()
        reader = stores.add_user(services, "reader", read_only=True).read_text().splitlines()
        user_env = _env(
            **{k: v for k, v in (line.split("=", 1) for line in reader) if k.startswith("MLFLOW_")}
        )
        script = (
            "import mlflow\n"
            f"model = mlflow.pyfunc.load_model('models:/{name}@champion')\n"
            "print(repr(model.predict(['def '], params={'max_new_tokens': 6})[0]))\n"
        )
        loaded = subprocess.run(
            [sys.executable, "-c", script], cwd=user, env=user_env, capture_output=True, text=True
        )
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        completion = loaded.stdout.strip().splitlines()[-1]
        assert completion.startswith("'") and len(completion) > 2, loaded.stdout  # generated text, not empty

        port = free_port()
        serve_env = {**user_env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{user_env['PATH']}"}
        mlflow_cli = str(Path(sys.executable).with_name("mlflow"))
        serve_args = [
            "models",
            "serve",
            "-m",
            f"models:/{name}@champion",
            "--env-manager",
            "local",
            "-p",
            str(port),
        ]
        server = start([mlflow_cli, *serve_args], serve_env, user, root / "serve.log")
        try:
            wait_http(
                f"http://127.0.0.1:{port}/ping", server.pid, root / "serve.log", "mlflow models serve", 120
            )
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/invocations",
                data=json.dumps({"inputs": ["class "], "params": {"max_new_tokens": 6}}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                answer = json.loads(response.read())
            (generated,) = answer["predictions"]
            assert isinstance(generated, str) and generated, answer
        finally:
            stop_tree(server.pid)
        shown = tail(worker_log, 10_000_000) + first_output + output
        leaks = [s[:4] for s in (password, api["PREFECT_API_AUTH_STRING"].partition(":")[2]) if s in shown]
        assert leaks == [], "a password in the worker's or the operator's output"
    finally:
        if worker is not None:
            stop_tree(worker.pid)
        stores.down(root / "services")
    deadline = time.monotonic() + 10
    while _processes_under(root) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_under(root) == []
