"""A run budget: how many optimizer steps fit in a wall-clock budget, decided before the first update.

The whole run (what came before training, training, and what follows it: the final evaluation and
registration) must end within `time_budget` seconds of the budget's start. The engine measures this host
(`tasks.training.calibrate`: the first step with its compilation, a few steady steps, an eager forward as
evaluation runs it, one periodic score) and `plan_steps` turns those measurements into a number of steps;
the schedule (warmup, stable, decay) is then laid over exactly that many, so a budgeted run ends decayed
rather than cut off. The plan is stored with every checkpoint: a resumed run keeps it and never re-plans.

Pure functions of their inputs, no torch: `plan_steps` is what the unit tests exercise.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

# Share of the time left for training kept back for what the measurement cannot see: a loaded host, the
# first steps after compilation, the operating system's page cache.
MARGIN = 0.06
_DURATION = re.compile(
    r"^\s*(?:(\d+(?:\.\d*)?)\s*h)?\s*(?:(\d+(?:\.\d*)?)\s*m)?\s*(?:(\d+(?:\.\d*)?)\s*s?)?\s*$"
)


def parse_duration(value: str | float | int) -> float:
    """Seconds of a duration: a number of seconds, or text such as `90s`, `10m`, `1h30m`, `1.5h`."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value).lower())
        if match is None or not any(match.groups()):
            raise ValueError(
                f"time_budget={value!r} is not a duration: give seconds (600) or h/m/s units (10m, 1h30m, 90s)"
            )
        hours, minutes, secs = (float(part) if part else 0.0 for part in match.groups())
        seconds = hours * 3600 + minutes * 60 + secs
    if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"time_budget must be a positive duration, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """`12m`, `1h05m`, `45s`, `9m30s`: the budget as a person writes it."""
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m" + (f"{secs:02d}s" if secs else "")
    if minutes:
        return f"{minutes}m" + (f"{secs:02d}s" if secs else "")
    return f"{secs}s"


@dataclass(frozen=True)
class BudgetTerms:
    """What the caller knows of the time outside training. The flow gives its start and estimates what
    follows training; `fit` called alone starts the budget when training starts, with nothing after it."""

    total_s: float  # the budget: the whole run, from `started_at`
    started_at: float  # Unix time the budget started (the flow's start)
    after_tokens: int = 0  # tokens scored after training (final evaluation: forward passes only)
    after_fixed_s: float = 0.0  # the rest after training: samples, xz, registration, logging


@dataclass(frozen=True)
class Measured:
    """This host, measured before the run's first update (`tasks.training.calibrate`)."""

    first_step_s: float  # the first step, compilation included (paid before the plan; not again)
    step_s: float  # a steady optimizer step, wall clock (its batch's loading included)
    forward_token_s: float  # an eager forward pass (how evaluation scores), seconds per token
    periodic_eval_s: float = 0.0  # one periodic validation score (eval_every), 0 when off
    checkpoint_s: float = 0.0  # one checkpoint write, estimated


@dataclass(frozen=True)
class BudgetPlan:
    """The decided run: what was measured, how many steps, why, and when it should end."""

    budget_s: float
    started_at: float
    planned_at: float  # Unix time the plan was made (calibration done)
    steps: int
    step_s: float
    first_step_s: float
    train_s: float  # estimated training time of the planned steps (periodic scores, checkpoints included)
    after_s: float  # estimated time after training (evaluation, registration)
    end_at: float  # estimated Unix time the whole run ends
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BudgetPlan:
        return cls(**{name: values[name] for name in cls.__dataclass_fields__})

    def metrics(self) -> dict[str, float]:
        """The plan's numbers, as the metric sink records them (with the first step's metrics)."""
        return {
            "budget/time_budget_s": self.budget_s,
            "budget/planned_steps": float(self.steps),
            "budget/step_time_s": self.step_s,
            "budget/first_step_s": self.first_step_s,
            "budget/spent_before_training_s": self.planned_at - self.started_at,
            "budget/train_estimate_s": self.train_s,
            "budget/after_training_estimate_s": self.after_s,
            "budget/end_estimate_unix": self.end_at,
        }

    def describe(self) -> str:
        """One sentence: the steps, the measurement behind them, and the expected end (UTC wall clock)."""
        end = time.strftime("%H:%M:%S UTC", time.gmtime(self.end_at))
        return (
            f"{self.steps} optimizer steps, set by time_budget={format_duration(self.budget_s)}: {self.reason}; "
            f"expected end {end} ({format_duration(self.end_at - self.started_at)} after the start)"
        )


def training_seconds(
    steps: int, measured: Measured, *, eval_every: int = 0, checkpoint_every: int = 0
) -> float:
    """Estimated wall clock of `steps` optimizer steps after the plan (compilation already paid): the
    steps, the periodic scores among them and the checkpoints (every `checkpoint_every` and the last)."""
    scores = steps // eval_every if eval_every else 0
    checkpoints = (steps // checkpoint_every if checkpoint_every else 0) + 1
    if checkpoint_every and steps % checkpoint_every == 0:
        checkpoints -= 1  # the last step's checkpoint is a periodic one too
    return steps * measured.step_s + scores * measured.periodic_eval_s + checkpoints * measured.checkpoint_s


def plan_steps(
    terms: BudgetTerms,
    measured: Measured,
    *,
    now: float,
    eval_every: int = 0,
    checkpoint_every: int = 0,
    min_steps: int = 1,
    margin: float = MARGIN,
) -> BudgetPlan:
    """The most optimizer steps whose estimated training, plus what follows training, ends within the
    budget, measured from `now` (the plan's time: everything before it, calibration included, is spent).
    At least `min_steps` (a warmup must be followed by a step): a budget too short for them is exceeded,
    and the reason says by how much."""
    if measured.step_s <= 0:
        raise ValueError(f"a measured step must take some time, got {measured.step_s} s")
    spent = now - terms.started_at
    after = terms.after_tokens * measured.forward_token_s + terms.after_fixed_s
    available = (terms.total_s - spent - after) * (1 - margin)
    per_step = (
        measured.step_s
        + (measured.periodic_eval_s / eval_every if eval_every else 0.0)
        + (measured.checkpoint_s / checkpoint_every if checkpoint_every else 0.0)
    )

    def fits(n: int) -> bool:
        return (
            training_seconds(n, measured, eval_every=eval_every, checkpoint_every=checkpoint_every)
            <= available
        )

    # The average cost per step gives a first guess; the step-by-step count (scores and checkpoints come
    # in whole ones) settles it.
    steps = max(0, math.floor((available - measured.checkpoint_s) / per_step))
    while fits(steps + 1):
        steps += 1
    while steps > 0 and not fits(steps):
        steps -= 1
    measured_text = (
        f"a step takes {measured.step_s:.3g} s here (first step {measured.first_step_s:.3g} s with compilation), "
        f"{spent:.0f} s spent before training, {after:.0f} s estimated after it"
    )
    if steps >= min_steps:
        reason = f"{measured_text}, {margin:.0%} kept in reserve"
    else:
        steps = min_steps
        reason = (
            f"{measured_text}: the budget leaves {max(available, 0.0):.0f} s for training, too little for "
            f"{min_steps} step(s); the run takes the minimum and ends after the budget"
        )
    train = training_seconds(steps, measured, eval_every=eval_every, checkpoint_every=checkpoint_every)
    return BudgetPlan(
        budget_s=terms.total_s,
        started_at=terms.started_at,
        planned_at=now,
        steps=steps,
        step_s=measured.step_s,
        first_step_s=measured.first_step_s,
        train_s=train,
        after_s=after,
        end_at=now + train + after,
        reason=reason,
    )
