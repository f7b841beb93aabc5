"""Who runs a study's trials: each trial's owner (host, pid, the process's start time) and heartbeat, the
takeover of a trial whose owner is gone, the next trial to claim, and `stop` requests (flows/sweep/study.py
describes the lifecycle)."""

from __future__ import annotations

import copy
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from flows.services.processes import start_mark
from flows.sweep.rungs import counted_once
from flows.sweep.study import (
    ENDED,
    FINISHED,
    HEARTBEAT,
    HEARTBEAT_S,
    OWNER,
    STALE_AFTER_S,
    STOP_REQUESTED,
    STOPPED,
    _requeue,
    origin,
)


def this_owner() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": start_mark(os.getpid())}


def owner_gone(trial: FrozenTrial, now: float | None = None) -> bool:
    owner = trial.user_attrs.get(OWNER)
    if isinstance(owner, dict) and owner.get("released"):
        return True
    if not isinstance(owner, dict):
        # Asked but killed before it recorded an owner: stale once no one has touched it for a while.
        started = trial.datetime_start.timestamp() if trial.datetime_start else 0.0
        return (now or time.time()) - started > STALE_AFTER_S
    if owner.get("host") == socket.gethostname():
        return not _alive(int(owner.get("pid", -1)), str(owner.get("started", "")))
    beat = float(trial.user_attrs.get(HEARTBEAT, 0.0))
    return (now or time.time()) - beat > STALE_AFTER_S


def _alive(pid: int, started: str) -> bool:
    try:
        return start_mark(pid) == started  # not a new process with the old pid
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


@dataclass
class Claimed:
    trial: optuna.trial.Trial
    params: dict[str, Any]
    adopted: bool  # continues a trial whose sweep was killed or stopped (its directory, its MLflow run)


def claim_next(
    study: optuna.Study,
    total: int | None,
    mine: set[int],
    draw: Callable[[optuna.trial.Trial], dict[str, Any]],
) -> Claimed | None:
    """The next trial to run while fewer than `total` are finished or running (`mine`: the numbers this
    process runs): a stale one is taken over first, then one waiting (a retry), then a new draw (`draw`
    gives the trial's values; a retry's are its original's). `total` None: the queue is the work (the
    confirmation's enqueued configurations and seeds), and no new trial is ever asked."""
    for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if frozen.number not in mine and owner_gone(frozen):
            _take_over(study, frozen)
    if total is None:
        trial = _pop_waiting(study)
        if trial is None:
            return None
    else:
        trials = study.get_trials(deepcopy=False)
        finished = sum(t.state in FINISHED for t in counted_once(trials))  # a retried FAIL: its retry
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if finished + running >= total:
            return None
        trial = study.ask()  # a waiting retry first; Optuna hands a waiting trial to one process only
    mark_owner(trial)
    first = origin(study, trial)
    adopted = first.number != trial.number and trial.user_attrs.get(ENDED) == STOPPED
    if first.number != trial.number:  # a retry: the callback copied why its predecessor ended; not its own
        for name in (ENDED, "message"):
            trial.set_user_attr(name, "")
    return Claimed(trial, draw(trial), adopted)


def _pop_waiting(study: optuna.Study) -> optuna.trial.Trial | None:
    """A waiting trial, now RUNNING and this process's, or None: `study.ask()` without its fallback of a
    new, empty trial (the pop is Optuna's own check-and-set, so two processes never get the same one)."""
    trial_id = study._pop_waiting_trial_id()
    return None if trial_id is None else optuna.Trial(study, trial_id)


def _take_over(study: optuna.Study, frozen: FrozenTrial) -> None:
    """End a stale trial FAIL and queue it to run again as a new trial that continues it (its values,
    directory and MLflow run): the state change is a check-and-set in every Optuna storage, so of two
    processes that find it stale only one queues it."""
    from optuna.exceptions import UpdateFinishedTrialError

    storage, trial_id = study._storage, frozen._trial_id
    try:  # its attributes first: a finished trial's are read-only
        storage.set_trial_user_attr(trial_id, ENDED, STOPPED)
        storage.set_trial_user_attr(trial_id, "message", "its sweep stopped; continued by a new trial")
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
    except UpdateFinishedTrialError:
        return  # another process took it over first
    _requeue(study, copy.deepcopy(study._storage.get_trial(frozen._trial_id)), None)


def request_stop(study: optuna.Study) -> None:
    """Ask every sweep process running `study` now to stop (`python -m flows.sweep stop`): each stops its
    trials after a checkpoint and ends; one started later is not affected and continues the study."""
    study.set_user_attr(STOP_REQUESTED, time.time())


def stop_requested(study: optuna.Study, since: float) -> bool:
    """Whether a stop was asked for after `since` (the asking process's start)."""
    return float(study.user_attrs.get(STOP_REQUESTED, 0.0)) > since  # read from the storage each time


def release(trial: optuna.trial.Trial) -> None:
    """Give up a trial left unfinished (its sweep was stopped): the next sweep, even in this process, takes it."""
    trial.set_user_attr(OWNER, {"released": True})


@contextmanager
def keep_alive(trial: optuna.trial.Trial | None, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Beat the trial's heartbeat every `every_s` while the block runs, whatever it waits for (a concurrency
    slot, a flow run in a queue): a sweep on another host takes over only a trial whose process is gone."""
    if trial is None:
        yield
        return
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            with suppress(Exception):  # a storage hiccup: the next beat tries again
                trial.set_user_attr(HEARTBEAT, time.time())

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def mark_owner(trial: optuna.trial.Trial) -> None:
    trial.set_user_attr(OWNER, this_owner())
    trial.set_user_attr(HEARTBEAT, time.time())
