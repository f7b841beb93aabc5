"""Equal budgets: with a token budget and asha, every trial is judged at the same token counts (the rungs),
whatever its batch. A trial scores every `eval_every` steps (set by the sweep to the rung's tokens over its
tokens per step) and is judged at its first score at or after a rung, so a trial whose tokens per step
do not divide the rung would be judged late: a spec where some trial's judgement comes more than
RUNG_SLACK after a rung is refused, naming a first rung every trial meets exactly."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

from flows.pretrain_config import PretrainConfig

if TYPE_CHECKING:
    from flows.sweep.spec import SweepSpec

RUNG_SLACK = 0.05
# The fields a trial's tokens per step depend on (flows.sweep.spec.tokens_per_step).
BATCH_FIELDS = ("micro_batch_size", "accumulate_steps", "seq_len", "nproc_per_node", "nnodes")


def judged_at(rung: int, tokens_per_eval: int) -> int:
    """The tokens of a trial's first score at or after `rung`."""
    return math.ceil(rung / tokens_per_eval) * tokens_per_eval


def rung_problem(spec: SweepSpec) -> str | None:
    """Why some trial cannot be judged within RUNG_SLACK of every rung, with the fix; None when all can."""
    from flows.sweep.spec import tokens_per_step, trial_values

    if spec.budget_unit != "tokens" or spec.pruner.name != "asha":
        return None
    first, factor = spec.first_rung(), spec.pruner.reduction_factor
    per_steps: dict[int, dict[str, Any]] = {}
    late: tuple[dict[str, Any], int, int] | None = None
    for params in _batch_shapes(spec):
        config = PretrainConfig(**trial_values(spec, params))
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
        f"more than {RUNG_SLACK:.0%}): its steps of {tokens_per_step(PretrainConfig(**trial_values(spec, params))):,} "
        f"tokens do not divide the rungs. Give pruner.min_resource a multiple of {unit:,} tokens (every "
        f"trial's tokens per step divides it), e.g. {exact:,}"
    )


def _batch_shapes(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every combination of the space's values of the fields tokens per step depends on ({} without any)."""
    dims = {n: spec.space[n] for n in BATCH_FIELDS if n in spec.space}
    values = [
        d.values() if d.choices is not None or d.step is not None else [d.low, d.high] for d in dims.values()
    ]
    return [dict(zip(dims, combo, strict=True)) for combo in itertools.product(*values)]
