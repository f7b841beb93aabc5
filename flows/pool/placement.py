"""Where the train task runs: in this flow run (default), or as a separate deployment on the GPU pool.

`placement="deployment"` keeps the data stages where the `pretrain` flow runs and starts the
`remote-train` flow (flows/pool/remote_train.py) through `run_deployment`. Only references cross: paths relative
to each side's LLAMAFLOW_HOME, the MLflow run id and the tracking URI without its credentials. With an MLflow server, the inputs and the
final checkpoint travel as the run's artifacts when the two sides do not share a disk (flows/pool/handoff.py);
with a SQLite store they must share LLAMAFLOW_HOME. docs/production.md explains the set-up.

The wait for the training run is bounded: when it has not ended in time, it is cancelled (so it frees its
pool's slot) and this run fails. With `nnodes > 1` the deployment runs once per node (flows/pool/nodes.py).
"""

from __future__ import annotations

from flows.pool import handoff, nodes
from flows.pool.remote_train import FLOW_TIMEOUT_S, SharedStorageError, read_result
from flows.pretrain_config import PretrainConfig
from tasks import home
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.tracking.store import redact_uri
from tasks.train import train_task
from tasks.training import TrainSettings
from tasks.training.budget import BudgetTerms


class PlacementError(RuntimeError):
    """The training deployment cannot be used."""


def check_placement(config: PretrainConfig) -> None:
    """Fail before the data stages when `placement="deployment"` names a deployment the API lacks, or when
    several nodes have no way to meet."""
    if config.placement != "deployment":
        if config.nnodes > 1 and config.rdzv_endpoint is None:
            raise PlacementError(
                f"nnodes={config.nnodes} with placement='local' needs rdzv_endpoint (host:port of the node that "
                "hosts the rendezvous, e.g. a SLURM head node; the other nodes run torchrun with the same "
                "endpoint and rdzv_id, see docs/production.md), or placement='deployment' to start one train run "
                "per node on the pool"
            )
        return
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(config.train_deployment)
        except ObjectNotFound as err:
            raise _missing(config.train_deployment, str(client.api_url)) from err


def _missing(deployment: str, api_url: str) -> PlacementError:
    return PlacementError(
        f"placement='deployment' but deployment {deployment!r} does not exist on the Prefect API "
        f"{redact_uri(api_url)}: deploy it (`prefect --no-prompt deploy --name gpu` in the project "
        "directory) and point PREFECT_API_URL at that server, or use placement='local'"
    )


def train_where_placed(
    config: PretrainConfig,
    model: ModelRef,
    dataset: DatasetRef,
    run_dir: str,
    run_id: str,
    budget: BudgetTerms | None = None,
) -> CheckpointRef:
    """Train where `config.placement` says; a retry resumes from the newest checkpoint in `run_dir`.
    `budget`: the flow's time budget terms for a local run (a deployment's budget covers its training).

    A stop (cancellation, SIGTERM, Ctrl-C) is not retried: training checkpoints and the run ends.
    """
    settings = config.train_settings()
    if config.placement == "local":
        return train_task.with_options(retries=config.train_retries)(
            model, dataset, settings, run_dir, run_id=run_id, budget=budget
        )
    return train_on_deployment(
        config.train_deployment,
        model,
        dataset,
        settings,
        run_dir,
        run_id=run_id,
        retries=config.train_retries,
    )


def deployment_parameters(
    model: ModelRef,
    dataset: DatasetRef,
    settings: TrainSettings,
    run_dir: str,
    *,
    run_id: str | None,
    retries: int,
) -> dict[str, object]:
    """The remote-train flow run's parameters. Prefect stores and shows parameters, so the MLflow store
    goes without its credentials (the worker's environment supplies them, see flows/pool/remote_train.py)."""
    return {
        "model": model,
        "dataset": dataset,
        "settings": settings,
        "run_dir": home.portable(run_dir),  # under the home: the training worker's own
        "run_id": run_id,
        "tracking_uri": redact_uri(home.tracking_uri()),
        "retries": retries,
    }


def train_on_deployment(
    deployment: str,
    model: ModelRef,
    dataset: DatasetRef,
    settings: TrainSettings,
    run_dir: str,
    *,
    run_id: str | None,
    retries: int,
    timeout_s: float | None = None,
) -> CheckpointRef:
    """Run deployment `deployment` (FLOW/NAME of the `remote-train` flow), wait for it, return its CheckpointRef.
    With `settings.nnodes > 1` it runs once per node, and `retries` retries the whole group (flows/pool/nodes.py)."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    if settings.nnodes > 1 and settings.rdzv_id is None and run_id is not None:
        settings = settings.model_copy(update={"rdzv_id": run_id})  # the nodes' rendezvous: the MLflow run's
    parameters = deployment_parameters(model, dataset, settings, run_dir, run_id=run_id, retries=retries)
    uri = home.tracking_uri()
    handoff.mark_run_dir(run_dir)
    if run_id is not None and handoff.through_server(uri):
        handoff.publish_inputs(run_id, model, dataset, uri)
    wait_s = timeout_s if timeout_s is not None else _time_left_s()
    # As a subflow of this run: the UI shows it under the pretrain run, and its state is awaited here.
    try:
        if settings.nnodes > 1:
            node0 = nodes.run_node_group(deployment, parameters, settings, retries=retries, wait_s=wait_s)
            return _result(run_dir, str(node0.id), run_id, uri)
        flow_run = run_deployment(deployment, parameters=parameters, timeout=wait_s, as_subflow=True)
    except ObjectNotFound as err:
        raise _missing(deployment, PREFECT_API_URL.value() or "(ephemeral)") from err
    except nodes.NodeError as err:
        raise PlacementError(str(err)) from err
    state = flow_run.state
    if state is None or not state.is_final():
        _cancel(flow_run.id)
        raise PlacementError(
            f"train deployment {deployment!r} flow run {flow_run.name} ({flow_run.id}) did not end within "
            f"{wait_s:.0f} s ({state.name if state is not None else 'no state'}); it was cancelled so that it "
            "frees its pool's slot. For longer runs raise LLAMAFLOW_FLOW_TIMEOUT_S on the workers"
        )
    if not state.is_completed():
        raise PlacementError(
            f"train deployment {deployment!r} flow run {flow_run.name} ({flow_run.id}) ended {state.name}: "
            f"{state.message or ''} (see that run's logs)"
        )
    return _result(run_dir, str(flow_run.id), run_id, uri)


def _result(run_dir: str, flow_run_id: str, run_id: str | None, uri: str) -> CheckpointRef:
    """The CheckpointRef the train flow run wrote beside the checkpoints, or handed back through MLflow."""
    try:
        return read_result(run_dir, flow_run_id)
    except SharedStorageError:
        handed = handoff.fetch_result(run_id, flow_run_id, uri) if run_id is not None else None
        if handed is None:
            raise
        return handed


def _time_left_s(margin_s: float = 600.0) -> float:
    """How long this flow run may still wait: its own timeout minus what it used, minus time to evaluate."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    started = ctx.flow_run.start_time if ctx is not None and ctx.flow_run is not None else None
    if started is None:
        return FLOW_TIMEOUT_S
    import datetime as dt

    used = (dt.datetime.now(dt.UTC) - started).total_seconds()
    return max(FLOW_TIMEOUT_S - used - margin_s, 60.0)


def _cancel(flow_run_id: object) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(message="the pretrain run stopped waiting for it"))
