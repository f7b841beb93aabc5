"""The `remote-train` flow: training alone, deployed on the GPU pool for split placement.

The `pretrain` flow (with `placement="deployment"`) prepares data where it runs, then starts this flow
through `run_deployment`, passing only references (paths relative to each side's LLAMAFLOW_HOME) and the
MLflow run id. The CheckpointRef travels back as a small JSON file in the run directory when both sides
share it, else through the MLflow run's artifacts (flows/pool/handoff.py); no Prefect result storage is needed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

from flows.pool import handoff, nodes
from model.atomic import write_text_atomic
from tasks import home
from tasks.home import apply_embedded_defaults
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.tracking import store
from tasks.train import train_task
from tasks.training import TrainSettings

RESULT_FILE = "remote_train_result.json"
# A flow run that has not ended after this long fails (Prefect's flow timeout), so a hung run cannot hold
# its pool's concurrency slot forever: the nightly's limit of 1 would otherwise skip every later night.
# A day by default; set LLAMAFLOW_FLOW_TIMEOUT_S in the worker's environment (or a deployment's `env` job
# variable) for longer runs. Read when the flow module is imported, i.e. in each flow-run process.
FLOW_TIMEOUT_S = float(os.environ.get("LLAMAFLOW_FLOW_TIMEOUT_S") or 24 * 3600)


class SharedStorageError(RuntimeError):
    """The train flow cannot see what the pretrain flow prepared."""


def write_result(checkpoint: CheckpointRef, run_dir: str | Path, flow_run_id: str) -> Path:
    """Write the CheckpointRef beside the checkpoints, atomically (a reader never sees half a file)."""
    payload = {"flow_run_id": flow_run_id, "checkpoint": checkpoint.model_dump(mode="json")}
    return write_text_atomic(Path(run_dir) / RESULT_FILE, json.dumps(payload))


def read_result(run_dir: str | Path, flow_run_id: str) -> CheckpointRef:
    """The CheckpointRef written by train flow run `flow_run_id`; a clear error if it is missing or stale."""
    source = Path(run_dir) / RESULT_FILE
    if not source.is_file():
        raise SharedStorageError(
            f"the train flow run {flow_run_id} completed but {source} does not exist here: the worker "
            "must write checkpoints to storage this flow can read (same LLAMAFLOW_HOME / checkpoint_dir "
            "path on a shared filesystem)"
        )
    payload = json.loads(source.read_text())
    if payload.get("flow_run_id") != flow_run_id:
        raise SharedStorageError(
            f"{source} was written by flow run {payload.get('flow_run_id')}, not by {flow_run_id}: "
            "two runs share one checkpoint_dir; give each run its own"
        )
    return CheckpointRef.model_validate(payload["checkpoint"])


def resolve_tracking_uri(given: str | None) -> str | None:
    """The store the parent opened the run in. The parent passes it with its credentials redacted (Prefect
    stores and shows flow-run parameters); this worker's own MLFLOW_TRACKING_URI supplies them."""
    own = os.environ.get("MLFLOW_TRACKING_URI")
    if given is None or "***" not in given:
        return given or own
    if own and store.redact_uri(own) == given:
        return own
    raise SharedStorageError(
        f"the pretrain flow's MLflow store is {given}; its credentials never travel as a parameter. Set "
        "MLFLOW_TRACKING_URI, with them, in this worker's environment (the work pool's job variables, or "
        "the worker's service definition), or put them in MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD "
        "beside a URI without them"
    )


@contextmanager
def _tracking_uri(uri: str | None) -> Iterator[None]:
    """Metrics go to the store the parent opened the run in, whatever this worker's default is."""
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous


def _check_inputs(
    model: ModelRef, dataset: DatasetRef, run_id: str | None, tracking_uri: str | None
) -> list[str]:
    """Fail in seconds, before any compile, when this machine cannot get the parent's inputs.

    Inputs missing here are fetched from the MLflow run's artifacts when the store is a server (the
    pretrain flow handed them off there); returns what was fetched.
    """
    tracking_uri = tracking_uri or home.tracking_uri()
    if run_id is not None:
        try:
            store.run_status(run_id, tracking_uri)
        except Exception as err:  # MLflow raises its own exception types per store
            raise SharedStorageError(
                f"MLflow run {run_id} is not in the tracking store {store.redact_uri(tracking_uri)}: the worker "
                "must reach the pretrain flow's store (an MLflow server both can reach; MLFLOW_TRACKING_URI): "
                f"{store.redact_error(err, tracking_uri)}"
            ) from err
    missing = [p for p in (Path(model.path), Path(dataset.path)) if not p.exists()]
    if not missing:
        return []
    if run_id is not None and handoff.through_server(tracking_uri):
        return handoff.fetch_inputs(run_id, model, dataset, tracking_uri)
    raise SharedStorageError(
        f"{', '.join(map(str, missing))} not found on this worker: without an MLflow tracking server to hand "
        "them over, the pretrain flow and the train deployment must share storage (LLAMAFLOW_HOME on a "
        "shared mount on both)"
    )


@flow(name="remote-train", log_prints=True, validate_parameters=True, timeout_seconds=FLOW_TIMEOUT_S)
def remote_train(
    model: ModelRef,
    dataset: DatasetRef,
    settings: TrainSettings,
    run_dir: str,
    run_id: str | None = None,
    tracking_uri: str | None = None,
    retries: int = 1,
    node: int = 0,
    node0_flow_run: str | None = None,
) -> CheckpointRef:
    """Train `model` on `dataset` in `run_dir` (under `$LLAMAFLOW_HOME`: this worker's home); retries resume
    from the newest checkpoint there. Inputs this worker lacks come from the MLflow run (flows/pool/handoff.py).

    With `settings.nnodes > 1` this is node `node` of the job (flows/pool/nodes.py): node 0 publishes the
    rendezvous, sends the metrics to MLflow and hands the result back; node k meets it through
    `node0_flow_run`, node 0's flow run."""
    apply_embedded_defaults()
    tracking_uri = resolve_tracking_uri(tracking_uri)
    run_dir = home.local(run_dir)  # `$LLAMAFLOW_HOME/runs/...`: in this worker's home
    ctx = FlowRunContext.get()
    flow_run_id = str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else "local"
    if settings.nnodes > 1:
        settings = settings.model_copy(update={"node_rank": node})  # node 0 hosts the rendezvous store
        if node != 0 and node0_flow_run is None:
            raise nodes.NodeError(
                f"node {node} of {settings.nnodes} needs node0_flow_run (node 0's flow run id)"
            )
        if node != 0:  # before any download: a node that does not share node 0's storage is refused first
            settings = nodes.join_rendezvous(settings, run_dir, model, dataset, node, node0_flow_run)
    fetched = _check_inputs(model, dataset, run_id, tracking_uri)
    if fetched:
        get_run_logger().info(f"fetched {' and '.join(fetched)} from MLflow run {run_id} (no shared disk)")
    if settings.nnodes > 1 and node == 0:
        settings = nodes.open_rendezvous(settings, run_dir, model, dataset, flow_run_id)
    with _tracking_uri(tracking_uri):
        checkpoint = train_task.with_options(retries=retries)(
            model, dataset, settings, run_dir, run_id=run_id if node == 0 else None
        )
    if node != 0:
        get_run_logger().info(f"node {node}: training ended at step {checkpoint.step}")
        return checkpoint
    where = write_result(checkpoint, run_dir, flow_run_id)
    uri = tracking_uri or home.tracking_uri()
    if run_id is not None and handoff.through_server(uri) and not handoff.parent_sees(run_dir):
        handoff.publish_result(run_id, checkpoint, flow_run_id, uri)  # the pretrain flow cannot see this disk
    get_run_logger().info(f"checkpoint of step {checkpoint.step} at {checkpoint.path}; reference in {where}")
    return checkpoint
