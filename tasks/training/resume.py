"""Resuming a run: the newest valid checkpoint of a run directory, and what must agree before it continues.

A resume continues the run the checkpoint belongs to, or it is refused. Each TrainSettings field says
how it bears on a resume (`OnResume`, tasks/training/settings.py): the MustMatch settings (data order,
loss, schedule, optimizer updates) must be those the checkpoint was written with; the InRunShape ones
may change as long as the global batch and the run length in optimizer steps stay the same (the
loader's order does not depend on how the batch is split into micro-batches and ranks, so a resume at
another world size with the same global batch continues the same run); the MayChange ones (compile,
precision, device, checkpointing, logging) are free, except a move between two bf16 recipes (FSDP2's
mixed precision on CUDA and autocast elsewhere train differently). The architecture (every LlamaConfig field of the
checkpoint's config.json) and the dataset must be the same too.

A checkpoint written before a setting or a config field existed holds no value for it: it was trained
as with the field's default, so the resume is allowed when the field is at its default now.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from model import LlamaConfig
from tasks.training import checkpoint as ckpt
from tasks.training.distributed import DistContext
from tasks.training.errors import TrainingInputError
from tasks.training.precision import FP32
from tasks.training.settings import RESUME_RULES, OnResume, TrainSettings

# Optimizer hyperparameters among them: `Optimizer.load_state_dict` would silently put the checkpoint's
# values back in place of changed ones.
RESUME_MUST_MATCH = tuple(name for name, rule in RESUME_RULES.items() if rule is OnResume.MUST_MATCH)


@dataclass(frozen=True)
class RunShape:
    """What a run is beyond its settings; saved in each checkpoint (`trainer_state["run"]`)."""

    total_steps: int
    micro_batch_size: int
    accumulate_steps: int
    world_size: int  # the processes actually training (torchrun's, whatever nproc_per_node says)
    dataset_fingerprint: str
    # The numerical recipe (tasks.training.precision); "" in checkpoints written before it was recorded.
    precision: str = ""

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.accumulate_steps * self.world_size

    def batch_text(self) -> str:
        return f"{self.micro_batch_size} x {self.accumulate_steps} x {self.world_size} = {self.global_batch}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_resume(
    path: Path, state: dict[str, Any], settings: TrainSettings, shape: RunShape, config: LlamaConfig
) -> None:
    """Raise TrainingInputError naming every setting, architecture field and run property that differs
    from checkpoint `path` and changes the run."""
    problems = settings_differences(ckpt.read_json(path / ckpt.SETTINGS_FILE), settings)
    problems += architecture_differences(ckpt.read_json(path / ckpt.CONFIG_FILE), config)
    run = state.get("run", {})
    if "world_size" in run:
        before = RunShape(**{k: run[k] for k in RunShape.__dataclass_fields__ if k in run})
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
        problems += precision_differences(before.precision, shape.precision)
    if int(state["total_steps"]) != shape.total_steps:
        problems.append(f"total_steps: checkpoint {state['total_steps']}, now {shape.total_steps}")
    if problems:
        raise TrainingInputError(
            f"cannot resume {path} with these settings: {'; '.join(problems)}. They change the run (model, data, "
            "schedule or updates): resume with the checkpoint's values, or train in a new checkpoint_dir"
        )


def precision_differences(before: str, now: str) -> list[str]:
    """A problem when the checkpoint and this run train under two different bf16 recipes (DDP's autocast
    and FSDP2's mixed precision on CUDA). A move to or from fp32 is a change of dtype, which is free."""
    if not before or before == now or FP32 in (before, now):
        return []
    return [
        f"bf16 recipe: checkpoint trained with {before}, this run would train with {now} (data_parallel "
        "fsdp on CUDA uses FSDP2's mixed precision, DDP and one process autocast); resume with the "
        "checkpoint's data_parallel on the same device type, or with dtype fp32, or start a new run from "
        "its weights with init_from"
    ]


def settings_differences(saved: dict[str, Any], settings: TrainSettings) -> list[str]:
    """`name: checkpoint X, now Y` for each MustMatch setting that differs from the checkpoint's
    `train_settings.json` (`saved`); a setting the checkpoint predates counts as its default there."""
    now = settings.model_dump(mode="json")
    defaults = TrainSettings.model_construct().model_dump(mode="json")
    problems = []
    for name in RESUME_MUST_MATCH:
        if name in saved:
            if saved[name] != now[name]:
                problems.append(f"{name}: checkpoint {saved[name]!r}, now {now[name]!r}")
        elif defaults[name] != now[name]:
            problems.append(
                f"{name}: checkpoint written before this setting existed (as its default {defaults[name]!r}), "
                f"now {now[name]!r}"
            )
    return problems


def architecture_differences(saved: dict[str, Any], config: LlamaConfig) -> list[str]:
    """`model config NAME: checkpoint X, now Y` for each LlamaConfig field that differs from the
    checkpoint's `config.json` (`saved`; fields it predates take their defaults, as when it is loaded)."""
    before, now = LlamaConfig.from_dict(saved).to_dict(), config.to_dict()
    return [
        f"model config {name}: checkpoint {before[name]!r}, now {now[name]!r}"
        for name in now
        if before.get(name) != now[name]
    ]


def find_resume(run_dir: Path, dist: DistContext) -> Path | None:
    """The checkpoint to resume from: None when the run directory holds none (a new run). Checkpoints that
    are all invalid stop the run (TrainingInputError): training from step 0 would overwrite them one by one
    as it reaches their steps, and a damaged disk or a bad copy is no reason to lose a run."""
    if dist.is_main:
        ckpt.remove_partial_checkpoints(run_dir)
    dist.barrier()
    problems: dict[Path, str] = {}
    found = ckpt.newest_valid_checkpoint(run_dir, dist, problems)  # every rank checks its share of the files
    if found is None and problems:
        each = "; ".join(f"{path.name}: {problem}" for path, problem in problems.items())
        raise TrainingInputError(
            f"{run_dir} holds {len(problems)} checkpoint(s) and none is valid ({each}), so nothing is "
            "trained: starting from step 0 would overwrite them. To resume, put back a good copy of one of "
            f"them. To start over on purpose, move them away (mkdir {run_dir}/invalid && mv {run_dir}/step_* "
            f"{run_dir}/invalid/), delete them, or train into another checkpoint_dir"
        )
    return found
