"""Learning-rate schedules counted in optimizer steps, and the run length they are spread over."""

from __future__ import annotations

import math
from typing import Literal


def total_optimizer_steps(
    n_blocks: int,
    micro_batch_size: int,
    accumulate_steps: int,
    world_size: int,
    epochs: float,
    max_steps: int | None = None,
) -> int:
    """Optimizer steps of a run: `max_steps` when given, else `ceil(epochs * n_blocks / global_batch)`.

    Every step holds a whole global batch (an epoch's leftover blocks open the next step: see
    `tasks.training.loader`), so an epoch is `n_blocks / global_batch` steps, a fraction in general; the last
    step of a run set by epochs may take a few blocks of the next epoch.
    """
    if n_blocks <= 0:
        raise ValueError(
            "the training split holds no blocks; build the dataset from more text or a shorter seq_len"
        )
    if max_steps is not None:
        return max_steps
    per_epoch = steps_per_epoch(n_blocks, micro_batch_size * accumulate_steps * world_size)
    return max(1, math.ceil(epochs * per_epoch - 1e-9))


def steps_per_epoch(n_blocks: int, global_batch: int) -> float:
    return n_blocks / global_batch


def describe_run_length(
    total_steps: int,
    *,
    max_steps: int | None,
    epochs: float,
    n_blocks: int,
    global_batch: int,
    budget: str | None = None,
) -> str:
    """One sentence for the run summary: how many optimizer steps, and which setting decided it (`budget`:
    the plan's own sentence, `tasks.training.budget.BudgetPlan.describe`, when a time budget did)."""
    per_epoch = steps_per_epoch(n_blocks, global_batch)
    per_epoch_text = f"{per_epoch:,.3f}".rstrip("0").rstrip(".")
    data = f"{n_blocks:,} blocks, {global_batch} blocks per step, {per_epoch_text} steps per epoch"
    if budget is not None:
        return f"{budget} ({total_steps / per_epoch:.3g} epochs of {data})"
    if max_steps is not None:
        return (
            f"{total_steps} optimizer steps, set by max_steps={max_steps} (epochs={epochs:g} not used; "
            f"{total_steps / per_epoch:.3g} epochs of {data})"
        )
    return f"{total_steps} optimizer steps, set by epochs={epochs:g} ({data})"


def lr_at(
    step: int,
    *,
    lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    schedule: Literal["cosine", "wsd"] = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate of optimizer step `step` (0-based: the first update uses `lr_at(0)`).

    Warmup: `lr * (step + 1) / warmup_steps` for the first `warmup_steps` steps. Then
    cosine: from `lr` down to `min_lr_ratio * lr`, reached exactly at the last step `total_steps - 1`;
    wsd (warmup-stable-decay): `lr` until the last `decay_fraction` of the post-warmup steps, then linear
    down to `min_lr_ratio * lr` at the last step.
    Whenever a step follows the warmup, the last step is at the end value, even when it is the only
    one (`warmup_steps = total_steps - 1`, as the flow's preset clamp gives short runs).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    min_lr = lr * min_lr_ratio
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    after = total_steps - warmup_steps  # steps left after warmup
    if schedule == "cosine":
        progress = 1.0 if after <= 1 else min(1.0, (step - warmup_steps) / (after - 1))
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * after))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return lr + (min_lr - lr) * progress
    raise ValueError(f"unknown schedule {schedule!r}; use 'cosine' or 'wsd'")
