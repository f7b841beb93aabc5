"""Resuming a run: the newest valid checkpoint of a run directory, and what must agree before it continues.

A resume continues the run the checkpoint belongs to, or it is refused: the settings that decide the data
order, the schedule and the optimizer's updates must be those it was written with, and so must the global
batch, the run length in optimizer steps and the dataset. How the global batch is split into ranks and
micro-batches may change (the loader's order does not depend on it), and so may everything else
(checkpointing, logging, compile, precision, device).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.training import checkpoint as ckpt
from tasks.training.distributed import DistContext
from tasks.training.errors import TrainingInputError
from tasks.training.settings import TrainSettings

# Optimizer hyperparameters among them: `Optimizer.load_state_dict` would silently put the checkpoint's
# values back in place of changed ones.
RESUME_MUST_MATCH = (
    "seed",
    "optimizer",
    "lr",
    "embed_lr",
    "head_lr",
    "scalar_lr",
    "muon_lr",
    "muon_momentum",
    "muon_ns_steps",
    "muon_weight_decay",
    "muon_adjust_lr",
    "min_lr_ratio",
    "warmup_steps",
    "schedule",
    "decay_fraction",
    "weight_decay",
    "betas",
    "eps",
    "grad_clip",
)


@dataclass(frozen=True)
class RunShape:
    """What a run is beyond its settings; saved in each checkpoint (`trainer_state["run"]`)."""

    total_steps: int
    micro_batch_size: int
    accumulate_steps: int
    world_size: int  # the processes actually training (torchrun's, whatever nproc_per_node says)
    dataset_fingerprint: str

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.accumulate_steps * self.world_size

    def batch_text(self) -> str:
        return f"{self.micro_batch_size} x {self.accumulate_steps} x {self.world_size} = {self.global_batch}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_resume(path: Path, state: dict[str, Any], settings: TrainSettings, shape: RunShape) -> None:
    """Raise TrainingInputError naming every setting that differs from checkpoint `path` and changes the run."""
    saved = ckpt.read_json(path / ckpt.SETTINGS_FILE)
    now = settings.model_dump(mode="json")
    problems = [
        f"{name}: checkpoint {saved.get(name)!r}, now {now[name]!r}"
        for name in RESUME_MUST_MATCH
        if saved.get(name) != now[name]
    ]
    run = state.get("run", {})
    if "world_size" in run:
        before = RunShape(**{k: run[k] for k in RunShape.__dataclass_fields__})
        if before.global_batch != shape.global_batch:
            problems.append(
                "global batch (micro_batch_size x accumulate_steps x ranks): checkpoint "
                f"{before.batch_text()}, now {shape.batch_text()}"
            )
        if before.dataset_fingerprint != shape.dataset_fingerprint:
            problems.append(
                f"dataset fingerprint: checkpoint {before.dataset_fingerprint}, now {shape.dataset_fingerprint} "
                "(the dataset was rebuilt, or another one given)"
            )
    if int(state["total_steps"]) != shape.total_steps:
        problems.append(f"total_steps: checkpoint {state['total_steps']}, now {shape.total_steps}")
    if problems:
        raise TrainingInputError(
            f"cannot resume {path} with these settings: {'; '.join(problems)}. They change the run (data "
            "order, schedule or updates): resume with the checkpoint's values, or train in a new checkpoint_dir"
        )


def find_resume(run_dir: Path, dist: DistContext) -> Path | None:
    if dist.is_main:
        ckpt.remove_partial_checkpoints(run_dir)
    dist.barrier()
    return ckpt.newest_valid_checkpoint(run_dir, dist)  # every rank checks its share of the files
