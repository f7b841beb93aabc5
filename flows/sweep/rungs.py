"""The pruner's rungs: ASHA reading each trial's rung scores once, whatever its retries, and the record of
each decision to cut a trial (at which rung, after how many tokens, against which scores).

Optuna's SuccessiveHalvingPruner keeps a trial's score at rung N as the system attribute
`completed_rung_N` and compares a trial with every trial of the study that holds it. A trial taken over
or retried after a crash runs again as a new trial that inherits its attributes (RetryFailedTrialCallback
copies them, and must: the retry continues where its origin was), so the FAIL origin and its retry would
both hold its scores: after two takeovers one trial would count three times. The pruner here sees each
trial once: the retried origins are left out."""

from __future__ import annotations

import warnings
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.trial import FrozenTrial, TrialState

try:  # Optuna >= 4.9's name; RetryFailedTrialCallback, the same class, is its deprecated alias
    from optuna.storages import RetryHeartbeatStaleTrialCallback as RetryCallback
except ImportError:  # Optuna < 4.9
    from optuna.storages import RetryFailedTrialCallback as RetryCallback  # type: ignore[no-redef]

RUNG = "completed_rung_"  # Optuna's SuccessiveHalvingPruner's system attribute, one per rung passed
PRUNED = "pruned"  # a pruned trial's user attribute: its decision (`decision`)


def counted_once(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """The trials without those a retry continues (an origin's scores are its retry's)."""
    with warnings.catch_warnings(category=ExperimentalWarning, action="ignore"):
        retried = {n for t in trials for n in RetryCallback.retry_history(t)}
    return [t for t in trials if t.number not in retried]


class _OnceView:
    """The study as the pruner reads it: every trial once (the rest of the study as it is)."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[FrozenTrial]:
        everything = self._study.get_trials(deepcopy=deepcopy)
        return [t for t in counted_once(everything) if states is None or t.state in states]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


class Asha(optuna.pruners.SuccessiveHalvingPruner):
    """Optuna's asynchronous successive halving, each trial's rung scores counted once."""

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return super().prune(_OnceView(study), trial)  # type: ignore[arg-type]


def decision(trial: optuna.trial.Trial, step: int, tokens: int, value: float) -> dict[str, Any]:
    """Why `trial` was cut: its rung (the last it reached), step, tokens and subset score there, and the
    scores of the other trials at that rung that it was compared with."""
    study = trial.study
    frozen = study._storage.get_trial(trial._trial_id)
    passed = [int(k.removeprefix(RUNG)) for k in frozen.system_attrs if k.startswith(RUNG)]
    rung = max(passed, default=0)
    against = [
        {"trial": t.number, "score": t.system_attrs[f"{RUNG}{rung}"]}
        for t in counted_once(study.get_trials(deepcopy=False))
        if f"{RUNG}{rung}" in t.system_attrs and t.number != frozen.number
    ]
    return {
        "trial": frozen.number,
        "rung": rung,
        "step": step,
        "tokens": tokens,
        "score": value,
        "against": sorted(against, key=lambda a: a["score"]),
    }


def decisions(study: optuna.Study) -> list[dict[str, Any]]:
    """Every cut trial's decision, by trial number (the parent run's `rung_decisions.json`)."""
    return [
        t.user_attrs[PRUNED]
        for t in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,))
        if PRUNED in t.user_attrs
    ]
