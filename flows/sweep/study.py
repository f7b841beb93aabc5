"""The Optuna study behind a sweep: where it is stored, its sampler and pruner, and which trial runs next.

Storage: the spec's `storage`, else `LLAMAFLOW_SWEEP_STORAGE`, else a journal file under the home
(`<home>/sweeps/<name>/optuna.journal`). An RDB URL (`postgresql+psycopg://...` on the PostgreSQL of
`make services`, `sqlite:///...`) or `journal:PATH` may be given.

A trial is RUNNING from the moment it is asked until it is told. Each records its owner (host, pid and
the process's start time) and a heartbeat (every HEARTBEAT_S, from its claim on, while it waits for a
concurrency slot too). A RUNNING trial whose owner is gone (a dead process on this host, or no heartbeat
from another host for STALE_AFTER_S) was left by a killed or stopped sweep: the next sweep process takes
it over by ending it FAIL, a check-and-set in Optuna's storages (two processes cannot both take it), and
queueing it again with Optuna's RetryFailedTrialCallback (RetryHeartbeatStaleTrialCallback since 4.9); the new trial continues the old one (same
parameters, same run directory and MLflow run, so training resumes from its checkpoint). A trial that
crashed for infrastructure reasons runs again the same way, at most `max_retries` times. A retried trial
does not count: the study ends with `trials` trials that are not, however often the sweep was killed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.trial import FrozenTrial, TrialState

from flows.sweep.rungs import Asha, RetryCallback
from flows.sweep.spec import SweepSpec, check_storage, is_integer
from tasks import home
from tasks.credentials import redact_uri

STORAGE_ENV = "LLAMAFLOW_SWEEP_STORAGE"
STALE_AFTER_S = 180.0
HEARTBEAT_S = 15.0
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
# A trial's user attributes (what the sweep records beside Optuna's own): OWNER is {host, pid, started}.
OWNER, HEARTBEAT = "owner", "heartbeat"
ENDED, STOPPED, CRASHED = "ended", "sweep stopped", "crashed"  # why a trial ended FAIL and runs again
STOP_REQUESTED = "stop_requested"  # a study user attribute: when `python -m flows.sweep stop` was run
# The study's own id, made when it is created: Optuna's study and trial ids start again at 0 in a new
# storage, so a sweep started over under the same name would reuse them.
STUDY_UID = "uid"
SAMPLER_SEED = "sampler_seed"  # a trial's user attribute: the seed its values were drawn with
# What a study's results depend on: a rerun must give the same (`parallel`, `launch`, `storage`, ... may change).
RESULT_FIELDS = (
    "base",
    "space",
    "trials",
    "sampler",
    "pruner",
    "metric",
    "budget",
    "seed",
    "seeds",
    "confirm_top",
    "gpus_per_trial",  # a trial's ranks (nproc_per_node), so its global batch; base holds nnodes and the rest
)


class SpecChangedError(ValueError):
    """The study exists with another search: a rerun must keep what the finished trials were drawn from."""


def storage_url(spec: SweepSpec) -> str:
    if spec.storage:
        return spec.storage
    if os.environ.get(STORAGE_ENV):
        return check_storage(os.environ[STORAGE_ENV], STORAGE_ENV)
    return f"journal:{sweep_dir(spec.name) / 'optuna.journal'}"


def sweep_dir(name: str) -> Path:
    """Where a sweep keeps its journal, its trials' run directories and output."""
    return home.home() / "sweeps" / name


def open_storage(url: str) -> optuna.storages.BaseStorage:
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = home.local(url.removeprefix("journal:"))
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(path))
    return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})


def search_fingerprint(spec: SweepSpec) -> str:
    """What the trials are drawn from and scored by, and what is confirmed: a rerun must have the same."""
    kept = spec.model_dump(mode="json", include=set(RESULT_FIELDS))
    return hashlib.blake2b(json.dumps(kept, sort_keys=True).encode(), digest_size=12).hexdigest()


def changed_fields(spec: SweepSpec, recorded: dict[str, Any]) -> dict[str, Any]:
    """The result fields whose value in `spec` differs from the study's recorded spec: {field: recorded}."""
    now = spec.model_dump(mode="json", include=set(RESULT_FIELDS))
    return {k: recorded.get(k) for k in RESULT_FIELDS if now.get(k) != recorded.get(k)}


class _Grid(optuna.samplers.GridSampler):
    """Optuna's grid, which does not call `study.stop()` when it runs out (only `optimize` may): the sweep
    counts its trials itself."""

    def after_trial(self, *args: Any, **kwargs: Any) -> None:
        return None


def sampler_of(spec: SweepSpec, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """The spec's sampler, seeded with `seed` (default `spec.seed`). A grid picks its next point as a trial
    is asked: it is seeded with `spec.seed` plus the trials asked (`open_study`); random and TPE draw as
    the trial suggests its values, each trial from a stream of its own (`draw_seed`)."""
    seed = spec.seed if seed is None else seed
    if spec.sampler == "grid":
        return _Grid({k: d.values() for k, d in spec.space.items()}, seed=seed)
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # Optuna's default waits 10 random trials before modelling; a third of a small budget is enough. The
    # running trials count as their worst (constant liar), so trials side by side, in this process or
    # another sweep process on the study, are not drawn alike; with one at a time none runs but its own.
    startup = max(2, min(10, spec.n_trials // 3))
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, constant_liar=True)


def draw_seed(spec: SweepSpec, number: int) -> int:
    """The sampler seed of trial `number`: the storage numbers a study's trials once, across every process
    that runs it, so no two trials share a stream (two sweep processes used to draw the same values in
    pairs), and a rerun draws each trial as the first run did."""
    digest = hashlib.blake2b(f"{spec.seed}:{number}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


def pruner_of(spec: SweepSpec) -> optuna.pruners.BasePruner:
    if spec.pruner.name == "none":
        return optuna.pruners.NopPruner()
    return Asha(min_resource=spec.first_rung(), reduction_factor=spec.pruner.reduction_factor)


def open_study(
    spec: SweepSpec,
    *,
    suffix: str = "",
    pruned: bool = True,
    sampler: optuna.samplers.BaseSampler | None = None,
) -> optuna.Study:
    """The study `spec.name + suffix`, created or loaded; refused when it was made from another search."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=spec.name + suffix,
        storage=open_storage(storage_url(spec)),
        sampler=sampler or sampler_of(spec),
        pruner=pruner_of(spec) if pruned else optuna.pruners.NopPruner(),
        direction="minimize",
        load_if_exists=True,
    )
    if sampler is None and study.trials and spec.sampler == "grid":  # a resumed grid picks on from there
        study.sampler = sampler_of(spec, seed=spec.seed + len(study.trials))
    fingerprint = search_fingerprint(spec)
    recorded = study.user_attrs.get("search")
    if recorded is None:
        study.set_user_attr("search", fingerprint)
        study.set_user_attr("spec", spec_record(spec))
    elif recorded != fingerprint:
        changed = changed_fields(spec, study.user_attrs.get("spec", {}))
        if changed or "spec" not in study.user_attrs:
            raise SpecChangedError(_changed_message(study, spec, changed))
        study.set_user_attr("search", fingerprint)  # the same spec, fingerprinted by an older version
    if STUDY_UID not in study.user_attrs:  # a new study (or one made before the sweep gave studies ids)
        study.set_user_attr(STUDY_UID, uuid.uuid4().hex)
    return study


def _changed_message(study: optuna.Study, spec: SweepSpec, changed: dict[str, Any]) -> str:
    was = "; ".join(f"{k}: {json.dumps(v)}" for k, v in changed.items()) or "(not recorded)"
    return (
        f"study {study.study_name!r} in {home_free(storage_url(spec))} was made with another "
        f"{', '.join(changed) or 'search'}, which its results depend on (it was made with {was}): "
        "rerun it with those values, or give the new search another name"
    )


def study_uid(study: optuna.Study) -> str:
    return str(study.user_attrs[STUDY_UID])


def trials_dir(name: str, study: optuna.Study) -> Path:
    """Where the study's trials keep their run directories: one folder per study, so one started over under
    the same name (its journal deleted, another storage) never resumes the old one's checkpoints."""
    return sweep_dir(name) / f"study-{study_uid(study)[:8]}"


def trial_key(study: optuna.Study, trial: optuna.trial.Trial | FrozenTrial) -> str:
    """The tag value that names one trial of one study, in every store and across restarts (a retry's is
    the trial's it retries: it continues that trial's run directory and MLflow run)."""
    return f"{study_uid(study)}.{origin(study, trial)._trial_id}"


def origin(study: optuna.Study, trial: optuna.trial.Trial | FrozenTrial) -> FrozenTrial:
    """The trial that `trial` retries (Optuna's retry callback: a crash for infrastructure reasons), or
    `trial` itself."""
    frozen = study._storage.get_trial(trial._trial_id)
    with warnings.catch_warnings(category=ExperimentalWarning, action="ignore"):  # stable since v2.8
        number = RetryCallback.retried_trial_number(frozen)
    return frozen if number is None else study.get_trials(deepcopy=False)[number]


def retry(study: optuna.Study, trial: optuna.trial.Trial, max_retries: int) -> bool:
    """Enqueue `trial`, just told FAIL after a crash for infrastructure reasons (`ENDED` set to CRASHED
    before), to run again (Optuna's retry callback), unless its line has crashed `max_retries` times
    already: whether it was. A takeover (its sweep stopped or killed, `ENDED` STOPPED) is no crash and
    uses up none of them (Optuna's own count, `max_retry`, counts every trial of the line)."""
    frozen = copy.deepcopy(study._storage.get_trial(trial._trial_id))  # the callback appends to its history
    with warnings.catch_warnings(category=ExperimentalWarning, action="ignore"):  # stable since v2.8
        line = RetryCallback.retry_history(frozen)
    trials = study.get_trials(deepcopy=False)
    crashed_before = sum(
        trials[n].user_attrs.get(ENDED) != STOPPED for n in line
    )  # the rest: retried crashes
    if crashed_before >= max_retries:
        return False
    _requeue(study, frozen, None)
    return True


def _requeue(study: optuna.Study, frozen: FrozenTrial, max_retries: int | None) -> None:
    with warnings.catch_warnings(category=ExperimentalWarning, action="ignore"):  # stable since v2.8
        RetryCallback(max_retry=max_retries)(study, frozen)


def existing_study(spec: SweepSpec, suffix: str = "") -> optuna.Study | None:
    """The study, read as it is (never created), or None before the sweep's first start."""
    try:
        return optuna.load_study(study_name=spec.name + suffix, storage=open_storage(storage_url(spec)))
    except KeyError:
        return None


def home_free(url: str) -> str:
    """The storage URL as it may be shown or stored: without the password it may hold."""
    return redact_uri(url)


def spec_record(spec: SweepSpec) -> dict[str, Any]:
    """The spec as the study keeps it (its storage's password is not kept)."""
    record = spec.model_dump(mode="json")
    if record.get("storage"):
        record["storage"] = redact_uri(record["storage"])
    return record


def suggest(trial: optuna.trial.Trial, spec: SweepSpec) -> dict[str, Any]:
    """The trial's values, drawn by the study's sampler (a grid draws every dimension from its values)."""
    params: dict[str, Any] = {}
    fixed = "fixed_params" in trial.study._storage.get_trial_system_attrs(trial._trial_id)  # a retry's
    if spec.sampler != "grid" and not fixed:
        seed = draw_seed(spec, trial.number)
        trial.study.sampler = sampler_of(spec, seed)
        trial.set_user_attr(SAMPLER_SEED, seed)
    for name, dim in spec.space.items():
        if spec.sampler == "grid" or dim.choices is not None:
            params[name] = trial.suggest_categorical(name, dim.values())
        elif is_integer(name, dim):
            step = int(dim.step or 1)
            params[name] = trial.suggest_int(name, int(dim.low), int(dim.high), step=step, log=dim.log)
        else:
            assert dim.low is not None and dim.high is not None
            params[name] = trial.suggest_float(name, dim.low, dim.high, step=dim.step, log=dim.log)
    return params


def counts(study: optuna.Study) -> dict[str, int]:
    trials = study.get_trials(deepcopy=False)
    return {state.name.lower(): sum(t.state == state for t in trials) for state in TrialState}
