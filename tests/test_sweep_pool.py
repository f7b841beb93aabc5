"""Sweeps on the pool (`launch: deployment`): a trial whose flow run completed while no sweep watched it (its
sweep was killed with kill -9) is told to Optuna from that run's MLflow result by the next sweep, not
trained again in a new flow run; one whose flow run crashed resumes from its own checkpoint directory."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from optuna.trial import TrialState
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from flows.sweep.study import open_storage
from prefect_server import POOL, deploy_from_checkout, pool_server, prefect_worker, tail, wait_for_flow_run
from registry_world import corpus, stdlib_text
from tasks.tracking import store

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
BASE = {  # the tiny preset, eager, fp32, a few steps on a few KB of text: orchestration is under test
    "preset": "tiny",
    "vocab_size": 384,
    "seq_len": 64,
    "micro_batch_size": 4,
    "accumulate_steps": 1,
    "warmup_steps": 1,
    "max_steps": 4,
    "checkpoint_every": 0,
    "compile": False,
    "dtype": "fp32",
    "eval_max_blocks": 2,
    "num_samples": 0,
    "experiment": "sweep-pool",
    "model_name": "sweep-pool-model",
}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], dict[str, str]]]:
    root = tmp_path_factory.mktemp("sweep-pool")
    texts = stdlib_text(("textwrap.py", "shlex.py", "colorsys.py", "bisect.py"), 6000)
    data = {"data": corpus(root, "train", texts[:3]), "val_data": corpus(root, "val", texts[3:])}
    # Checkpoints take a second (halfway through): a trial cannot finish before the test kills it mid-run,
    # however fast the machine. The first test writes none (checkpoint_every 0).
    slow = {"LLAMAFLOW_HOME": str(root / "home"), "LLAMAFLOW_FAULT_INJECT": "checkpoint_delay_s=1"}
    with pool_server(root, slow) as server:
        deploy_from_checkout(root, server.env, "adhoc")
        with prefect_worker(POOL, server.env, root, root / "worker.log"):
            env = {
                **server.env,
                "PYTHONPATH": str(REPO),
                "LLAMAFLOW_SWEEP_POLL_S": "0.5",
                "OMP_NUM_THREADS": "1",
            }
            yield root, env, data


def _sweep(root: Path, env: dict[str, str], spec: dict) -> subprocess.Popen[bytes]:
    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    log = (root / f"{spec['name']}.log").open("ab")
    command = [sys.executable, "-m", "flows.sweep", str(path)]
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _trials(root: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    journal = root / "home" / "sweeps" / name / "optuna.journal"
    if not journal.is_file():
        return []
    try:
        return optuna.load_study(study_name=name, storage=open_storage(f"journal:{journal}")).get_trials()
    except KeyError:
        return []


def test_a_trial_whose_flow_run_completed_unwatched_is_told_from_its_result(pool: tuple) -> None:
    root, env, data = pool
    name = "unwatched"
    spec = {
        "name": name,
        "base": {**BASE, **data},
        "space": {"lr": {"choices": [0.003]}},
        "sampler": "grid",
        "launch": "deployment",
        "deployment": "pretrain/adhoc",
    }
    log, worker_log = root / f"{name}.log", root / "worker.log"
    first = _sweep(root, env, spec)
    deadline = time.monotonic() + 300
    while not any("flow_run_id" in t.user_attrs for t in _trials(root, name)):
        assert first.poll() is None, tail(log)
        assert time.monotonic() < deadline, f"no flow run started:\n{tail(log)}"
        time.sleep(0.5)
    os.kill(first.pid, signal.SIGKILL)  # the flow run goes on on the worker, unwatched
    first.wait()
    flow_run_id = _trials(root, name)[0].user_attrs["flow_run_id"]
    assert wait_for_flow_run(flow_run_id, 600, worker_log).state.type.value == "COMPLETED", tail(worker_log)

    assert _sweep(root, env, spec).wait(timeout=600) == 0, tail(log)
    left, trial = _trials(root, name)  # the killed sweep's trial, taken over by one that continues it
    assert left.state == TrialState.FAIL and trial.system_attrs["failed_trial"] == left.number
    assert trial.state == TrialState.COMPLETE and trial.user_attrs["flow_run_id"] == flow_run_id
    run = store.get_client(env["MLFLOW_TRACKING_URI"]).get_run(trial.user_attrs["mlflow_run_id"])
    assert run.data.tags["prefect.flow_run_id"] == flow_run_id
    assert run.data.metrics["val/bits_per_byte"] == pytest.approx(trial.value)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("pretrain/adhoc")
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        )
    assert [str(r.id) for r in runs] == [flow_run_id]  # not trained again


def _kill_flow_run_processes(flow_run_id: str) -> int:
    """SIGKILL every process of the flow run (the worker's child and what it started): a lost machine."""
    killed = 0
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                process.kill()
                killed += 1
    return killed


def test_a_killed_sweeps_crashed_trial_resumes_from_its_own_checkpoint_directory(pool: tuple) -> None:
    """The sweep killed with kill -9, then its trial's flow run killed on the worker (CRASHED): the next sweep
    starts a new flow run on the trial's own checkpoint directory, which resumes from its checkpoint (step
    > 0) and continues the trial's MLflow run, instead of training from scratch in a new run directory."""
    root, env, data = pool
    name = "crashed"
    spec = {
        "name": name,
        "base": {**BASE, **data, "max_steps": 60, "checkpoint_every": 5},
        "space": {"lr": {"choices": [0.003]}},
        "sampler": "grid",
        "launch": "deployment",
        "deployment": "pretrain/adhoc",
    }
    log, worker_log = root / f"{name}.log", root / "worker.log"
    first = _sweep(root, env, spec)
    deadline = time.monotonic() + 300
    while not list((root / "home" / "sweeps" / name).glob("study-*/trial-000/run/step_*")):
        assert first.poll() is None, tail(log)
        assert time.monotonic() < deadline, f"no checkpoint of the trial:\n{tail(worker_log)}"
        time.sleep(0.5)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    crashed = _trials(root, name)[0].user_attrs["flow_run_id"]
    client = store.get_client(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(BASE["experiment"]).experiment_id
    (mlflow_run,) = client.search_runs([experiment], f"tags.`prefect.flow_run_id` = '{crashed}'")
    assert _kill_flow_run_processes(crashed) > 0
    assert wait_for_flow_run(crashed, 120, worker_log).state.type.value == "CRASHED", tail(worker_log)

    assert _sweep(root, env, spec).wait(timeout=600) == 0, tail(log)
    left, trial = _trials(root, name)
    assert left.state == TrialState.FAIL and trial.system_attrs["failed_trial"] == left.number
    assert trial.state == TrialState.COMPLETE and trial.user_attrs["flow_run_id"] != crashed
    assert f"its flow run {crashed} ended Crashed; a new one resumes" in log.read_text()
    resumed = [
        int(m)
        for m in re.findall(
            r"resuming from checkpoint \S+trial-000/run/step_\d+ at step (\d+)/", worker_log.read_text()
        )
    ]
    assert resumed and resumed[-1] > 0, tail(worker_log)
    assert trial.user_attrs["mlflow_run_id"] == mlflow_run.info.run_id  # continued, not a new run
    assert (
        client.get_run(mlflow_run.info.run_id).data.tags["prefect.flow_run_id"]
        == trial.user_attrs["flow_run_id"]
    )
