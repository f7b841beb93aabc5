"""Deployments, end to end: a real Prefect server, the deployments of the repository's prefect.yaml on a
process work pool, a real worker running the `pretrain` flow on the tiny preset.

prefect.yaml is first deployed as shipped, from a clean clone of a snapshot of this checkout (its build steps
find the commit and the remote; the deployments must pull that commit); then the same deployments are
deployed again to run from this checkout (`set_working_directory`, the development set-up), so each run
starts in seconds; tests/test_production_e2e.py runs the shipped pull steps (clone the commit, install it) on
a worker that shares nothing with the deployer. One server, pool, deployment and worker serve the whole
module; each test triggers its own flow runs through the API, as an operator or a schedule would.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterId,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import FlowRun
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.pool.placement import PlacementError, check_placement, train_on_deployment
from flows.pool.remote_train import RESULT_FILE, SharedStorageError, read_result, remote_train, write_result
from flows.pretrain_config import PretrainConfig
from prefect_server import (
    POOL,
    TINY_RUN,
    child_flow_runs,
    deploy_from_checkout,
    deployment_run_cli,
    flow_run_logs,
    git,
    idle_train_deployment,
    pool_server,
    prefect,
    prefect_worker,
    publish_snapshot,
    tail,
    wait_for_flow_run,
)
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training import TrainSettings

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 300


@dataclass
class Stack:
    api_url: str
    env: dict[str, str]
    worker_log: Path
    tracking_uri: str
    shipped: Shipped


@dataclass
class Shipped:
    """prefect.yaml's deployments as `prefect deploy --all` made them from a clean clone of `origin`."""

    deployments: dict[str, Any]
    origin: Path
    commit: str
    deployer: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("prefect-stack")
    with pool_server(root) as server:
        shipped = _deploy_as_shipped(root, server.env, server.api_url)
        deploy_from_checkout(root, server.env)
        worker_log = root / "worker.log"
        with prefect_worker(POOL, server.env, root, worker_log):
            yield Stack(server.api_url, server.env, worker_log, server.tracking_uri, shipped)


def _deploy_as_shipped(root: Path, env: dict[str, str], api_url: str) -> Shipped:
    """`prefect deploy --all` of the repository's own prefect.yaml, from a clone whose HEAD is pushed."""
    origin = publish_snapshot(root)
    deployer = root / "deployer"
    git(["clone", "-q", str(origin), str(deployer)], root)
    prefect(["--no-prompt", "deploy", "--all"], {**env, "PYTHONPATH": str(deployer)}, deployer)
    names = ("pretrain/nightly", "pretrain/adhoc", "remote-train/gpu")
    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        deployments = {name: client.read_deployment_by_name(name) for name in names}
    return Shipped(deployments, origin, git(["rev-parse", "HEAD"], deployer), deployer)


def _start(
    deployment: str, parameters: dict[str, Any], job_variables: dict[str, Any] | None = None
) -> FlowRun:
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        return client.create_flow_run_from_deployment(
            dep.id, parameters=parameters, job_variables=job_variables or {}
        )


def _finish(stack: Stack, deployment: str, config: dict[str, Any], **job_variables: Any) -> FlowRun:
    run = _start(deployment, {"config": config}, job_variables)
    return wait_for_flow_run(run.id, RUN_TIMEOUT_S, stack.worker_log)


def _run_from_cli(stack: Stack, config: dict[str, Any], **job_variables: Any) -> FlowRun:
    """The documented command: prefect deployment run 'pretrain/adhoc' --param config='{...}' --watch."""
    flow_run_id, _ = deployment_run_cli(
        "pretrain/adhoc",
        {"config": config},
        stack.env,
        REPO,
        job_variables=job_variables,
        timeout_s=RUN_TIMEOUT_S,
    )
    return wait_for_flow_run(flow_run_id, 30, stack.worker_log)


def _task_runs(flow_run_id: uuid.UUID) -> list:
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _run_dir(run: FlowRun) -> Path:
    """The flow's default checkpoint directory: one per flow run, under LLAMAFLOW_HOME (same for the worker)."""
    return Path(os.environ["LLAMAFLOW_HOME"]) / "runs" / str(run.id)


def _task_name(task_run: Any) -> str:
    """The task's own name: Prefect names its runs NAME-<counter>."""
    return task_run.name.rsplit("-", 1)[0]


def _mlflow_status(stack: Stack, flow_run_id: uuid.UUID, wait_s: float = 0.0) -> str:
    """The status of the MLflow run of a flow run of the tiny preset, once it is not RUNNING (or after
    `wait_s`: a hook in the worker may still be ending it)."""
    client = MlflowClient(stack.tracking_uri)
    experiment = client.get_experiment_by_name("llamaflow-tiny")
    deadline = time.monotonic() + wait_s
    while True:
        (run,) = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'"
        )
        if run.info.status != "RUNNING" or time.monotonic() > deadline:
            return run.info.status
        time.sleep(1.0)


def _explain(run: FlowRun, stack: Stack) -> str:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    lines = "\n".join(f"{log.level} {log.message}" for log in logs[-40:])
    return f"flow run {run.name} ended {run.state.name}: {run.state.message}\n{lines}\n{tail(stack.worker_log, 3000)}"


@pytest.mark.e2e
def test_prefect_yaml_deploys_schedules_pull_step_and_a_parameter_form(stack: Stack) -> None:
    shipped = stack.shipped
    nightly, adhoc, gpu = (
        shipped.deployments[name] for name in ("pretrain/nightly", "pretrain/adhoc", "remote-train/gpu")
    )

    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in nightly.schedules] == [
        ("0 2 * * *", "Europe/Berlin", True)
    ]
    assert nightly.global_concurrency_limit is not None and nightly.global_concurrency_limit.limit == 1
    assert nightly.concurrency_options is not None
    assert nightly.concurrency_options.collision_strategy.value == "CANCEL_NEW"
    assert adhoc.schedules == [] and adhoc.global_concurrency_limit is None
    for dep in (nightly, adhoc, gpu):
        assert dep.work_pool_name == POOL
        # A worker clones the deployed commit from the remote, then installs the clone: nothing of the
        # deployer's disk.
        (clone_step,), (install_step,) = (step.items() for step in dep.pull_steps)
        assert clone_step[0] == "prefect.deployments.steps.git_clone"
        assert clone_step[1]["repository"] == str(shipped.origin)
        assert clone_step[1]["commit_sha"] == shipped.commit
        assert install_step[0] == "prefect.deployments.steps.pip_install_requirements"
        assert install_step[1]["directory"] == "{{ " + clone_step[1]["id"] + ".directory }}"
        assert install_step[1]["requirements_file"] == "flows/pool/worker-requirements.txt"
        assert str(shipped.deployer) not in json.dumps(dep.model_dump(mode="json"))
    assert nightly.parameters == {"config": {"preset": "demo"}}

    # The form: the config parameter is the PretrainConfig model, every field with its default and help.
    schema = adhoc.parameter_openapi_schema
    assert list(schema["properties"]) == ["config"]
    fields = schema["definitions"]["PretrainConfig"]["properties"]
    assert fields["accumulate_steps"]["minimum"] == 1
    assert fields["placement"]["enum"] == ["local", "deployment"]
    assert fields["placement"]["default"] == "local"
    assert fields["train_retries"]["default"] == 1
    assert all(
        fields[name].get("description") for name in ("preset", "max_steps", "placement", "train_retries")
    )
    assert schema["definitions"]["PretrainConfig"]["additionalProperties"] is False
    assert set(gpu.parameter_openapi_schema["required"]) == {"model", "dataset", "settings", "run_dir"}


@pytest.mark.e2e
def test_invalid_parameters_are_rejected_before_any_task_runs(stack: Stack) -> None:
    # Field constraints are in the schema: the server refuses to create the run at all.
    for bad, problem in (
        ({"accumulate_steps": 0}, "accumulate_steps"),
        ({"no_such_field": 1}, "no_such_field"),
    ):
        with pytest.raises(Exception, match=problem):
            _start("pretrain/adhoc", {"config": {"preset": "tiny", **bad}})

    # Cross-field checks live in PretrainConfig's validators: the run starts and fails on its parameters.
    run = _finish(stack, "pretrain/adhoc", {"preset": "tiny", "max_steps": 5, "warmup_steps": 5})
    assert run.state.type.value == "FAILED", _explain(run, stack)
    assert "warmup_steps" in run.state.message
    assert _task_runs(run.id) == []


@pytest.mark.e2e
def test_adhoc_run_completes_with_artifacts_and_a_registered_version(stack: Stack) -> None:
    model_name = f"deploy-{uuid.uuid4().hex[:8]}"
    run = _run_from_cli(stack, {**TINY_RUN, "model_name": model_name})
    assert run.state.type.value == "COMPLETED", _explain(run, stack)

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    by_key = {a.key: a for a in artifacts if a.key}
    assert {"training-progress", "pretrain-summary"} <= set(by_key)
    assert by_key["training-progress"].data == pytest.approx(100.0)
    assert model_name in by_key["pretrain-summary"].data

    mlflow = MlflowClient(stack.tracking_uri, registry_uri=stack.tracking_uri)
    versions = mlflow.search_model_versions(f"name='{model_name}'")
    assert [str(v.version) for v in versions] == ["1"]
    assert str(mlflow.get_model_version_by_alias(model_name, "champion").version) == "1"
    trained = mlflow.get_metric_history(versions[0].run_id, "train/loss")
    assert sorted(m.step for m in trained) == list(range(1, TINY_RUN["max_steps"] + 1))
    # Checkpoints went to this flow run's own directory, so concurrent runs never share one.
    assert list(_run_dir(run).glob("step_*/model.safetensors"))


@pytest.mark.e2e
def test_crashed_training_is_retried_and_resumes_from_the_newest_checkpoint(stack: Stack) -> None:
    model_name = f"retry-{uuid.uuid4().hex[:8]}"
    # The crash hits before step 5 runs, after the checkpoint of step 4.
    fault = {"env": {"LLAMAFLOW_FAULT_INJECT": "crash_at_step=5"}}  # a job variable: this run only
    run = _run_from_cli(stack, {**TINY_RUN, "model_name": model_name, "train_retries": 1}, **fault)
    assert run.state.type.value == "COMPLETED", _explain(run, stack)

    (train,) = [t for t in _task_runs(run.id) if _task_name(t) == "train"]
    assert train.run_count == 2
    with get_client(sync_client=True) as client:
        history = [s.name for s in client.read_task_run_states(train.id)]
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    assert "AwaitingRetry" in history and history[-1] == "Completed"
    assert any("injected crash before step 5" in log.message for log in logs)
    assert (_run_dir(run) / ".fault-crash-at-5").exists()
    assert any("resuming from checkpoint" in log.message and "at step 4/" in log.message for log in logs)

    # Resumed, not restarted: every step reached MLflow exactly once.
    mlflow = MlflowClient(stack.tracking_uri, registry_uri=stack.tracking_uri)
    (version,) = mlflow.search_model_versions(f"name='{model_name}'")
    steps = [m.step for m in mlflow.get_metric_history(version.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, TINY_RUN["max_steps"] + 1))


@pytest.mark.e2e
def test_split_placement_trains_on_the_train_deployment(stack: Stack) -> None:
    model_name = f"split-{uuid.uuid4().hex[:8]}"
    config = {
        **TINY_RUN,
        "model_name": model_name,
        "placement": "deployment",
        "train_deployment": "remote-train/gpu",
    }
    run = _finish(stack, "pretrain/adhoc", config)
    assert run.state.type.value == "COMPLETED", _explain(run, stack)

    # Training ran as its own flow run of remote-train/gpu, linked under the pretrain run; data tasks did not.
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])),
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["gpu"])),
        )
    assert len(children) == 1 and children[0].state.type.value == "COMPLETED"
    child_tasks = {_task_name(t) for t in _task_runs(children[0].id)}
    parent_tasks = {_task_name(t) for t in _task_runs(run.id)}
    assert "train" in child_tasks and not child_tasks & {"train_tokenizer", "build_dataset"}
    assert "train" not in parent_tasks and {"train_tokenizer", "build_dataset"} <= parent_tasks
    # The child trained into the parent's run directory and handed its CheckpointRef back there.
    assert read_result(_run_dir(run), str(children[0].id)).step == TINY_RUN["max_steps"]

    mlflow = MlflowClient(stack.tracking_uri, registry_uri=stack.tracking_uri)
    (version,) = mlflow.search_model_versions(f"name='{model_name}'")
    steps = [m.step for m in mlflow.get_metric_history(version.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, TINY_RUN["max_steps"] + 1))


@pytest.mark.e2e
def test_cancelling_a_run_stops_training_at_a_checkpoint_and_does_not_retry(stack: Stack) -> None:
    run = _start("pretrain/adhoc", {"config": {**TINY_RUN, "max_steps": 500, "model_name": "cancelled"}})
    run_dir = _run_dir(run)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not list(run_dir.glob("step_*/model.safetensors")):
        assert time.monotonic() < deadline, f"no checkpoint after {RUN_TIMEOUT_S} s\n{tail(stack.worker_log)}"
        time.sleep(0.5)

    prefect(["flow-run", "cancel", str(run.id)], stack.env, REPO)
    cancelled_at = time.monotonic()
    run = wait_for_flow_run(run.id, 120, stack.worker_log)
    took_s = time.monotonic() - cancelled_at
    assert run.state.name == "Cancelled", _explain(run, stack)

    # SIGTERM made training stop after its step with a checkpoint; the retry policy did not restart it.
    (train,) = [t for t in _task_runs(run.id) if _task_name(t) == "train"]
    assert train.run_count == 1
    logs = flow_run_logs(run.id)
    stops = [m for m in logs if "training stopped by SIGTERM after step" in m]
    assert stops and not any("resuming from checkpoint" in m for m in logs)
    step = int(stops[0].split("after step ")[1].split(";")[0])
    assert (run_dir / f"step_{step:06d}" / "model.safetensors").is_file()
    # It exited on its own: Prefect's SIGKILL comes 30 s after SIGTERM.
    assert took_s < 30, f"cancellation took {took_s:.0f} s"
    assert _mlflow_status(stack, run.id) == "KILLED"


@pytest.mark.e2e
def test_a_flow_run_killed_with_sigkill_ends_its_mlflow_run(stack: Stack) -> None:
    """kill -9 (or the kernel's OOM killer) of the flow-run process: no code of it runs again. The worker
    marks the run Crashed and runs the flow's on_crashed hook, which ends the MLflow run."""
    fault = {"env": {"LLAMAFLOW_FAULT_INJECT": "kill_at_step=3"}}
    run = _start("pretrain/adhoc", {"config": {**TINY_RUN, "model_name": "killed"}}, fault)
    run = wait_for_flow_run(run.id, RUN_TIMEOUT_S, stack.worker_log)
    assert run.state.type.value == "CRASHED", _explain(run, stack)
    assert _mlflow_status(stack, run.id, wait_s=120) == "FAILED", tail(stack.worker_log)


@pytest.mark.e2e
def test_cancelling_a_split_placement_run_cancels_its_training_subflow(stack: Stack) -> None:
    config = {**TINY_RUN, "max_steps": 500, "model_name": "cancelled-split", "placement": "deployment"}
    run = _start("pretrain/adhoc", {"config": config})
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not list(_run_dir(run).glob("step_*/model.safetensors")):
        assert time.monotonic() < deadline, f"no checkpoint after {RUN_TIMEOUT_S} s\n{tail(stack.worker_log)}"
        time.sleep(0.5)

    prefect(["flow-run", "cancel", str(run.id)], stack.env, REPO)
    run = wait_for_flow_run(run.id, 120, stack.worker_log)
    assert run.state.name == "Cancelled", _explain(run, stack)
    (child,) = child_flow_runs(run.id)
    child = wait_for_flow_run(child.id, 120, stack.worker_log)
    assert child.state.name == "Cancelled", _explain(child, stack)
    (train,) = [t for t in _task_runs(child.id) if _task_name(t) == "train"]
    assert train.run_count == 1 and train.state.is_failed()
    logs = flow_run_logs(child.id)
    assert any("training stopped by SIGTERM after step" in m for m in logs)
    assert _mlflow_status(stack, run.id) == "KILLED"  # the pretrain run's, which the subflow trained in


@pytest.mark.e2e
def test_check_placement_names_a_missing_train_deployment(stack: Stack) -> None:
    check_placement(
        PretrainConfig(preset="tiny", placement="deployment", train_deployment="remote-train/gpu")
    )
    check_placement(PretrainConfig(preset="tiny", train_deployment="train/absent"))  # local: not looked up
    with pytest.raises(PlacementError, match="'train/absent' does not exist.*prefect --no-prompt deploy"):
        check_placement(
            PretrainConfig(preset="tiny", placement="deployment", train_deployment="train/absent")
        )


def _inputs_nowhere(tmp_path: Path) -> tuple[ModelRef, DatasetRef]:
    """References to a model and a dataset whose files do not exist (under `tmp_path`)."""
    model = ModelRef(path=str(tmp_path / "model"), fingerprint="m", n_params=1)
    dataset = DatasetRef(
        path=str(tmp_path / "data"),
        fingerprint="d",
        seq_len=64,
        vocab_size=2048,
        train_blocks=1,
        val_blocks=1,
        train_tokens=64,
        val_tokens=64,
    )
    return model, dataset


@pytest.mark.e2e
def test_a_training_run_that_does_not_end_in_time_is_cancelled_and_fails_the_wait(
    stack: Stack, tmp_path: Path
) -> None:
    idle = idle_train_deployment(stack.env)  # its run never starts
    model, dataset = _inputs_nowhere(tmp_path)
    with pytest.raises(PlacementError, match=r"did not end within 3 s \(Scheduled\); it was cancelled"):
        train_on_deployment(
            "remote-train/idle",
            model,
            dataset,
            TrainSettings(micro_batch_size=4),
            str(tmp_path / "run"),
            run_id=None,
            retries=0,
            timeout_s=3,
        )
    with get_client(sync_client=True) as client:
        (child,) = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[idle]))
        )
    assert child.state.type.value in ("CANCELLING", "CANCELLED")  # its pool slot is free again


def test_checkpoint_ref_round_trips_through_the_checkpoint_dir(tmp_path: Path) -> None:
    ref = CheckpointRef(
        path=str(tmp_path / "step_000008"),
        run_dir=str(tmp_path),
        step=8,
        tokens_seen=16384,
        metrics={"train/loss": 5.25},
    )
    write_result(ref, tmp_path, "run-a")
    assert read_result(tmp_path, "run-a") == ref
    assert [p.name for p in tmp_path.iterdir()] == [RESULT_FILE]  # no temporary file left behind

    with pytest.raises(SharedStorageError, match="written by flow run run-a, not by run-b"):
        read_result(tmp_path, "run-b")
    with pytest.raises(SharedStorageError, match="does not exist here.*shared filesystem"):
        read_result(tmp_path / "elsewhere", "run-a")


def test_train_flow_refuses_inputs_it_cannot_see_before_any_work(tmp_path: Path) -> None:
    """The train deployment on another machine: missing shared paths or bad settings fail in its first second."""
    model, dataset = _inputs_nowhere(tmp_path)
    settings, run_dir = TrainSettings(micro_batch_size=4), str(tmp_path / "ckpt")
    with pytest.raises(SharedStorageError, match=r"model, .*data not found on this worker.*LLAMAFLOW_HOME"):
        remote_train.fn(model, dataset, settings, run_dir)
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    elsewhere = f"sqlite:///{tmp_path / 'other-mlflow.db'}"
    with pytest.raises(SharedStorageError, match="MLflow run 0+ is not in the tracking store sqlite:///"):
        remote_train.fn(model, dataset, settings, run_dir, run_id="0" * 32, tracking_uri=elsewhere)
