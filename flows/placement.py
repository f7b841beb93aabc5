"""Where the train task runs: in this flow run (default), or as a separate deployment on the GPU pool."""

from __future__ import annotations

from flows.config import PretrainConfig
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.train import train_task


def run_training(
    config: PretrainConfig, model: ModelRef, dataset: DatasetRef, checkpoint_dir: str, run_id: str
) -> CheckpointRef:
    """Train where `config.placement` says; a retry resumes from the newest checkpoint in `checkpoint_dir`."""
    return train_task.with_options(retries=config.train_retries)(
        model, dataset, config.train_settings(checkpoint_dir), run_id=run_id
    )
