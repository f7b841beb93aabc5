"""TrainSettings: the one definition of every training option.

The same typed object goes from the flow's config (`PretrainConfig` is a TrainSettings plus the other
stages' options) to the train task, a train deployment's parameter, the torchrun workers and each
checkpoint (`train_settings.json`). Plain values only, so it travels as JSON.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainSettings(BaseModel):
    """How to train. Steps are optimizer steps; one step consumes `micro_batch_size * accumulate_steps *
    nproc_per_node` packed blocks.

    Length of the run: `max_steps` when it is set; otherwise `ceil(epochs * steps_per_epoch)`, where the
    last step of each epoch takes whatever blocks are left (a smaller step).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward pass")
    accumulate_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step")
    max_steps: int | None = Field(
        None, ge=1, description="Optimizer steps; when set, it alone decides the run length"
    )
    epochs: float = Field(1.0, gt=0, description="Passes over the training blocks when max_steps is not set")

    lr: float = Field(3e-4, gt=0, description="Peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps")
    schedule: Literal["cosine", "wsd"] = Field("cosine", description="cosine, or warmup-stable-decay")
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: share of the post-warmup steps that decay"
    )
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay of the matmul weights")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(
        1.0, ge=0, description="Max global gradient norm; 0 disables clipping (the norm is logged)"
    )

    seed: int = Field(1337, description="Seeds data order, initialisation and sampling")
    compile: bool = Field(True, description="torch.compile the model (after any checkpoint is loaded)")
    dtype: Literal["bf16", "fp32"] = Field("bf16", description="Autocast precision")
    document_mask: bool = Field(
        False,
        description="Attention stays inside each document of a packed block (documents end with EOS)",
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    nproc_per_node: int = Field(1, ge=1, description="Data-parallel processes (torchrun) on this node")

    checkpoint_every: int = Field(
        0, ge=0, description="Optimizer steps between checkpoints (0 = at the end only)"
    )
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept in the run directory")
    log_every: int = Field(1, ge=1, description="Optimizer steps between logged metrics")
    max_time_s: float | None = Field(
        None, gt=0, description="Stop (after a checkpoint) once training ran this long"
    )

    @model_validator(mode="after")
    def _check(self) -> TrainSettings:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self
