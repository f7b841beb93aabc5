"""Which trial a sweep runs next: a trial whose sweep is gone (dead process on this host, silent on another,
stopped and released) is taken over with its values; a live sweep's trial never is; the count is kept."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from flows.sweep.study import HEARTBEAT, OWNER, STALE_AFTER_S, claim_next, owner_gone, release


@pytest.fixture()
def study() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))


def draw(trial: optuna.trial.Trial) -> dict:
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True)}


def recall(frozen: optuna.trial.FrozenTrial) -> dict:
    return dict(frozen.params)


def test_a_trial_is_taken_over_only_when_its_sweep_is_gone(study: optuna.Study) -> None:
    first = claim_next(study, 2, set(), draw, recall)
    assert first is not None and not first.adopted
    frozen = lambda: study.trials[first.trial.number]  # noqa: E731
    assert not owner_gone(frozen())  # this process: alive
    # A sweep in another process on this host that has ended (a real process, gone).
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from flows.services.processes import start_mark; print(os.getpid(), start_mark(os.getpid()))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    pid, started = done.stdout.split()
    first.trial.set_user_attr(
        OWNER, {"host": frozen().user_attrs[OWNER]["host"], "pid": int(pid), "started": started}
    )
    assert owner_gone(frozen())
    # A sweep on another host: gone once its heartbeat is older than STALE_AFTER_S.
    first.trial.set_user_attr(OWNER, {"host": "elsewhere", "pid": 1, "started": ""})
    first.trial.set_user_attr(HEARTBEAT, time.time())
    assert not owner_gone(frozen())
    assert owner_gone(frozen(), now=time.time() + STALE_AFTER_S + 1)
    release(first.trial)
    assert owner_gone(frozen())

    # The next claim takes the released trial over (its number and values), before asking a new one.
    again = claim_next(study, 2, set(), draw, recall)
    assert again is not None and again.adopted
    assert again.trial.number == first.trial.number and again.params == first.params
    assert not owner_gone(study.trials[again.trial.number])  # it is this process's now
    # The count: one running (ours) and a new one make 2; then nothing more.
    second = claim_next(study, 2, {again.trial.number}, draw, recall)
    assert second is not None and not second.adopted and second.trial.number == 1
    assert claim_next(study, 2, {0, 1}, draw, recall) is None
    study.tell(again.trial, 0.5)
    study.tell(second.trial, state=optuna.trial.TrialState.PRUNED)
    assert claim_next(study, 2, {0, 1}, draw, recall) is None
    assert len(study.trials) == 2
