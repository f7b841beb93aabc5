"""Measuring this host before a budgeted run plans its length (`tasks.training.budget`).

Calibration runs real optimizer steps (the first one compiles, the next ones are steady), then puts
everything they changed back: the weights, the optimizer state, the loader's position and the random
generators. The run that follows starts from exactly the state it would have had without them, so two runs
with the same plan train the same weights, whatever their calibration measured; the compiled graphs stay,
so the compilation is paid once. The steady steps cost their time and nothing else.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from tasks.training import checkpoint as ckpt
from tasks.training.budget import BudgetPlan, BudgetTerms, Measured, plan_steps
from tasks.training.distributed import DistContext
from tasks.training.loader import BlockLoader
from tasks.training.loop import TrainLoop
from tasks.training.loss import stream_loss
from tasks.training.optim import TrainOptimizer

STEADY_STEPS = 3  # after the first (compiling) step; their median is the step time
FORWARD_TOKENS = 4096  # tokens of the eager forward that estimates evaluation's cost per token
CHECKPOINT_BYTES_PER_S = 100e6  # a conservative local disk: checkpoints are weights + optimizer moments


@contextmanager
def state_restored(
    plain: nn.Module, optimizer: TrainOptimizer, loader: BlockLoader, device: torch.device
) -> Iterator[None]:
    """Whatever runs inside leaves the weights, optimizer state, loader position and generators as it
    found them."""
    with torch.no_grad():
        tensors = [t.detach().clone() for t in (*plain.parameters(), *plain.buffers())]
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    loader_state = copy.deepcopy(loader.state_dict())
    rng_state = ckpt.capture_rng_state(device)
    try:
        yield
    finally:
        with torch.no_grad():
            for live, saved in zip((*plain.parameters(), *plain.buffers()), tensors, strict=True):
                live.copy_(saved)
        for param in plain.parameters():
            param.grad = None
        optimizer.load_state_dict(optimizer_state)
        loader.load_state_dict(loader_state)
        ckpt.restore_rng_state(rng_state, device)


def measure(loop: TrainLoop, blocks: np.ndarray, *, steady_steps: int = STEADY_STEPS) -> Measured:
    """This host's step (compilation, then steady), eager forward per token and periodic score, measured
    on `loop`'s model without changing any state it trains (`state_restored`)."""
    plain = loop.parallel.plain
    with state_restored(plain, loop.optimizer, loop.loader, loop.device):
        times = []
        for _ in range(1 + steady_steps):
            times.append(loop._one_step()["train/step_time_s"])
        seq_len = loop.seq_len
        tokens = np.asarray(blocks[: max(1, -(-FORWARD_TOKENS // seq_len))])[:, :seq_len].reshape(-1)
        started = time.perf_counter()
        stream_loss(
            plain,
            tokens,
            context_id=0,
            seq_len=seq_len,
            device=loop.device,
            dtype=loop.settings.dtype,
        )
        forward_token_s = (time.perf_counter() - started) / len(tokens)
        periodic_s = 0.0
        if loop.periodic_eval is not None:
            started = time.perf_counter()
            loop.periodic_eval.after_step(plain, 0)
            periodic_s = time.perf_counter() - started
    state_bytes = sum(p.numel() * p.element_size() for p in plain.parameters()) * 3  # weights and 2 moments
    return Measured(
        first_step_s=times[0],
        step_s=statistics.median(times[1:]) if steady_steps else times[0],
        forward_token_s=forward_token_s,
        periodic_eval_s=periodic_s,
        checkpoint_s=0.5 + state_bytes / CHECKPOINT_BYTES_PER_S,
    )


def measure_and_plan(
    loop: TrainLoop, blocks: np.ndarray, terms: BudgetTerms, dist: DistContext
) -> BudgetPlan:
    """Measure this host on `loop` (calibration steps that leave no trace), then plan the steps that fit in
    the budget; every rank takes the main rank's plan (their measurements differ a little)."""
    measured = measure(loop, blocks)
    settings = loop.settings
    decided = plan_steps(
        terms,
        measured,
        now=time.time(),
        eval_every=settings.eval_every,
        checkpoint_every=settings.checkpoint_every,
        min_steps=settings.warmup_steps + 1,
    )
    shared = dist.broadcast_object(decided)
    assert isinstance(shared, BudgetPlan)
    return shared
