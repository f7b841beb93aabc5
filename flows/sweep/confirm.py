"""Seed confirmation's bookkeeping: which configurations are rerun, and their runs found again by value.

The confirmation is a study of its own (`<name>.confirm`, so a killed confirmation resumes too), whose
trials are enqueued as (configuration key, seed): the key is made from the configuration's values, never
from its rank among the trials, so a configuration confirmed before is never confused with another."""

from __future__ import annotations

import warnings
from contextlib import suppress
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from flows.sweep.report import Verdict, compare, corrected, params_key
from flows.sweep.rungs import counted_once
from flows.sweep.spec import SweepSpec, trial_values

BASE = "base"
EMPTY = "no configuration's: an empty trial an older sweep asked for; ended unrun"


def candidates(spec: SweepSpec, study: optuna.Study) -> list[tuple[str, dict[str, Any]]]:
    """The base, then the best `confirm_top` completed configurations that are not the base itself."""
    complete = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.value)
    base_values = trial_values(spec, {})
    return [(BASE, {})] + [
        (f"trial-{t.number}", t.params)
        for t in complete[: spec.confirm_top]
        if trial_values(spec, t.params) != base_values  # the base itself, sampled: its runs are the base's
    ]


def enqueue(confirm: optuna.Study, chosen: list[tuple[str, dict[str, Any]]], seeds: list[int]) -> None:
    """One trial per configuration and seed, unless the study holds it already (finished, running, or
    waiting: a retry of one); a trial that is no configuration's (the empty trial an older sweep asked
    Optuna for when its count was off) is ended, never run."""
    for t in confirm.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
        if "key" not in t.user_attrs:
            with suppress(UpdateFinishedTrialError):  # another process ended it first
                confirm._storage.set_trial_user_attr(t._trial_id, "message", EMPTY)
                confirm._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    for name, params in chosen:
        key = params_key(params)
        for seed in seeds:
            attrs = {"candidate": name, "params": params, "seed": seed, "key": key}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # enqueue_trial's user_attrs are marked experimental
                confirm.enqueue_trial({"candidate": key, "seed": seed}, user_attrs=attrs, skip_if_exists=True)


def finished(
    confirm: optuna.Study, chosen: list[tuple[str, dict[str, Any]]], seeds: list[int]
) -> tuple[int, int]:
    """How many of the configurations' seeds have finished (a value, or failed for good), and how many
    there are: counted by configuration and seed, never by the study's trials (retries and takeovers add
    trials, not work)."""
    wanted = {(params_key(params), seed) for _, params in chosen for seed in seeds}
    done = {
        (t.user_attrs.get("key"), t.user_attrs.get("seed"))
        for t in counted_once(confirm.get_trials(deepcopy=False))
        if t.state in (TrialState.COMPLETE, TrialState.FAIL)
    }
    return len(wanted & done), len(wanted)


def verdicts(
    confirm: optuna.Study, chosen: list[tuple[str, dict[str, Any]]], seeds: list[int]
) -> list[Verdict]:
    """Each configuration against the base, over the seeds both completed, Holm-corrected across them."""
    values: dict[str, dict[int, float]] = {}
    for t in confirm.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        values.setdefault(t.user_attrs["key"], {})[t.user_attrs["seed"]] = t.value
    base = values.get(params_key({}), {})
    return corrected(
        [
            compare(name, params, values.get(params_key(params), {}), base, seeds)
            for name, params in chosen[1:]
        ]
    )
