"""Sweeps end to end, as a user runs them (`python -m flows.sweep SPEC.yaml` against a Prefect server): a
sweep killed with kill -9 after two finished trials and run again ends with exactly its trials, none run
twice, the killed one resumed from its checkpoint; every trial an MLflow run nested under the sweep's; no
alias of the base's model moved; and the pruner stops a weak trial before its last step."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
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

from flows.sweep.study import open_storage
from prefect_server import prefect_server, tail
from registry_world import corpus, stdlib_text
from tasks.tracking import store

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
BASE = {  # the tiny preset, eager, fp32, on a few KB of text: orchestration is under test, not speed
    "preset": "tiny",
    "vocab_size": 384,
    "seq_len": 64,
    "micro_batch_size": 4,
    "accumulate_steps": 1,
    "warmup_steps": 1,
    "compile": False,
    "dtype": "fp32",
    "eval_max_blocks": 8,
    "num_samples": 0,
    "experiment": "sweep-e2e",
    "model_name": "sweep-e2e-model",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], dict]]:
    root = tmp_path_factory.mktemp("sweeps")
    texts = stdlib_text(("textwrap.py", "shlex.py", "colorsys.py", "bisect.py"), 6000)
    data = {"data": corpus(root, "train", texts[:3]), "val_data": corpus(root, "val", texts[3:])}
    base_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLAMAFLOW_HOME": str(root / "home"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "LLAMAFLOW_SWEEP_POLL_S": "0.5",
        "LLAMAFLOW_SWEEP_GPU_LOCKS": str(root / "gpu-locks"),  # the host's GPU leases: this test's own
        "OMP_NUM_THREADS": "1",
    }
    with prefect_server(root / "prefect", base_env) as (_, env):
        yield root, env, data


def _sweep(root: Path, env: dict[str, str], spec: dict) -> subprocess.Popen[bytes]:
    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    log = (root / f"{spec['name']}.log").open("ab")
    command = [sys.executable, "-m", "flows.sweep", str(path)]
    return subprocess.Popen(
        command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _study(root: Path, name: str) -> optuna.Study:
    storage = open_storage(f"journal:{root / 'home' / 'sweeps' / name / 'optuna.journal'}")
    return optuna.load_study(study_name=name, storage=storage)


def _trials_dir(root: Path, name: str) -> Path:
    """Where the study `name` keeps its trials' directories (one folder per study: see flows.sweep.flow)."""
    return root / "home" / "sweeps" / name / f"study-{_study(root, name).user_attrs['uid'][:8]}"


def _checkpointed(root: Path, name: str, label: str) -> bool:
    """Whether the trial `label` of the study `name` has written a checkpoint (False before the study is)."""
    if not (root / "home" / "sweeps" / name / "optuna.journal").is_file():
        return False
    try:
        return any((_trials_dir(root, name) / label / "run").glob("step_*"))
    except KeyError:  # the study, or its id, not written yet
        return False


def _wait(condition, timeout_s: float, what: str, log: Path) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s:.0f} s:\n{tail(log)}")
        time.sleep(0.5)


def _runs(env: dict[str, str]) -> list:
    client = store.get_client(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(BASE["experiment"])
    return client.search_runs([experiment.experiment_id]) if experiment else []


def test_a_sweep_killed_after_two_trials_resumes_to_exactly_its_trials_nested_in_mlflow(world: tuple) -> None:
    root, env, data = world
    name = "resume"
    spec = {
        "name": name,
        "base": {**BASE, **data, "max_steps": 200, "checkpoint_every": 10},
        "space": {"lr": {"choices": [0.003, 0.002, 0.001]}},
        "sampler": "grid",
    }
    log = root / f"{name}.log"
    first = _sweep(root, env, spec)

    def two_done_and_the_third_checkpointed() -> bool:
        if first.poll() is not None:
            raise AssertionError(f"the sweep ended before it was killed:\n{tail(log)}")
        if not (root / "home" / "sweeps" / name / "optuna.journal").is_file():
            return False
        trials = _study(root, name).get_trials()
        done = sum(t.state == TrialState.COMPLETE for t in trials)
        return done == 2 and any((_trials_dir(root, name) / "trial-002" / "run").glob("step_*"))

    try:
        _wait(
            two_done_and_the_third_checkpointed, 600, "two finished trials and a checkpoint of the third", log
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first.pid, signal.SIGKILL)
        first.wait()
    trial_dir = _trials_dir(root, name)
    running = _study(root, name).trials[2]
    assert running.state == TrialState.RUNNING
    # The trial's process sees its sweep die (PR_SET_PDEATHSIG) and stops by itself, after a checkpoint.
    child = running.user_attrs["child"]
    _wait(lambda: not psutil.pid_exists(child["pid"]), 120, "the killed sweep's trial to stop", log)
    assert "training stopped by SIGTERM" in (trial_dir / "trial-002" / "output.log").read_text()

    again = _sweep(root, env, spec)
    assert again.wait(timeout=600) == 0, tail(log)

    # The killed sweep's trial 2 was taken over (ended FAIL, check-and-set) by trial 3, which continued it.
    everything = _study(root, name).get_trials()
    assert [t.state for t in everything] == [TrialState.COMPLETE] * 2 + [TrialState.FAIL, TrialState.COMPLETE]
    assert (
        everything[3].system_attrs["failed_trial"] == 2
        and everything[2].user_attrs["ended"] == "sweep stopped"
    )
    trials = [t for t in everything if t.state == TrialState.COMPLETE]
    assert sorted(t.params["lr"] for t in trials) == [0.001, 0.002, 0.003]
    third = (trial_dir / "trial-002" / "output.log").read_text()
    assert "resuming from checkpoint" in third  # continued, not started again
    for number in (0, 1):  # the finished ones did not run again
        assert (trial_dir / f"trial-{number:03d}" / "output.log").read_text().count("Beginning flow run") == 1
    assert "continuing: 2 complete, 0 pruned, 1 to resume" in log.read_text()

    # MLflow: one parent run for the sweep, every trial one run nested under it, with the trial's numbers.
    runs = _runs(env)
    parents = [r for r in runs if r.data.tags.get("llamaflow.sweep.kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.run_name == name and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    children = sorted(
        (r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent), key=lambda r: r.info.run_name
    )
    assert [r.info.run_name for r in children] == [f"{name}-trial-{n:03d}" for n in range(3)]
    for run, trial in zip(children, trials, strict=True):
        assert run.data.tags["llamaflow.sweep.state"] == "COMPLETE" and run.info.status == "FINISHED"
        assert run.info.run_id == trial.user_attrs["mlflow_run_id"]
        assert run.data.params["lr"] == str(trial.params["lr"])
        assert run.data.metrics["val/bits_per_byte"] == pytest.approx(trial.value)
    client = store.get_client(env["MLFLOW_TRACKING_URI"])
    assert {a.path for a in client.list_artifacts(parent)} >= {"results.md", "trials.csv", "plots"}
    assert "plots/optimization_history.png" in {a.path for a in client.list_artifacts(parent, "plots")}

    # No trial registered a model (register_trials is false by default): neither the base's model name nor
    # the sweep's own has a version, and no trial run records one.
    assert not client.search_model_versions(f"name = '{BASE['model_name']}'")
    assert not client.search_model_versions(f"name = '{BASE['model_name']}-sweep-{name}'")
    assert not any("llamaflow.registered_version" in run.data.tags for run in children)
    # Every concurrency slot is back (the killed sweep's one was handed back by the second).
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}),
        get_client(sync_client=True) as prefect,
    ):
        limits = prefect.read_global_concurrency_limits()
    assert [
        (limit.name, limit.active_slots) for limit in limits if limit.name.startswith("llamaflow-sweeps-")
    ] == [(f"llamaflow-sweeps-{socket.gethostname()}", 0)]


def test_the_pruner_stops_a_weak_trial_before_its_last_step(world: tuple) -> None:
    root, env, data = world
    name = "prune"
    steps = 300  # long enough on a fast host for the stop to land well before the end
    spec = {
        "name": name,
        "base": {
            **BASE,
            **data,
            "max_steps": steps,
            "checkpoint_every": 100,
            "eval_every": 2,
            "eval_bytes": 512,
        },
        # The grid draws 0.003 first (sampler seed 0), then a learning rate that cannot learn.
        "space": {"lr": {"choices": [1e-7, 0.003]}},
        "sampler": "grid",
        "pruner": "asha",
    }
    log = root / f"{name}.log"
    assert _sweep(root, env, spec).wait(timeout=600) == 0, tail(log)

    good, weak = _study(root, name).get_trials()
    assert good.params["lr"] == 0.003 and good.state == TrialState.COMPLETE
    assert weak.params["lr"] == 1e-7 and weak.state == TrialState.PRUNED
    assert min(weak.intermediate_values) == 2  # the first rung: the base's eval_every
    run = next(r for r in _runs(env) if r.info.run_name == f"{name}-trial-001")
    assert run.info.status == "KILLED" and run.data.tags["llamaflow.sweep.state"] == "PRUNED"
    trained = store.get_client(env["MLFLOW_TRACKING_URI"]).get_metric_history(run.info.run_id, "train/loss")
    assert 2 <= max(m.step for m in trained) < steps  # stopped early, after its first score
    assert weak.user_attrs["steps"] == max(m.step for m in trained)
    assert good.user_attrs["steps"] == steps
    # The pruned trial's checkpoints are gone (no one resumes them), the finished one's kept.
    trials = _trials_dir(root, name)
    assert not list((trials / "trial-001" / "run").glob("step_*"))
    assert list((trials / "trial-000" / "run").glob("step_*"))
    assert "training stopped by SIGTERM" in (trials / "trial-001" / "output.log").read_text()  # it wrote one


def test_a_sweep_that_fails_leaves_its_run_failed(world: tuple) -> None:
    root, env, data = world
    name = "fails"
    spec = {
        "name": name,
        "base": {**BASE, **data, "max_steps": 4},
        "space": {"lr": {"choices": [0.003]}},
        "sampler": "grid",
        "launch": "deployment",
        "deployment": "pretrain/no-such-deployment",
        "concurrency_limit": "sweep-e2e-fails",
    }
    log = root / f"{name}.log"
    assert _sweep(root, env, spec).wait(timeout=300) == 1, tail(log)
    assert (
        "error: deployment 'pretrain/no-such-deployment' does not exist on the Prefect server"
        in log.read_text()
    )
    (run,) = [r for r in _runs(env) if r.info.run_name == name]
    assert run.data.tags["llamaflow.sweep.kind"] == "sweep" and run.info.status == "FAILED"


def test_a_sweep_started_over_under_the_same_name_never_touches_the_old_ones_runs(world: tuple) -> None:
    """Its journal deleted, the same spec runs again: a new study, whose trial has the same number and
    run name as the old one's. Its trial trains from scratch in a run of its own; the old run keeps its
    parent, its tags and its metrics (by run name, the old run was scored and re-parented, and the old
    trial directory's checkpoint and MLflow run were resumed)."""
    root, env, data = world
    name = "again"
    spec = {
        "name": name,
        "base": {**BASE, **data, "max_steps": 4, "checkpoint_every": 4, "eval_max_blocks": 2},
        "space": {"lr": {"choices": [0.003]}},
        "sampler": "grid",
    }
    log = root / f"{name}.log"
    assert _sweep(root, env, spec).wait(timeout=600) == 0, tail(log)
    (old,) = _study(root, name).get_trials()
    client = store.get_client(env["MLFLOW_TRACKING_URI"])
    before = client.get_run(old.user_attrs["mlflow_run_id"])

    (root / "home" / "sweeps" / name / "optuna.journal").unlink()
    assert _sweep(root, env, spec).wait(timeout=600) == 0, tail(log)
    (new,) = _study(root, name).get_trials()
    assert new.user_attrs["mlflow_run_id"] != before.info.run_id
    after = client.get_run(before.info.run_id)
    assert after.data.tags == before.data.tags  # not re-parented, not re-tagged
    assert after.data.metrics == before.data.metrics
    run = client.get_run(new.user_attrs["mlflow_run_id"])
    assert run.info.run_name == before.info.run_name == f"{name}-trial-000"
    assert run.data.tags["mlflow.parentRunId"] != before.data.tags["mlflow.parentRunId"]
    assert run.data.metrics["val/bits_per_byte"] == pytest.approx(new.value)
    output = (_trials_dir(root, name) / "trial-000" / "output.log").read_text()
    assert "resuming from checkpoint" not in output


def test_on_a_two_gpu_host_two_trials_run_at_once_one_gpu_each(world: tuple) -> None:
    """gpus_per_trial: 1 on a host of 2 GPUs (LLAMAFLOW_SWEEP_GPUS stands in for them): both trials run side
    by side, each seeing one GPU of its own in its environment (recorded on its MLflow run by the trial).
    register_winner: the trials register nothing, the winner is trained once more and registered once."""
    root, env, data = world
    name = "gpus"
    model = "sweep-e2e-winner"
    spec = {
        "name": name,
        "base": {
            **BASE,
            **data,
            "max_steps": 4,
            "checkpoint_every": 4,
            "eval_max_blocks": 2,
            "model_name": model,
        },
        "register_winner": True,
        "space": {"lr": {"choices": [0.003, 0.002]}},
        "sampler": "grid",
        "gpus_per_trial": 1,
        # A limit of its own: the host's default one was created by the sweeps above with 1 slot.
        "concurrency_limit": "sweep-e2e-gpus",
    }
    log = root / f"{name}.log"
    assert _sweep(root, {**env, "LLAMAFLOW_SWEEP_GPUS": "2"}, spec).wait(timeout=600) == 0, tail(log)
    assert "2 at a time (local, 1 GPU(s) each)" in log.read_text()
    trials = _study(root, name).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    client = store.get_client(env["MLFLOW_TRACKING_URI"])
    first, second = (client.get_run(t.user_attrs["mlflow_run_id"]) for t in trials)
    assert {
        first.data.tags["llamaflow.sweep.cuda_visible_devices"],
        second.data.tags["llamaflow.sweep.cuda_visible_devices"],
    } == {"0", "1"}
    assert first.info.start_time < second.info.end_time and second.info.start_time < first.info.end_time
    # One model version: the winner's, made by a third run (not a trial's), under the base's model name.
    (version,) = client.search_model_versions(f"name = '{model}'")
    assert not client.search_model_versions(f"name = '{model}-sweep-{name}'")
    assert version.run_id not in {first.info.run_id, second.info.run_id}
    assert client.get_run(version.run_id).data.tags["llamaflow.sweep.kind"] == "winner"
    assert "registered: models:/sweep-e2e-winner/1" in log.read_text()


def _command(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.sweep", *args], env=env, cwd=REPO, capture_output=True, text=True
    )


def test_status_a_crashed_trial_retried_from_its_checkpoint_and_stop(world: tuple) -> None:
    """`python -m flows.sweep status SPEC` lists the running trial and its owner. Its process killed with
    SIGKILL (the OOM killer, say), the trial is FAIL and retried (Optuna's RetryFailedTrialCallback) in its
    own directory: the retry resumes its checkpoint and continues its MLflow run. `stop SPEC` makes the
    sweep stop the retry after a checkpoint and end (exit 130, its run KILLED), the trial left to continue."""
    root, env, data = world
    name = "stopped"
    spec = {
        "name": name,
        "base": {**BASE, **data, "max_steps": 100_000, "checkpoint_every": 5},
        "space": {"lr": {"choices": [0.003]}},
        "sampler": "grid",
    }
    log, path = root / f"{name}.log", root / f"{name}.yaml"
    process = _sweep(root, env, spec)
    try:
        _wait(lambda: _checkpointed(root, name, "trial-000"), 300, "a checkpoint of the trial", log)
        shown = _command(env, "status", str(path))
        assert shown.returncode == 0, shown.stderr
        assert "1 running (of 1)" in shown.stdout and f"pid {process.pid}" in shown.stdout
        assert f"optuna-dashboard {root / 'home' / 'sweeps' / name / 'optuna.journal'}" in shown.stdout
        os.kill(_study(root, name).trials[0].user_attrs["child"]["pid"], signal.SIGKILL)
        output = _trials_dir(root, name) / "trial-000" / "output.log"
        _wait(lambda: "resuming from checkpoint" in output.read_text(), 300, "the retry resumed", log)
        stopped = _command(env, "stop", str(path))
        assert stopped.returncode == 0 and "stop requested" in stopped.stdout, stopped.stderr
        assert process.wait(timeout=120) == 130, tail(log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
    assert "stopped: `python -m flows.sweep stop` was run" in log.read_text()
    crashed, retried = _study(root, name).get_trials()
    assert crashed.state == TrialState.FAIL and crashed.user_attrs["message"] == "killed by signal 9"
    assert retried.params == crashed.params and retried.system_attrs["failed_trial"] == 0
    assert retried.state == TrialState.RUNNING and retried.user_attrs["owner"] == {"released": True}
    assert "training stopped by SIGTERM" in output.read_text()
    (trial_run,) = [r for r in _runs(env) if r.info.run_name == f"{name}-trial-000"]  # continued, not new
    assert trial_run.info.run_id == crashed.user_attrs["mlflow_run_id"]
    (run,) = [r for r in _runs(env) if r.info.run_name == name]
    assert run.info.status == "KILLED"
    assert "run by released" in _command(env, "status", str(path)).stdout


def test_a_diverged_trial_fails_and_is_not_retried(world: tuple) -> None:
    """A trial whose loss goes non-finite fails for a reason of its own, not the infrastructure's: FAIL,
    told once, never queued to run again (a retry would diverge again)."""
    root, env, data = world
    name = "diverged"
    spec = {
        "name": name,
        "base": {**BASE, **data, "max_steps": 3},
        "space": {"lr": {"choices": [0.003]}},
        "sampler": "grid",
    }
    process = _sweep(root, {**env, "LLAMAFLOW_FAULT_INJECT": "nan_at_step=2"}, spec)
    assert process.wait(timeout=300) == 0, tail(root / f"{name}.log")
    (trial,) = _study(root, name).get_trials()  # no retry queued
    assert trial.state == TrialState.FAIL and "non-finite training at step 2" in trial.user_attrs["message"]
    assert "ended" not in trial.user_attrs


def test_a_confirmation_stopped_then_rerun_twice_ends_with_one_verdict(world: tuple) -> None:
    """`stop` during the seed confirmation, a rerun that finishes it, and one more with `--register`: each
    configuration and seed confirmed once (the stopped trial continued, none run twice), the same verdict,
    and no empty trial asked of Optuna (it used to fail every later rerun with `'key'`)."""
    root, env, data = world
    name = "confirm-stopped"
    spec = {
        "name": name,
        "base": {**BASE, **data, "max_steps": 20, "checkpoint_every": 5, "eval_max_blocks": 2},
        "space": {"lr": {"choices": [0.002]}},
        "sampler": "grid",
        "seeds": [1, 2],
    }
    log, path = root / f"{name}.log", root / f"{name}.yaml"
    # Slow checkpoints in the first run only: the confirmation cannot end before `stop` lands.
    first = _sweep(root, {**env, "LLAMAFLOW_FAULT_INJECT": "checkpoint_delay_s=1"}, spec)

    def confirming() -> bool:
        if first.poll() is not None:
            raise AssertionError(f"the sweep ended before it was stopped:\n{tail(log)}")
        return _checkpointed_like(root, name, "confirm-*")

    try:
        _wait(confirming, 600, "a checkpoint of a confirmation trial", log)
        assert _command(env, "stop", str(path)).returncode == 0
        assert first.wait(timeout=120) == 130, tail(log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first.pid, signal.SIGKILL)
    assert _sweep(root, env, spec).wait(timeout=600) == 0, tail(log)
    path.write_text(yaml.safe_dump(spec))
    third = subprocess.Popen(
        [sys.executable, "-m", "flows.sweep", str(path), "--register"],
        env=env,
        cwd=REPO,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    assert third.wait(timeout=600) == 0, tail(log)

    confirmation = optuna.load_study(study_name=f"{name}.confirm", storage=_study(root, name)._storage)
    trials = confirmation.get_trials()
    done = [(t.user_attrs["key"], t.user_attrs["seed"]) for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == len(set(done)) == 4  # base and trial-0, seeds 1 and 2, each once
    assert [t.user_attrs["ended"] for t in trials if t.state == TrialState.FAIL] == ["sweep stopped"]
    assert len(trials) == 5 and all("key" in t.user_attrs for t in trials)
    text = log.read_text()
    assert "confirmation: 2 configurations x 2 seeds (4 of 4 finished)" in text
    assert text.count("confirmation over seeds [1, 2]") == 2  # the rerun's verdict, then the same once more
    assert "nothing registered" in text or "registered: models:/" in text
    runs = [r.info.run_name for r in _runs(env) if r.info.run_name.startswith(f"{name}-confirm-")]
    assert len(runs) == len(set(runs)) == 4  # the stopped trial's run continued, not a second one


def _checkpointed_like(root: Path, name: str, pattern: str) -> bool:
    """Whether a trial whose label matches `pattern` has written a checkpoint."""
    if not (root / "home" / "sweeps" / name / "optuna.journal").is_file():
        return False
    try:
        return any(_trials_dir(root, name).glob(f"{pattern}/run/step_*"))
    except KeyError:  # the study, or its id, not written yet
        return False
