"""Training settings: plain values only, so they travel as JSON to `torchrun` workers and into checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainSettings(BaseModel):
    """How to train. Steps are optimizer steps; one step consumes `micro_batch_size * accumulate_steps *
    nproc_per_node` packed blocks.

    Length of the run: `ceil(epochs * steps_per_epoch)` optimizer steps, where the last step of each epoch
    takes whatever blocks are left (a smaller step). When `max_steps` is also set, the run is the SHORTER
    of the two; `epochs=None` leaves `max_steps` alone in charge (as many epochs as it takes).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(gt=0)
    accumulate_steps: int = Field(default=1, gt=0)
    max_steps: int | None = Field(default=None, gt=0)
    epochs: float | None = Field(default=1.0, gt=0)

    lr: float = Field(default=3e-4, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = Field(
        default=0.2, gt=0, le=1, description="wsd: share of post-warmup steps that decay"
    )
    weight_decay: float = Field(default=0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables clipping; the norm is logged anyway")

    seed: int = 0
    compile: bool = True
    dtype: Literal["bf16", "fp32"] = "bf16"
    device: str = "auto"

    checkpoint_dir: str
    checkpoint_every: int = Field(default=0, ge=0, description="0 = only at the end")
    keep_checkpoints: int = Field(default=2, gt=0)

    log_every: int = Field(default=1, gt=0)
    nproc_per_node: int = Field(default=1, gt=0)
    max_time_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> TrainSettings:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set epochs, max_steps or both: with neither the run would never end")
        if not self.checkpoint_dir:
            raise ValueError("checkpoint_dir must be a directory path (it also decides where a run resumes)")
        return self
