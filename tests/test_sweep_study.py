"""Which trial a sweep runs next: a trial whose sweep is gone (dead process on this host, silent on another,
stopped and released) is taken over with its values; a live sweep's trial never is; the count is kept."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from flows.sweep import confirm, loop
from flows.sweep.claims import _take_over, claim_next, keep_alive, owner_gone, release
from flows.sweep.report import params_key
from flows.sweep.spec import SweepSpec, check_spec
from flows.sweep.study import (
    CRASHED,
    ENDED,
    HEARTBEAT,
    OWNER,
    STALE_AFTER_S,
    SpecChangedError,
    open_storage,
    open_study,
    origin,
    retry,
    suggest,
)


@pytest.fixture()
def study() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))


def draw(trial: optuna.trial.Trial) -> dict:
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True)}


def test_a_trial_is_taken_over_only_when_its_sweep_is_gone(study: optuna.Study) -> None:
    first = claim_next(study, 2, set(), draw)
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

    # The next claim takes the released trial over before asking a new one: it ends FAIL and a new trial
    # continues it (its values, its origin's directory and MLflow run).
    again = claim_next(study, 2, set(), draw)
    assert again is not None and again.adopted and study.trials[0].state == TrialState.FAIL
    assert study.trials[1].user_attrs[ENDED] == ""  # why its predecessor ended is not its own
    assert again.trial.number == 1 and again.params == first.params and origin(study, again.trial).number == 0
    assert not owner_gone(study.trials[again.trial.number])  # it is this process's now
    # The count: the taken-over trial does not count; ours and a new one make 2; then nothing more.
    second = claim_next(study, 2, {again.trial.number}, draw)
    assert second is not None and not second.adopted and second.trial.number == 2
    assert claim_next(study, 2, {1, 2}, draw) is None
    study.tell(again.trial, 0.5)
    study.tell(second.trial, state=optuna.trial.TrialState.PRUNED)
    assert claim_next(study, 2, {1, 2}, draw) is None
    assert len(study.trials) == 3


def test_two_processes_that_find_one_stale_trial_cannot_both_take_it_over(tmp_path: Path) -> None:
    """Two sweep processes (two storages on one journal file) see the same stale trial at once: the state
    change that takes it over is a check-and-set, so it is queued to run again once, not twice."""
    journal = f"journal:{tmp_path / 'optuna.journal'}"
    optuna.create_study(study_name="s", storage=open_storage(journal))
    ours, theirs = (optuna.load_study(study_name="s", storage=open_storage(journal)) for _ in range(2))
    first = claim_next(ours, 1, set(), draw)
    assert first is not None
    release(first.trial)
    (stale,) = theirs.get_trials(states=(TrialState.RUNNING,))  # both read it RUNNING, released
    assert owner_gone(stale) and owner_gone(ours.get_trials()[0])
    _take_over(ours, ours.get_trials()[0])
    _take_over(theirs, stale)  # too late: it is FAIL already
    waiting = theirs.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].params == first.params
    claimed = claim_next(theirs, 1, set(), draw)
    assert claimed is not None and claimed.adopted and claimed.trial.number == 1
    assert claim_next(ours, 1, set(), draw) is None


def test_a_trial_beats_its_heartbeat_while_it_waits(study: optuna.Study) -> None:
    """While a trial's block waits (for a concurrency slot, say), its heartbeat goes on: a sweep on another
    host never finds it stale; it does once the beats stop."""
    claimed = claim_next(study, 1, set(), draw)
    assert claimed is not None
    claimed.trial.set_user_attr(OWNER, {"host": "elsewhere", "pid": 1, "started": ""})  # seen from there
    start = time.time()
    with keep_alive(claimed.trial, every_s=0.1):
        time.sleep(0.5)
    beat = study.trials[0].user_attrs[HEARTBEAT]
    assert beat > start + 0.3
    assert not owner_gone(study.trials[0], now=start + STALE_AFTER_S + 0.2)
    assert owner_gone(study.trials[0], now=beat + STALE_AFTER_S + 1)


SPEC = {
    "name": "s",
    "base": {"preset": "tiny", "eval_every": 10},
    "space": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}},
    "sampler": "random",
    "trials": 4,
    "seeds": [1, 2, 3],
}


def _spec(tmp_path: Path, **changes: object) -> SweepSpec:
    return check_spec({**SPEC, "storage": f"journal:{tmp_path / 'study.journal'}", **changes})


def test_a_rerun_that_changes_what_the_results_depend_on_is_refused_naming_the_field(tmp_path: Path) -> None:
    open_study(_spec(tmp_path))
    open_study(_spec(tmp_path, parallel=2))  # how many at a time: not part of the results
    for field, value, was in (("trials", 6, "4"), ("seeds", [1, 2], "[1, 2, 3]"), ("confirm_top", 2, "1")):
        with pytest.raises(SpecChangedError) as err:
            open_study(_spec(tmp_path, **{field: value}))
        assert (
            f"was made with another {field}, which its results depend on (it was made with {field}: {was})"
            in str(err.value)
        )
        assert "rerun it with those values, or give the new search another name" in str(err.value)


def test_a_resumed_study_draws_on_instead_of_repeating_its_first_draws(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    first = open_study(spec)
    for _ in range(2):
        claimed = claim_next(first, 4, set(), lambda t: suggest(t, spec))
        assert claimed is not None
        first.tell(claimed.trial, 1.0)
    again = open_study(spec)  # a new process: the sampler starts over from the spec's seed...
    claimed = claim_next(again, 4, set(), lambda t: suggest(t, spec))
    assert claimed is not None
    drawn = [t.params["lr"] for t in again.trials[:2]]
    assert claimed.params["lr"] not in drawn  # ...plus the trials already asked, so not the first draw again


def test_confirmation_finds_a_configurations_runs_by_its_values_not_its_rank() -> None:
    spec = check_spec(SPEC)
    study = optuna.create_study()
    a, b, c = {"lr": 0.001}, {"lr": 0.002}, {"lr": 0.003}
    first = [("base", {}), ("trial-0", a), ("trial-1", b)]
    confirm.enqueue(study, first, spec.seeds)
    assert confirm.finished(study, first, spec.seeds) == (0, 9) and len(study.trials) == 9
    values = {params_key(p): v for p, v in (({}, 1.0), (a, 0.5), (b, 0.9))}
    while waiting := study.get_trials(states=(TrialState.WAITING,)):
        trial = study.ask()
        study.tell(trial, values[trial.user_attrs["key"]] + 0.001 * trial.user_attrs["seed"] ** 2)
        assert len(study.get_trials(states=(TrialState.WAITING,))) == len(waiting) - 1
    # Later the ranks changed: b is best, then a new c. b's runs are found again, c gets runs of its own.
    later = [("base", {}), ("trial-1", b), ("trial-5", c)]
    confirm.enqueue(study, later, spec.seeds)
    assert confirm.finished(study, later, spec.seeds) == (6, 9) and len(study.trials) == 12
    new = study.get_trials(states=(TrialState.WAITING,))
    assert {t.system_attrs["fixed_params"]["candidate"] for t in new} == {params_key(c)}
    for _ in new:
        trial = study.ask()
        study.tell(trial, 0.2 + 0.01 * trial.user_attrs["seed"])
    b_verdict, c_verdict = confirm.verdicts(study, later, spec.seeds)
    assert b_verdict.candidate.params == b and b_verdict.candidate.values == pytest.approx(
        [0.901, 0.904, 0.909]
    )
    assert c_verdict.candidate.values == pytest.approx([0.21, 0.22, 0.23])


def test_a_crashed_trial_is_retried_in_its_own_place_and_the_count_is_kept(study: optuna.Study) -> None:
    """A trial retried after a crash (Optuna's RetryFailedTrialCallback) runs again with its values, as its
    origin (its directory and MLflow run), and does not use up a trial of the budget; retries are bounded."""
    first = claim_next(study, 2, set(), draw)
    assert first is not None
    study.tell(first.trial, state=TrialState.FAIL)
    assert retry(study, first.trial, max_retries=1)
    again = claim_next(study, 2, {0}, draw)
    assert again is not None and again.params == first.params and not again.adopted
    assert again.trial.number == 1 and origin(study, again.trial).number == 0
    study.tell(again.trial, state=TrialState.FAIL)
    assert not retry(study, again.trial, max_retries=1)  # the one retry is spent: the failure counts
    new = claim_next(study, 2, {0, 1}, draw)
    assert new is not None and new.params != first.params and origin(study, new.trial).number == 2
    study.tell(new.trial, 1.0)
    assert claim_next(study, 2, {0, 1, 2}, draw) is None


def test_a_confirmation_stopped_and_rerun_twice_never_asks_for_an_empty_trial() -> None:
    """The confirmation's trial taken over after a stop (FAIL, queued again), then two reruns: the work is
    counted by configuration and seed, only queued trials run, and an empty trial an older sweep left
    RUNNING is ended, not run (it used to make every later rerun fail with `'key'`)."""
    study = optuna.create_study()
    chosen, seeds = [("base", {}), ("trial-0", {"lr": 0.002})], [1, 2]
    run = lambda c: study.tell(c.trial, 1.0 + c.params["seed"])  # noqa: E731
    confirm.enqueue(study, chosen, seeds)
    stopped = claim_next(study, None, set(), loop.attrs_of)
    assert stopped is not None
    release(stopped.trial)  # `stop`: the next run takes it over
    for _ in range(3):  # the rerun, and two more
        confirm.enqueue(study, chosen, seeds)
        while (claimed := claim_next(study, None, set(), loop.attrs_of)) is not None:
            run(claimed)
    assert confirm.finished(study, chosen, seeds) == (4, 4)
    assert (
        all("key" in t.user_attrs for t in study.trials) and len(study.trials) == 5
    )  # 4 and the stopped one
    (verdict,) = confirm.verdicts(study, chosen, seeds)
    assert verdict.candidate.values == verdict.base.values == [2.0, 3.0]

    legacy = study.ask()  # what an older sweep's count left behind: RUNNING, no configuration's
    legacy.set_user_attr(OWNER, {"released": True})
    confirm.enqueue(study, chosen, seeds)
    assert study.trials[legacy.number].state == TrialState.FAIL
    assert claim_next(study, None, set(), loop.attrs_of) is None
    assert len(study.trials) == 6 and not study.get_trials(states=(TrialState.WAITING,))


def test_takeovers_use_up_no_crash_retry(study: optuna.Study) -> None:
    """A trial taken over twice (its sweep stopped, then killed) and then crashed still gets its one crash
    retry; a second crash of the line does not (Optuna's own count would have refused the first)."""
    claimed = claim_next(study, 1, set(), draw)
    assert claimed is not None
    for _ in range(2):
        release(claimed.trial)
        claimed = claim_next(study, 1, set(), draw)  # the next sweep process
        assert claimed is not None and claimed.adopted
    claimed.trial.set_user_attr(ENDED, CRASHED)
    study.tell(claimed.trial, state=TrialState.FAIL)
    assert retry(study, claimed.trial, max_retries=1)
    again = claim_next(study, 1, {0, 1, 2}, draw)
    assert again is not None and again.params == claimed.params and origin(study, again.trial).number == 0
    again.trial.set_user_attr(ENDED, CRASHED)
    study.tell(again.trial, state=TrialState.FAIL)
    assert not retry(study, again.trial, max_retries=1)
    assert claim_next(study, 1, {0, 1, 2, 3}, draw) is None
