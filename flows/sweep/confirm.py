"""Seed confirmation's bookkeeping: which configurations are rerun, and their runs found again by value.

The confirmation is a study of its own (`<name>.confirm`, so a killed confirmation resumes too), whose
trials are enqueued as (configuration key, seed): the key is made from the configuration's values, never
from its rank among the trials, so a configuration confirmed before is never confused with another."""

from __future__ import annotations

import warnings
from typing import Any

import optuna
from optuna.trial import TrialState

from flows.sweep.report import Verdict, compare, corrected, params_key
from flows.sweep.spec import SweepSpec, trial_values

BASE = "base"


def candidates(spec: SweepSpec, study: optuna.Study) -> list[tuple[str, dict[str, Any]]]:
    """The base, then the best `confirm_top` completed configurations that are not the base itself."""
    complete = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.value)
    base_values = trial_values(spec, {})
    return [(BASE, {})] + [
        (f"trial-{t.number}", t.params)
        for t in complete[: spec.confirm_top]
        if trial_values(spec, t.params) != base_values  # the base itself, sampled: its runs are the base's
    ]


def enqueue(confirm: optuna.Study, chosen: list[tuple[str, dict[str, Any]]], seeds: list[int]) -> int:
    """One trial per configuration and seed, unless the study holds it already; the trials to finish."""
    for name, params in chosen:
        key = params_key(params)
        for seed in seeds:
            attrs = {"candidate": name, "params": params, "seed": seed, "key": key}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # enqueue_trial's user_attrs are marked experimental
                confirm.enqueue_trial({"candidate": key, "seed": seed}, user_attrs=attrs, skip_if_exists=True)
    return len(confirm.get_trials(deepcopy=False))


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
