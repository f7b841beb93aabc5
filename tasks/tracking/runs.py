"""Which MLflow run a flow run writes to: one flow run → one MLflow run, also across retries and reruns.

- A retry of a flow run finds the run it opened before by its `prefect.flow_run_id` tag.
- A rerun that resumes a checkpoint directory continues the run that wrote the checkpoints: the train
  task records the run id in the run directory (`mlflow_run.json`, beside the checkpoints; the engine
  itself knows nothing of MLflow).
- Otherwise a new run is created.
A continued run is set back to RUNNING; the sink then fills in what it missed and re-logs nothing.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import RunTag
from mlflow.exceptions import MlflowException

from model.atomic import write_text_atomic
from tasks.tracking import store
from tasks.tracking.code_version import code_version_tags

RUN_RECORD_FILE = "mlflow_run.json"
FLOW_RUN_TAG = "prefect.flow_run_id"


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
        tags["prefect.flow_run_url"] = str(flow_run.ui_url)
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
    client.update_run(run_id, status="RUNNING")
    # The latest flow run that wrote to it, and the code it ran.
    latest = {**code_version_tags(), **tags}
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in latest.items()], synchronous=True)
    return OpenedRun(run_id, continued)
