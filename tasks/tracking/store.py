"""The MLflow tracking store: checking it, its client, experiments, runs, params and dataset inputs.

Everything takes an explicit `run_id` and goes through `MlflowClient`, never the fluent "active run":
Prefect runs tasks in worker threads and torchrun ranks in other processes, where a global active run
would be the wrong one or none at all. Metrics during training go through `tasks.tracking.sink`; the
figures and tables of a finished run through `tasks.tracking.report`; model logging and the registry
live in `tasks.register` and `tasks.lookup`.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Dataset, DatasetInput, InputTag, Param
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from tasks import home
from tasks.refs import DatasetRef

_TRUNCATION_MARK = "...[truncated]"
_TERMINAL_STATUSES = {"FINISHED", "FAILED", "KILLED"}


class TrackingStoreUnavailable(RuntimeError):
    """The MLflow tracking store cannot be reached or used."""


# --------------------------------------------------------------------------------------------------
# Store and client


def _is_http(uri: str) -> bool:
    return urllib.parse.urlparse(uri).scheme in ("http", "https")


def check_tracking_store(uri: str | None = None, timeout_s: float = 3.0) -> str:
    """Fail within `timeout_s` if the tracking store at `uri` is unusable; return the resolved URI.

    An HTTP server is probed on `/health` directly, because MlflowClient's own retry loop would
    take minutes to give up on a closed port.
    """
    uri = uri or home.tracking_uri()
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout_s) as response:
                if response.status != 200:
                    raise TrackingStoreUnavailable(
                        f"MLflow tracking server at {uri} answered /health with HTTP {response.status}."
                    )
        except (urllib.error.URLError, OSError) as exc:
            raise TrackingStoreUnavailable(
                f"MLflow tracking server at {uri} is not reachable ({exc}). Start it "
                f"(e.g. `mlflow server --host {parsed.hostname} --port {parsed.port or 5000} "
                f"--backend-store-uri sqlite:///<abs path>/mlflow.db`), or unset MLFLOW_TRACKING_URI "
                f"to use the embedded SQLite store (sqlite:///{home.mlruns_dir() / 'mlflow.db'})."
            ) from exc
    elif parsed.scheme == "sqlite":
        db_path = uri[len("sqlite:///") :]
        if not db_path or not os.path.isabs(db_path):
            raise TrackingStoreUnavailable(
                f"Tracking URI {uri} is not an absolute SQLite path; workers in other directories "
                "would each open another database. Use sqlite:////absolute/path/mlflow.db."
            )
        try:
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrackingStoreUnavailable(
                f"Cannot create the directory of the SQLite tracking store {uri}: {exc}. "
                "Point MLFLOW_TRACKING_URI (or LLAMAFLOW_MLRUNS) at a writable place."
            ) from exc
    elif parsed.scheme in ("", "file"):
        raise TrackingStoreUnavailable(
            f"Tracking URI {uri} is a file store, which MLflow 3 keeps in maintenance mode. "
            "Use sqlite:////absolute/path/mlflow.db, an http(s) server, or unset MLFLOW_TRACKING_URI."
        )
    return uri


def use_tracking_uri(uri: str | None = None) -> str:
    """Check the store and point MLflow's process-wide tracking and registry URIs at it.

    Only model logging and `models:/` downloads need the process-wide URI; they have no client form.
    """
    uri = check_tracking_store(uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def get_client(uri: str | None = None) -> MlflowClient:
    uri = uri or home.tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


# --------------------------------------------------------------------------------------------------
# Experiments and runs


def _artifact_location(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{home.artifact_root()}/{safe}"


def ensure_experiment(name: str, uri: str | None = None) -> str:
    """Return the id of experiment `name`, creating (or restoring) it if needed.

    On the embedded store the artifact location is pinned under `home.artifact_root()`, otherwise
    MLflow would put artifacts relative to whatever the current directory is. A server decides its own.
    """
    if not name or not name.strip():
        raise ValueError("Experiment name is empty; pass e.g. experiment='llamaflow'.")
    uri = uri or home.tracking_uri()
    client = get_client(uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id
    location = None if _is_http(uri) else _artifact_location(name)
    try:
        return client.create_experiment(name, artifact_location=location)
    except mlflow.exceptions.MlflowException as exc:
        # Another process created it between our lookup and our create.
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        del exc
        return experiment.experiment_id


def start_run(
    experiment: str,
    run_name: str | None = None,
    tags: Mapping[str, str] | None = None,
    uri: str | None = None,
) -> str:
    """Create a run in `experiment` (a name) and return its id; the run stays RUNNING until `end_run`."""
    from mlflow.tracking.context import registry as context_registry

    uri = check_tracking_store(uri)
    experiment_id = ensure_experiment(experiment, uri)
    resolved = context_registry.resolve_tags({k: str(v) for k, v in (tags or {}).items()})
    run = get_client(uri).create_run(experiment_id, run_name=run_name, tags=resolved)
    return run.info.run_id


def end_run(run_id: str, status: str = "FINISHED", uri: str | None = None) -> None:
    status = status.upper()
    if status not in _TERMINAL_STATUSES:
        raise ValueError(f"end_run status {status!r} is not one of {sorted(_TERMINAL_STATUSES)}.")
    get_client(uri).set_terminated(run_id, status=status)


def run_status(run_id: str, uri: str | None = None) -> str:
    return get_client(uri).get_run(run_id).info.status


def run_link(run_id: str, uri: str | None = None) -> str:
    """The UI address of a run on a server, else the command that opens the embedded store's UI."""
    uri = uri or home.tracking_uri()
    experiment_id = get_client(uri).get_run(run_id).info.experiment_id
    fragment = f"#/experiments/{experiment_id}/runs/{run_id}"
    if _is_http(uri):
        return f"{uri.rstrip('/')}/{fragment}"
    return f"mlflow ui --backend-store-uri {uri}  # then open http://127.0.0.1:5000/{fragment}"


# --------------------------------------------------------------------------------------------------
# Params, dataset inputs


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten nested mappings with dotted keys and turn values into strings MLflow accepts."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        full = f"{prefix}{key}"
        if hasattr(value, "model_dump"):
            value = value.model_dump()
        elif hasattr(value, "to_dict") and not isinstance(value, Mapping):
            value = value.to_dict()
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{full}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MAX_PARAM_VAL_LENGTH:
            text = text[: MAX_PARAM_VAL_LENGTH - len(_TRUNCATION_MARK)] + _TRUNCATION_MARK
        flat[full] = text
    return flat


def log_params(run_id: str, params: Mapping[str, Any], uri: str | None = None) -> dict[str, str]:
    """Log (nested) params in batches of MLflow's limit; returns what was logged."""
    flat = flatten_params(params)
    client = get_client(uri)
    items = [Param(k, v) for k, v in flat.items()]
    for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)
    return flat


def dataset_entity(dataset: DatasetRef) -> Dataset:
    """The packed dataset as an MLflow dataset: digest = fingerprint, profile = token counts."""
    path = Path(dataset.path)
    profile = {
        "fingerprint": dataset.fingerprint,
        "seq_len": dataset.seq_len,
        "vocab_size": dataset.vocab_size,
        "train_blocks": dataset.train_blocks,
        "val_blocks": dataset.val_blocks,
        "train_tokens": dataset.train_tokens,
        "val_tokens": dataset.val_tokens,
        **{f"stats.{k}": v for k, v in dataset.stats.items()},
    }
    schema = {
        "format": "llamaflow packed blocks",
        "files": ["train.npy", "val.npy", "meta.json", "tokenizer.json"],
        "shape": ["n_blocks", dataset.seq_len + 1],
    }
    return Dataset(
        name=f"{path.name}",
        digest=dataset.fingerprint[:MAX_DATASET_DIGEST_SIZE],
        source_type="local",
        source=json.dumps({"uri": path.resolve().as_uri()}),
        schema=json.dumps(schema),
        profile=json.dumps(profile),
    )


def log_dataset_input(
    run_id: str, dataset: DatasetRef, context: str = "training", uri: str | None = None
) -> None:
    tags = [InputTag(key="mlflow.data.context", value=context)]
    get_client(uri).log_inputs(run_id, datasets=[DatasetInput(dataset_entity(dataset), tags=tags)])
