"""Split placement without a shared disk: the data stages' outputs go to the training worker, and its final
checkpoint comes back, as artifacts of the MLflow run on the tracking server (`mlflow-artifacts:`), the one
store both sides reach.

Artifacts of the run, under `handoff/`:
  model/      the initial weights (config.json, model.safetensors)          written by the pretrain flow
  dataset/    the packed dataset (train.npy, val.npy, meta.json, ...)        written by the pretrain flow
  result.json the CheckpointRef, metrics.jsonl and checkpoint/ (the final   written by remote-train when the
              checkpoint directory)                                          pretrain flow cannot see its disk
Each side fetches only what it cannot see at the ref's path (resolved against its own LLAMAFLOW_HOME), so
workers that do share a disk move nothing back. With a tracking store that is not a server (SQLite), both
sides must share the disk anyway, and nothing is handed off.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.parse
from pathlib import Path

from model.atomic import atomic_dir, write_text_atomic
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.tracking import store
from tasks.training.metrics import METRICS_FILE

PREFIX = "handoff"
RESULT = "result.json"
# Written by the pretrain flow into the run directory before it starts the train run: a train run that
# does not see it writes to a disk the pretrain flow cannot read, and hands its checkpoint back.
PARENT_MARK = ".pretrain-waits-here"


def mark_run_dir(run_dir: str) -> None:
    write_text_atomic(Path(run_dir) / PARENT_MARK, "the pretrain flow reads this run directory\n")


def parent_sees(run_dir: str) -> bool:
    return (Path(run_dir) / PARENT_MARK).is_file()


def through_server(uri: str) -> bool:
    """True when artifacts can travel through the tracking store (an MLflow server both sides reach)."""
    return urllib.parse.urlparse(uri).scheme in ("http", "https")


def publish_inputs(run_id: str, model: ModelRef, dataset: DatasetRef, uri: str) -> None:
    client = store.get_client(uri)
    client.log_artifacts(run_id, model.path, f"{PREFIX}/model")
    client.log_artifacts(run_id, dataset.path, f"{PREFIX}/dataset")


def _download(run_id: str, path: str, final: Path, uri: str) -> None:
    """Artifact directory `path` of the run into `final`, atomically (a reader never sees half of it)."""
    import mlflow

    with atomic_dir(final) as staged, tempfile.TemporaryDirectory(dir=staged.path.parent) as scratch:
        local = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=path, dst_path=scratch, tracking_uri=uri
        )
        for item in Path(local).iterdir():
            shutil.move(str(item), staged.path / item.name)


def fetch_inputs(run_id: str, model: ModelRef, dataset: DatasetRef, uri: str) -> list[str]:
    """Download the inputs this worker cannot see; returns what was fetched (empty: the disk is shared)."""
    fetched = []
    for name, ref, marker in (("model", model, "config.json"), ("dataset", dataset, "meta.json")):
        final = Path(ref.path)
        if not (final / marker).is_file():
            _download(run_id, f"{PREFIX}/{name}", final, uri)
            fetched.append(name)
    return fetched


def publish_result(run_id: str, checkpoint: CheckpointRef, flow_run_id: str, uri: str) -> None:
    client = store.get_client(uri)
    client.log_artifacts(run_id, checkpoint.path, f"{PREFIX}/checkpoint")
    metrics = Path(checkpoint.run_dir) / METRICS_FILE
    if metrics.is_file():
        client.log_artifact(run_id, str(metrics), PREFIX)
    payload = {"flow_run_id": flow_run_id, "checkpoint": checkpoint.model_dump(mode="json")}
    client.log_text(run_id, json.dumps(payload), f"{PREFIX}/{RESULT}")


def fetch_result(run_id: str, flow_run_id: str, uri: str) -> CheckpointRef | None:
    """The CheckpointRef the train flow run handed back, with its checkpoint downloaded here; None if none."""
    import mlflow

    with tempfile.TemporaryDirectory() as scratch:
        try:
            result, metrics_copy = (
                Path(
                    mlflow.artifacts.download_artifacts(
                        run_id=run_id, artifact_path=f"{PREFIX}/{name}", dst_path=scratch, tracking_uri=uri
                    )
                )
                for name in (RESULT, METRICS_FILE)
            )
        except Exception:  # MLflow raises per-store exception types for a missing artifact
            return None
        payload = json.loads(result.read_text())
        if payload.get("flow_run_id") != flow_run_id:
            return None
        checkpoint = CheckpointRef.model_validate(payload["checkpoint"])
        metrics = Path(checkpoint.run_dir) / METRICS_FILE
        if not metrics.is_file():
            write_text_atomic(metrics, metrics_copy.read_text())
    if not (Path(checkpoint.path) / "config.json").is_file():
        _download(run_id, f"{PREFIX}/checkpoint", Path(checkpoint.path), uri)
    return checkpoint
