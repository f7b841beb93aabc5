"""The one module that talks to MLflow for tracking: experiments, runs, params, metrics, artifacts.

Everything takes an explicit `run_id` and goes through `MlflowClient`, never the fluent "active run":
Prefect runs tasks in worker threads and torchrun ranks in other processes, where a global active run
would be the wrong one or none at all.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tasks import settings
from tasks.refs import DatasetRef

warnings.filterwarnings("ignore", message=r"The `*noload`* loader strategy is deprecated")

import mlflow  # noqa: E402
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from mlflow.utils.validation import (  # noqa: E402
    MAX_DATASET_DIGEST_SIZE,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

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
    uri = uri or settings.tracking_uri()
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
                f"to use the embedded SQLite store (sqlite:///{settings.mlruns_dir() / 'mlflow.db'})."
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
    uri = uri or settings.tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


# --------------------------------------------------------------------------------------------------
# Experiments and runs


def _artifact_location(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{settings.artifact_root()}/{safe}"


def ensure_experiment(name: str, uri: str | None = None) -> str:
    """Return the id of experiment `name`, creating (or restoring) it if needed.

    On the embedded store the artifact location is pinned under `settings.artifact_root()`, otherwise
    MLflow would put artifacts relative to whatever the current directory is. A server decides its own.
    """
    if not name or not name.strip():
        raise ValueError("Experiment name is empty; pass e.g. experiment='llamaflow'.")
    uri = uri or settings.tracking_uri()
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
    uri = uri or settings.tracking_uri()
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


# --------------------------------------------------------------------------------------------------
# Metrics


class MlflowSink:
    """Buffers per-step metrics and writes them with `log_batch`.

    One synchronous MLflow call per metric costs ~20 ms on SQLite and a round trip on a server; the
    sink flushes every `flush_every_steps` distinct steps or `flush_every_s` seconds, and on `close()`.
    A failed flush (store briefly unreachable) warns and keeps the metrics for the next one, so a
    tracking hiccup does not kill training; `close()` raises if they still cannot be written.
    Implements the trainer's logger interface: `log_metrics`, `log_params`, `log_artifact`, `close`.
    """

    max_buffered = 200_000

    def __init__(
        self,
        run_id: str,
        *,
        uri: str | None = None,
        flush_every_steps: int = 50,
        flush_every_s: float = 10.0,
    ) -> None:
        if flush_every_steps < 1:
            raise ValueError(f"flush_every_steps must be >= 1, got {flush_every_steps}.")
        self.run_id = run_id
        self.uri = check_tracking_store(uri)
        self._client = get_client(self.uri)
        try:
            self._client.get_run(run_id)
        except mlflow.exceptions.MlflowException as exc:
            raise ValueError(
                f"MLflow run {run_id!r} does not exist in {self.uri}; create it with tracking.start_run()."
            ) from exc
        self._flush_every_steps = flush_every_steps
        self._flush_every_s = flush_every_s
        self._buffer: list[Metric] = []
        self._steps_buffered: set[int] = set()
        self._new_since_flush = 0
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self.flushes = 0
        self.failed_flushes = 0
        self.dropped = 0
        self.last_error: Exception | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            raise RuntimeError(f"MlflowSink for run {self.run_id} is closed; create a new one.")
        timestamp = int(time.time() * 1000)
        entries = []
        for key, value in metrics.items():
            entries.append(Metric(key=key, value=float(value), timestamp=timestamp, step=int(step)))
        with self._lock:
            self._buffer.extend(entries)
            self._steps_buffered.add(int(step))
            self._new_since_flush += len(entries)
            due = (
                len(self._steps_buffered) >= self._flush_every_steps
                or time.monotonic() - self._last_flush >= self._flush_every_s
                or self._new_since_flush >= MAX_METRICS_PER_BATCH
            )
        if due:
            self.flush()

    def flush(self) -> bool:
        """Write everything buffered; False (with a warning, metrics kept) if the store refused."""
        with self._lock:
            pending, self._buffer = self._buffer, []
            self._steps_buffered = set()
            self._new_since_flush = 0
            self._last_flush = time.monotonic()
        sent = 0
        try:
            while sent < len(pending):
                chunk = pending[sent : sent + MAX_METRICS_PER_BATCH]
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)
                sent += len(chunk)
        except Exception as exc:  # any store failure: keep the metrics and let training go on
            with self._lock:
                self._buffer = pending[sent:] + self._buffer
                overflow = len(self._buffer) - self.max_buffered
                if overflow > 0:
                    del self._buffer[:overflow]
                    self.dropped += overflow
            self.failed_flushes += 1
            self.last_error = exc
            warnings.warn(
                f"MLflow did not take {len(pending) - sent} metrics for run {self.run_id} ({exc}); "
                f"{len(self._buffer)} kept for the next flush, {self.dropped} dropped so far.",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        if pending:
            self.flushes += 1
        return True

    def log_params(self, params: Mapping[str, Any]) -> None:
        log_params(self.run_id, params, uri=self.uri)

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        local = Path(path)
        if not local.exists():
            raise FileNotFoundError(f"Artifact {local} does not exist; nothing to log for run {self.run_id}.")
        if local.is_dir():
            self._client.log_artifacts(self.run_id, str(local), artifact_path)
        else:
            self._client.log_artifact(self.run_id, str(local), artifact_path)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.flush() or self.dropped:
            raise RuntimeError(
                f"{len(self._buffer)} metrics could not be written to MLflow run {self.run_id} at close "
                f"and {self.dropped} were dropped earlier; last error: {self.last_error}"
            )

    def __enter__(self) -> MlflowSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_system_metrics(
    run_id: str, sampling_interval_s: float = 10.0, uri: str | None = None
) -> Any | None:
    """Start MLflow's CPU/GPU/memory/disk sampler for `run_id` (needs psutil, a dependency).

    Returns the monitor; call `.finish()` on it when training ends.
    """
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # MLflow 3.17's monitor reads the process-wide URI in places even when given its own, so both are set:
    # a stale process-wide URI (another store, a stopped server) would stall it in HTTP retries.
    uri = use_tracking_uri(uri)
    monitor = SystemMetricsMonitor(run_id, sampling_interval=sampling_interval_s, tracking_uri=uri)
    monitor.start()
    return monitor


# --------------------------------------------------------------------------------------------------
# Curves and samples

_LOSS_KEYS = ("train/loss", "loss", "train_loss")
_VAL_KEYS = ("val/loss", "val_loss", "eval/loss")
_LR_KEYS = ("train/lr", "lr", "learning_rate")


def read_metrics_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                # A run killed mid-write leaves a partial last line; anything earlier is corruption.
                if number > 1 and not handle.read().strip():
                    break
                raise ValueError(f"{path}:{number} is not a JSON line: {exc}") from exc
    return rows


def metrics_by_step(rows: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Merge rows into one dict per step, in step order; a later row wins per key.

    Rows are flat (`{"step": 3, "train/loss": 2.1}`) or as the trainer's metrics.jsonl writes them
    (`{"step": 3, "metrics": {...}}`). A resumed run repeats the steps after its checkpoint; the
    repetition, written later, is the one kept.
    """
    merged: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "step" not in row:
            continue
        values = {k: v for k, v in row.items() if k not in ("step", "metrics")}
        nested = row.get("metrics")
        if isinstance(nested, Mapping):
            values.update(nested)
        merged.setdefault(int(row["step"]), {}).update(values)
    return dict(sorted(merged.items()))


def _series(by_step: Mapping[int, Mapping[str, Any]], keys: Sequence[str]) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for step, row in by_step.items():
        for key in keys:
            if row.get(key) is not None:
                steps.append(step)
                values.append(float(row[key]))
                break
    return steps, values


def training_curves_figure(history: Sequence[Mapping[str, Any]]) -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    by_step = metrics_by_step(history)
    loss_steps, loss = _series(by_step, _LOSS_KEYS)
    val_steps, val = _series(by_step, _VAL_KEYS)
    lr_steps, lr = _series(by_step, _LR_KEYS)
    if not loss and not val:
        raise ValueError(
            f"Metrics history has no loss values (looked for {_LOSS_KEYS + _VAL_KEYS} with a 'step'); "
            "pass rows like {'step': 10, 'train/loss': 3.2, 'lr': 1e-3}."
        )
    figure = Figure(figsize=(10, 4))
    ax_loss, ax_lr = figure.subplots(1, 2)
    if loss:
        ax_loss.plot(loss_steps, loss, label="train loss")
    if val:
        ax_loss.plot(val_steps, val, "o-", label="val loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if lr:
        ax_lr.plot(lr_steps, lr, color="tab:green")
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def log_training_curves(
    run_id: str,
    history: Sequence[Mapping[str, Any]] | str | os.PathLike[str],
    artifact_file: str = "loss_curve.png",
    uri: str | None = None,
) -> str:
    """Plot loss (and val loss) and LR against step; log the PNG as `artifact_file`."""
    rows = read_metrics_jsonl(history) if isinstance(history, str | os.PathLike) else list(history)
    figure = training_curves_figure(rows)
    get_client(uri).log_figure(run_id, figure, artifact_file)
    return artifact_file


def log_samples(
    run_id: str,
    samples: Sequence[tuple[str, str]] | Mapping[str, str],
    artifact_file: str = "samples.json",
    uri: str | None = None,
) -> str:
    """Log (prompt, completion) pairs as an MLflow table artifact (shown in the UI's evaluation view)."""
    pairs = list(samples.items()) if isinstance(samples, Mapping) else [tuple(s) for s in samples]
    if not pairs:
        raise ValueError("No samples to log; pass at least one (prompt, completion) pair.")
    data = {"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]}
    with warnings.catch_warnings():
        # MLflow's own select_dtypes(include=["object"]) call warns under pandas 3.
        warnings.filterwarnings("ignore", message=".*'str' dtypes are included by select_dtypes")
        get_client(uri).log_table(run_id, data=data, artifact_file=artifact_file)
    return artifact_file
