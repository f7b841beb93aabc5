"""Equal budgets: with a token budget and asha, every trial is judged at the same token counts (the rungs),
whatever its batch. A trial scores every `eval_every` steps (set by the sweep to the rung's tokens over its
tokens per step) and is judged at its first score at or after a rung, so a trial whose tokens per step
do not divide the rung would be judged late: a spec where some trial's judgement comes more than
RUNG_SLACK after a rung is refused, naming a first rung every trial meets exactly."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from flows.pretrain_config import PretrainConfig

RUNG_SLACK = 0.05
# The fields a trial's tokens per step depend on (flows.sweep.spec.tokens_per_step).
BATCH_FIELDS = ("micro_batch_size", "accumulate_steps", "seq_len", "nproc_per_node", "nnodes")


def judged_at(rung: int, tokens_per_eval: int) -> int:
    """The tokens of a trial's first score at or after `rung`."""
    return math.ceil(rung / tokens_per_eval) * tokens_per_eval


def tokens_per_step(config: PretrainConfig) -> int:
    """Tokens one optimizer step trains on: the global batch, over every node."""
    per_rank = config.micro_batch_size * config.accumulate_steps * config.seq_len
    return per_rank * config.nproc_per_node * config.nnodes


def rung_problem(spec: Any, trial_config: Callable[[dict[str, Any]], PretrainConfig]) -> str | None:
    """Why some trial of `spec` (a SweepSpec; `trial_config` gives a trial's config for its sampled values)
    cannot be judged within RUNG_SLACK of every rung, with the fix; None when all can."""
    if spec.budget_unit != "tokens" or spec.pruner.name != "asha":
        return None
    first, factor = spec.first_rung(), spec.pruner.reduction_factor
    per_steps: dict[int, dict[str, Any]] = {}
    late: tuple[dict[str, Any], int, int] | None = None
    for params in _batch_shapes(spec):
        config = trial_config(params)
        per_step = tokens_per_step(config)
        per_steps.setdefault(per_step, params)
        every = config.eval_every * per_step
        rung = first
        while rung <= config.max_steps * per_step:
            if late is None and judged_at(rung, every) > rung * (1 + RUNG_SLACK):
                late = (params, rung, judged_at(rung, every))
            rung *= factor
    if late is None:
        return None
    params, rung, judged = late
    unit = math.lcm(*per_steps)
    exact = math.ceil(first / unit) * unit
    shown = ", ".join(f"{k}={v}" for k, v in params.items()) or "the base"
    return (
        f"the rung at {rung:,} tokens is met at {judged:,} by a trial with {shown} (+{judged / rung - 1:.0%}, "
        f"more than {RUNG_SLACK:.0%}): its steps of {tokens_per_step(trial_config(params)):,} "
        f"tokens do not divide the rungs. Give pruner.min_resource a multiple of {unit:,} tokens (every "
        f"trial's tokens per step divides it), e.g. {exact:,}"
    )


def _batch_shapes(spec: Any) -> list[dict[str, Any]]:
    """Every combination of the space's values of the fields tokens per step depends on ({} without any)."""
    dims = {n: spec.space[n] for n in BATCH_FIELDS if n in spec.space}
    values = [
        d.values() if d.choices is not None or d.step is not None else [d.low, d.high] for d in dims.values()
    ]
    return [dict(zip(dims, combo, strict=True)) for combo in itertools.product(*values)]
