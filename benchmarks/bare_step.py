"""The bare compiled training step the engine is measured against, shared by the benchmark scripts.

It is the engine's step with nothing around it: the compiled `LossHead` (model + summed float32 token
loss) over each micro-batch under bf16 autocast, the summed losses divided by the step's target count
(exact accumulation), `clip_grad_norm_`, each optimizer part, `zero_grad(set_to_none=True)` and one
`loss.item()`. No loader, no logging, no checkpoint, no schedule.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tasks.training.loss import count_targets
from tasks.training.optim import TrainOptimizer

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class PhaseTimes:
    """Seconds per named phase of one step (CPU: every op is synchronous, so wall time is the phase's)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def forward_backward(
    step_fn: torch.nn.Module, batches: Batches, device_type: str = "cpu", autocast: bool = True
) -> torch.Tensor:
    """Backward of every micro-batch's summed loss over the step's target count; the last loss, unsynced.
    `autocast=False`: fp32 throughout (the engine's `dtype: fp32`)."""
    scale = 1.0 / count_targets([targets for _, targets in batches])
    for inputs, targets in batches:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            loss = step_fn(inputs, targets)
        (loss * scale).backward()
    return loss


def bare_step(
    step_fn: torch.nn.Module,
    params: list[torch.nn.Parameter],
    optimizer: TrainOptimizer,
    batches: Batches,
    grad_clip: float,
    times: PhaseTimes | None = None,
    autocast: bool = True,
) -> float:
    """One bare step (module docstring); with `times`, each phase's seconds are added to it."""
    phase = times if times is not None else PhaseTimes()
    with phase("forward + backward"):
        loss = forward_backward(step_fn, batches, autocast=autocast)
    with phase("clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    for name, part in optimizer.parts.items():
        with phase(f"optimizer: {name}"):
            part.step()
    with phase("zero_grad"):
        optimizer.zero_grad(set_to_none=True)
    return loss.item()
