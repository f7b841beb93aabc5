"""The MLflow tracking store: checking it, its client, experiments, runs, params and dataset inputs.

Everything takes an explicit `run_id` and store URI and goes through `MlflowClient`, never the fluent
"active run" or MLflow's process-wide tracking URI: Prefect runs tasks in worker threads and torchrun ranks
in other processes, where a global would be the wrong one or none at all, and a caller's own MLflow set-up
must not change behind its back. A tracking URI given with credentials loses them at the door
(`tasks.credentials`: `check_tracking_store` and `get_client` move them into MLflow's own variables), and
everything shown or stored (messages, params, tags) goes through `redact`. Finding a run again
(retries, resumed checkpoints) is `tasks.tracking.runs`; metrics during training `tasks.tracking.sink`;
what a finished run shows `tasks.tracking.report`.
"""

from __future__ import annotations

import json
import os
import urllib.parse
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import DatasetInput, InputTag, Param
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from tasks import home
from tasks.credentials import clean_uri, redact, redact_uri, remember_secret, split_userinfo
from tasks.data.packed import read_meta
from tasks.refs import DatasetRef
from tasks.tracking.code_version import code_version_tags

_TRUNCATION_MARK = "...[truncated]"
_TERMINAL_STATUSES = {"FINISHED", "FAILED", "KILLED"}


class TrackingStoreUnavailable(RuntimeError):
    """The MLflow tracking store cannot be reached or used."""


# --------------------------------------------------------------------------------------------------
# Store and client


def _is_http(uri: str) -> bool:
    return urllib.parse.urlparse(uri).scheme in ("http", "https")


def redact_error(error: BaseException, uri: str) -> str:
    """An exception's text (MLflow's quote the URL of a failed request) with the URI's secret taken out."""
    remember_secret(split_userinfo(uri)[2])
    return redact(str(error))


def probe_server(uri: str, timeout_s: float) -> None:
    """One authenticated request with MLflow's own REST client (its TLS, token and credential settings),
    a short timeout and no retries: MlflowClient's retry loop would take minutes on a closed port."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    shown = redact_uri(uri)
    try:
        response = http_request(
            get_default_host_creds(uri),
            "/api/2.0/mlflow/experiments/search",
            "POST",
            max_retries=0,
            # Connecting fails in seconds when nothing listens; the answer may take longer: an
            # authenticating server hashes a password it has not seen yet (seconds on a busy machine).
            timeout=(timeout_s, max(timeout_s, 60.0)),
            json={"max_results": 1},
        )
    except Exception as exc:  # MLflow wraps requests' connection, TLS and timeout errors in its own
        parsed = urllib.parse.urlparse(uri)
        tls = ""
        if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "SSLError" in str(exc):
            tls = (
                " Its TLS certificate is not trusted: point MLFLOW_TRACKING_SERVER_CERT_PATH at the CA bundle "
                "that signed it (or MLFLOW_TRACKING_INSECURE_TLS=true for a test server)."
            )
        raise TrackingStoreUnavailable(
            f"MLflow tracking server at {shown} is not reachable ({redact_error(exc, uri)}).{tls} Start it "
            f"(e.g. `mlflow server --host {parsed.hostname} --port {parsed.port or 5000} "
            f"--backend-store-uri sqlite:///<abs path>/mlflow.db`), or unset MLFLOW_TRACKING_URI "
            f"to use the embedded SQLite store (sqlite:///{home.mlruns_dir() / 'mlflow.db'})."
        ) from None
    if response.status_code in (401, 403):
        raise TrackingStoreUnavailable(
            f"MLflow tracking server at {shown} refused the credentials (HTTP {response.status_code}): set "
            "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN for that server."
        )
    if response.status_code != 200:
        raise TrackingStoreUnavailable(
            f"MLflow tracking server at {shown} answered HTTP {response.status_code} to a search request: "
            f"{response.text[:300]}"
        )


def check_tracking_store(uri: str | None = None, timeout_s: float = 5.0) -> str:
    """Fail within seconds if the tracking store at `uri` is unusable; return the resolved URI."""
    uri = clean_uri(uri or home.tracking_uri())
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        probe_server(uri, timeout_s)
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
            f"Tracking URI {redact_uri(uri)} is a file store, which MLflow 3 keeps in maintenance mode. "
            "Use sqlite:////absolute/path/mlflow.db, an http(s) server, or unset MLFLOW_TRACKING_URI."
        )
    return uri


def get_client(uri: str | None = None) -> MlflowClient:
    uri = clean_uri(uri or home.tracking_uri())
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


# --------------------------------------------------------------------------------------------------
# Experiments and runs


def _artifact_location(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{home.artifact_root()}/{safe}"


def ensure_experiment(name: str, uri: str | None = None) -> str:
    """Return the id of experiment `name`, creating (or restoring) it if needed.

    On the embedded store the artifact location is pinned under `home.artifact_root()`, otherwise
    MLflow would put artifacts relative to whatever the current directory is. A server decides its own
    (`mlflow-artifacts:` with its artifact proxy), so artifacts travel through it, not a shared disk.
    """
    if not name or not name.strip():
        raise ValueError("Experiment name is empty; pass e.g. experiment='llamaflow'.")
    uri = uri or home.tracking_uri()
    client = get_client(uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        if _is_http(uri) and experiment.artifact_location.startswith(("/", "file:")):
            warnings.warn(
                f"experiment {name!r} on the tracking server {redact_uri(uri)} keeps artifacts at "
                f"{experiment.artifact_location}, a path of one machine: other machines cannot read them. Use an "
                "experiment created through a server that serves artifacts (`mlflow server --serve-artifacts`)",
                RuntimeWarning,
                stacklevel=2,
            )
        return experiment.experiment_id
    location = None if _is_http(uri) else _artifact_location(name)
    try:
        return client.create_experiment(name, artifact_location=location)
    except mlflow.exceptions.MlflowException:
        # Another process created it between our lookup and our create.
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def start_run(
    experiment: str,
    run_name: str | None = None,
    tags: Mapping[str, str] | None = None,
    uri: str | None = None,
) -> str:
    """Create a run in `experiment` (a name) and return its id; the run stays RUNNING until `end_run`.

    Its tags say which code trained (`mlflow.source.git.commit` of this checkout, wherever the process
    was started from) besides MLflow's own context tags.
    """
    from mlflow.tracking.context import registry as context_registry

    uri = check_tracking_store(uri)
    experiment_id = ensure_experiment(experiment, uri)
    given = {**code_version_tags(), **{k: str(v) for k, v in (tags or {}).items()}}
    resolved = context_registry.resolve_tags(given)
    resolved.update(given)  # ours win over MLflow's guesses from sys.argv[0]
    # MLflow's guesses include the checkout's origin URL (`mlflow.source.git.repoURL`), a token and all
    resolved = {key: redact(value) for key, value in resolved.items()}
    run = get_client(uri).create_run(experiment_id, run_name=run_name, tags=resolved)
    return run.info.run_id


def end_run(run_id: str, status: str = "FINISHED", uri: str | None = None) -> None:
    status = status.upper()
    if status not in _TERMINAL_STATUSES:
        raise ValueError(f"end_run status {status!r} is not one of {sorted(_TERMINAL_STATUSES)}.")
    get_client(uri).set_terminated(run_id, status=status)


def run_status(run_id: str, uri: str | None = None) -> str:
    return get_client(uri).get_run(run_id).info.status


def run_url(run_id: str, uri: str | None = None) -> str:
    """The UI address of a run (credentials removed); on the embedded store, that of `mlflow ui`."""
    uri = uri or home.tracking_uri()
    experiment_id = get_client(uri).get_run(run_id).info.experiment_id
    fragment = f"#/experiments/{experiment_id}/runs/{run_id}"
    base = redact_uri(uri).rstrip("/") if _is_http(uri) else "http://127.0.0.1:5000"
    return f"{base}/{fragment}"


def run_link(run_id: str, uri: str | None = None) -> str:
    """The UI address of a run on a server, else the command that opens the embedded store's UI."""
    uri = uri or home.tracking_uri()
    if _is_http(uri):
        return run_url(run_id, uri)
    return f"mlflow ui --backend-store-uri {redact_uri(uri)}  # then open {run_url(run_id, uri)}"


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
        text = redact(value if isinstance(value, str) else json.dumps(value, default=str))
        if len(text) > MAX_PARAM_VAL_LENGTH:
            text = text[: MAX_PARAM_VAL_LENGTH - len(_TRUNCATION_MARK)] + _TRUNCATION_MARK
        flat[full] = text
    return flat


def log_params(run_id: str, params: Mapping[str, Any], uri: str | None = None) -> dict[str, str]:
    """Log (nested) params in batches of MLflow's limit; returns what was logged.

    MLflow params cannot change: on a continued run (retry, resumed checkpoint) the params it already has
    are kept, and a changed value is named in a warning instead of failing the run.
    """
    flat = flatten_params(params)
    client = get_client(uri)
    existing = client.get_run(run_id).data.params
    changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
    if changed:
        warnings.warn(
            f"MLflow run {run_id} continues with other values for {changed}; MLflow keeps a run's first "
            "params, so it still shows the earlier ones.",
            RuntimeWarning,
            stacklevel=2,
        )
    items = [Param(k, v) for k, v in flat.items() if k not in existing]
    for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)
    return {**flat, **{k: existing[k] for k in changed}}


def log_split(run_id: str, dataset: DatasetRef, uri: str | None = None) -> None:
    """The dataset's split manifest as an artifact of the run (a continued run carries it forward), and
    the documents its corpus dropped as duplicates as a metric."""
    from tasks.data.split import MANIFEST_NAME

    client = get_client(uri)
    manifest = Path(dataset.path) / MANIFEST_NAME
    if manifest.is_file():
        client.log_artifact(run_id, str(manifest))
    removed = dataset.stats.get("duplicates_removed")
    if removed is not None:
        client.log_metric(run_id, "data/duplicates_removed", float(removed), synchronous=True)


def log_datasets(run_id: str, dataset: DatasetRef, uri: str | None = None) -> None:
    """The packed training and validation splits as `mlflow.data` datasets of the run (contexts
    `training` and `validation`), digest = the dataset fingerprint, and a mixture's sources with their
    weights and token counts (`dataset_source.mixture_inputs`). Logged once per run."""
    import numpy as np
    from mlflow.data import from_numpy

    from tasks.tracking.dataset_source import PackedSplitSource, mixture_inputs

    client = get_client(uri)
    present = {(i.dataset.name, i.dataset.digest) for i in client.get_run(run_id).inputs.dataset_inputs or []}
    root = Path(dataset.path)
    inputs = []
    for split, context in (("train", "training"), ("val", "validation")):
        name, digest = f"{root.name}/{split}", dataset.fingerprint[:MAX_DATASET_DIGEST_SIZE]
        if (name, digest) in present:
            continue
        file = root / f"{split}.npy"
        blocks = np.load(file, mmap_mode="r", allow_pickle=False)
        source = PackedSplitSource.of(file, dataset.fingerprint)  # no path of this machine
        data = from_numpy(blocks, source=source, name=name, digest=digest)
        tags = [InputTag(key="mlflow.data.context", value=context)]
        inputs.append(DatasetInput(data._to_mlflow_entity(), tags=tags))
    mixture = mixture_inputs(root, read_meta(root).get("mixture", []))
    inputs += [i for i in mixture if (i.dataset.name, i.dataset.digest) not in present]
    if inputs:
        client.log_inputs(run_id, datasets=inputs)
