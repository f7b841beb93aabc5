"""Which MLflow run a flow run writes to: one flow run → one MLflow run, also across retries and reruns.

- A retry of a flow run finds the run it opened before by its `prefect.flow_run_id` tag.
- A rerun that resumes a checkpoint directory continues the run that wrote the checkpoints: the train
  task records the run id in the run directory (`mlflow_run.json`, beside the checkpoints; the engine
  itself knows nothing of MLflow).
- Otherwise a new run is created.
A continued run is set back to RUNNING; the sink then fills in what it missed and re-logs nothing.

A run outlives its flow run when the process dies with no chance to end it (kill -9, out of memory, a lost
machine). The flow's crash and cancellation hooks end it (`end_runs_of_flow_run`: Prefect runs them in
the worker once the flow-run process is gone), and every flow start ends the runs of its experiment whose
flow run is over (`end_runs_of_finished_flow_runs`), for the cases no hook ran (a lost worker, once Prefect
has marked its flow run Crashed).
"""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Run, RunTag
from mlflow.exceptions import MlflowException

from model.atomic import write_text_atomic
from tasks.tracking import store
from tasks.tracking.code_version import code_version_tags

RUN_RECORD_FILE = "mlflow_run.json"
FLOW_RUN_TAG = "prefect.flow_run_id"
# The status an MLflow run left RUNNING gets when its flow run is over.
STATUS_OF_FINAL_FLOW_RUN = {
    "COMPLETED": "FINISHED",
    "CANCELLED": "KILLED",
    "CRASHED": "FAILED",
    "FAILED": "FAILED",
}


@dataclass(frozen=True)
class OpenedRun:
    run_id: str
    continued: str | None  # why an existing run was continued ("flow run ...", "run directory ..."), or None


def flow_run_tags() -> dict[str, str]:
    """Tags that link an MLflow run to the Prefect flow run that made it (nothing outside a flow run)."""
    from prefect.runtime import deployment, flow_run
    from prefect.settings import PREFECT_UI_URL

    if flow_run.id is None:
        return {}
    tags = {FLOW_RUN_TAG: str(flow_run.id), "prefect.flow_run_name": str(flow_run.name)}
    if deployment.id is not None:
        tags["prefect.deployment_id"] = str(deployment.id)
    if PREFECT_UI_URL.value():  # none for the ephemeral API: its address dies with the process
        # Derived from PREFECT_API_URL, which may carry credentials (a worker started without them moved out)
        tags["prefect.flow_run_url"] = store.redact_uri(str(flow_run.ui_url))
    return tags


def write_run_record(run_dir: str | Path, run_id: str) -> None:
    """Keep the id of the MLflow run that trains in `run_dir` beside its checkpoints (not the store URI:
    it may hold credentials)."""
    path = Path(run_dir) / RUN_RECORD_FILE
    if read_run_record(run_dir) == run_id:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"run_id": run_id}))


def read_run_record(run_dir: str | Path) -> str | None:
    path = Path(run_dir) / RUN_RECORD_FILE
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (ValueError, KeyError, TypeError):
        return None


def _run_of_flow_run(experiment_id: str, flow_run_id: str, uri: str) -> str | None:
    found = store.get_client(uri).search_runs(
        [experiment_id],
        filter_string=f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    return found[0].info.run_id if found else None


def _run_in_store(run_id: str, experiment_id: str, uri: str) -> bool:
    try:
        run = store.get_client(uri).get_run(run_id)
    except MlflowException:
        return False
    return run.info.experiment_id == experiment_id and run.info.lifecycle_stage == "active"


def open_run(
    experiment: str,
    run_name: str | None = None,
    *,
    run_dir: str | Path | None = None,
    tags: Mapping[str, str] | None = None,
    uri: str | None = None,
) -> OpenedRun:
    """The run this flow run writes to: found again (retry, resumed run directory) or new."""
    uri = store.check_tracking_store(uri)
    tags = {k: str(v) for k, v in (tags or {}).items()}
    experiment_id = store.ensure_experiment(experiment, uri)
    continued: str | None = None
    run_id: str | None = None
    if tags.get(FLOW_RUN_TAG):
        run_id = _run_of_flow_run(experiment_id, tags[FLOW_RUN_TAG], uri)
        continued = f"flow run {tags[FLOW_RUN_TAG]}" if run_id else None
    if run_id is None and run_dir is not None and (recorded := read_run_record(run_dir)):
        if _run_in_store(recorded, experiment_id, uri):
            run_id, continued = recorded, f"run directory {run_dir}"
        else:
            warnings.warn(
                f"{Path(run_dir) / RUN_RECORD_FILE} names MLflow run {recorded}, which is not in this tracking "
                f"store's experiment {experiment!r}: the resumed training goes to a new run",
                RuntimeWarning,
                stacklevel=2,
            )
    if run_id is None:
        return OpenedRun(store.start_run(experiment, run_name, tags=tags, uri=uri), None)
    client = store.get_client(uri)
    # The latest flow run that writes to it (first: a sweep must never see it RUNNING with the tag of the
    # flow run that is over), and the code it runs.
    latest = {**code_version_tags(), **tags}
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in latest.items()], synchronous=True)
    client.update_run(run_id, status="RUNNING")
    return OpenedRun(run_id, continued)


def _running_runs(uri: str, experiment: str | None = None, flow_run_id: str | None = None) -> list[Run]:
    """RUNNING runs with a flow-run tag, in `experiment` (else in every experiment), of `flow_run_id`."""
    client = store.get_client(uri)
    if experiment is not None:
        found = client.get_experiment_by_name(experiment)
        experiment_ids = [] if found is None else [found.experiment_id]
    else:
        experiment_ids = [e.experiment_id for e in client.search_experiments(max_results=50_000)]
    if not experiment_ids:
        return []
    where = "attributes.status = 'RUNNING'"
    if flow_run_id is not None:
        where += f" and tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'"
    found_runs = client.search_runs(experiment_ids, filter_string=where, max_results=1000)
    return [run for run in found_runs if FLOW_RUN_TAG in run.data.tags]


def _end_if_still_of(run_id: str, flow_run_id: str, status: str, uri: str) -> bool:
    """End the run unless a new flow run continued it since it was found (open_run tags it first)."""
    run = store.get_client(uri).get_run(run_id)
    if run.info.status != "RUNNING" or run.data.tags.get(FLOW_RUN_TAG) != flow_run_id:
        return False
    store.end_run(run_id, status, uri)
    return True


def end_runs_of_flow_run(flow_run_id: str, status: str, uri: str | None = None) -> list[str]:
    """End with `status` the runs (of any experiment) that flow run `flow_run_id` left RUNNING; their ids."""
    uri = store.check_tracking_store(uri)
    found = [run.info.run_id for run in _running_runs(uri, flow_run_id=flow_run_id)]
    return [run_id for run_id in found if _end_if_still_of(run_id, flow_run_id, status, uri)]


def end_runs_hook(status: str) -> Callable[[Any, Any, Any], None]:
    """A flow's `on_crashed`/`on_cancellation` hook that ends the MLflow runs its flow run left RUNNING
    with `status`. After a kill -9 or a cancellation Prefect runs it in the worker, the flow run's process
    being gone (its environment holds the same store)."""

    def hook(flow: Any, flow_run: Any, state: Any) -> None:
        from prefect.logging import get_logger

        from tasks.home import apply_embedded_defaults

        apply_embedded_defaults()
        for run_id in end_runs_of_flow_run(str(flow_run.id), status):
            get_logger("llamaflow").info(f"MLflow run {run_id} ended {status}: its flow run is {state.name}")

    hook.__name__ = f"end_mlflow_runs_{status.lower()}"
    return hook


def end_runs_of_finished_flow_runs(experiment: str, uri: str | None = None) -> dict[str, str]:
    """End the runs of `experiment` left RUNNING by a flow run that is over (the Prefect API's state, read
    for every such run at once); returns run id → the status given. A flow run this Prefect API does not
    know (another server, a wiped ephemeral database) leaves its run alone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    uri = store.check_tracking_store(uri)
    by_flow_run: dict[uuid.UUID, list[str]] = {}
    for run in _running_runs(uri, experiment):
        try:
            flow_run_id = uuid.UUID(run.data.tags[FLOW_RUN_TAG])
        except ValueError:
            continue
        by_flow_run.setdefault(flow_run_id, []).append(run.info.run_id)
    if not by_flow_run:
        return {}
    with get_client(sync_client=True) as prefect:
        flow_runs = prefect.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(by_flow_run))), limit=len(by_flow_run)
        )
    ended: dict[str, str] = {}
    for flow_run in flow_runs:
        status = STATUS_OF_FINAL_FLOW_RUN.get(flow_run.state.type.value) if flow_run.state else None
        for run_id in by_flow_run[flow_run.id] if status else ():
            if _end_if_still_of(run_id, str(flow_run.id), status, uri):
                ended[run_id] = status
    return ended
