"""Resuming a run: the newest valid checkpoint of a run directory, and the settings it must agree with."""

from __future__ import annotations

from pathlib import Path

from tasks.training import checkpoint as ckpt
from tasks.training.distributed import DistContext
from tasks.training.errors import TrainingError
from tasks.training.settings import TrainSettings

RESUME_MUST_MATCH = (
    "micro_batch_size",
    "accumulate_steps",
    "nproc_per_node",
    "epochs",
    "max_steps",
    "seed",
    "optimizer",
    "lr",
    "embed_lr",
    "head_lr",
    "scalar_lr",
    "muon_lr",
    "min_lr_ratio",
    "warmup_steps",
    "schedule",
    "decay_fraction",
)


def check_resume_settings(path: Path, settings: TrainSettings) -> None:
    saved = ckpt.read_json(path / ckpt.SETTINGS_FILE)
    now = settings.model_dump(mode="json")
    differ = {k: (saved.get(k), now[k]) for k in RESUME_MUST_MATCH if saved.get(k) != now[k]}
    if differ:
        raise TrainingError(
            f"checkpoint {path} was written with different settings {differ} (saved, now); these fix the data "
            "order and the schedule, so resume with the saved values or use a new checkpoint_dir"
        )


def find_resume(run_dir: Path, dist: DistContext) -> Path | None:
    found = None
    if dist.is_main:
        ckpt.remove_partial_checkpoints(run_dir)
        found = ckpt.newest_valid_checkpoint(run_dir)
    found = dist.broadcast_object(None if found is None else str(found))
    return None if found is None else Path(found)  # type: ignore[arg-type]
