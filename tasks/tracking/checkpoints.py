"""A run's checkpoints as MLflow 3 logged models: each evaluated checkpoint (the final one and those kept
before it) with its step, the original module's weights and config, and its validation metrics linked
(`val/bits_per_byte`, `val/loss` at its step, on the validation dataset), so the best of a run is

    mlflow.search_logged_models(
        experiment_ids=[run.info.experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND model_type = 'llamaflow-checkpoint'",
        order_by=[{"field_name": "metrics.val/bits_per_byte", "ascending": True}],
        max_results=1, output_format="list")[0]

The optimizer and RNG state stay in the run directory (resuming needs them, a model user does not).
Logging again (a flow-run retry) reuses the logged models already there, and finishes one that a crash left
unfinished (metrics logged, model not finalised) without logging its metrics a second time.
"""

from __future__ import annotations

import time
from pathlib import Path

from mlflow.entities import LoggedModel, LoggedModelStatus, Metric
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE

from model.weights import CONFIG_FILE, WEIGHTS_FILE
from tasks import home
from tasks.refs import CheckpointScore, DatasetRef, EvalResult
from tasks.tracking.store import get_client
from tasks.training.checkpoint_weights import whole_weights

MODEL_TYPE = "llamaflow-checkpoint"
TAG_CHECKPOINT = "llamaflow.checkpoint"


def model_name(step: int) -> str:
    return f"checkpoint-{step:06d}"


def _existing(client: MlflowClient, experiment_id: str, run_id: str) -> dict[str, LoggedModel]:
    """The run's checkpoint models by name: the finalised one, else the newest unfinished one."""
    found = client.search_logged_models(
        [experiment_id], filter_string=f"source_run_id = '{run_id}' AND model_type = '{MODEL_TYPE}'"
    )
    ranked = sorted(found, key=lambda m: (m.status == LoggedModelStatus.READY, m.creation_timestamp))
    return {m.name: m for m in ranked}  # the last one of each name wins


def _log_one(
    client: MlflowClient,
    experiment_id: str,
    run_id: str,
    score: CheckpointScore,
    dataset: DatasetRef,
    unfinished: LoggedModel | None,
) -> str:
    logged = unfinished or client.create_logged_model(
        experiment_id,
        name=model_name(score.step),
        source_run_id=run_id,
        params={"step": str(score.step)},
        tags={TAG_CHECKPOINT: home.portable(score.path)},
        model_type=MODEL_TYPE,
    )
    # Metrics an unfinished attempt already logged (linked to this model) are not logged again.
    logged_before = {(m.key, m.step) for m in client.get_logged_model(logged.model_id).metrics or []}
    try:
        whole_weights(Path(score.path))  # a sharded run's checkpoint: model.safetensors consolidated once
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            client.log_model_artifact(logged.model_id, str(Path(score.path) / name))
        now = int(time.time() * 1000)
        linked = {
            "model_id": logged.model_id,
            "dataset_name": f"{Path(dataset.path).name}/val",  # the run's validation input (store.log_datasets)
            "dataset_digest": dataset.fingerprint[:MAX_DATASET_DIGEST_SIZE],
        }
        metrics = [
            Metric("val/bits_per_byte", score.bits_per_byte, now, score.step, **linked),
            Metric("val/loss", score.val_loss, now, score.step, **linked),
        ]
        missing = [m for m in metrics if (m.key, m.step) not in logged_before]
        if missing:
            client.log_batch(run_id, metrics=missing)
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return logged.model_id


def log_checkpoint_models(
    run_id: str, evaluation: EvalResult, dataset: DatasetRef, uri: str | None = None
) -> dict[int, str]:
    """Log every scored checkpoint of `evaluation` as a logged model of `run_id`; returns step → model id."""
    client = get_client(uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    existing = _existing(client, experiment_id, run_id)
    ids = {}
    for score in evaluation.checkpoints:
        found = existing.get(model_name(score.step))
        if found is not None and found.status == LoggedModelStatus.READY:
            ids[score.step] = found.model_id
        else:
            ids[score.step] = _log_one(client, experiment_id, run_id, score, dataset, found)
    return ids
