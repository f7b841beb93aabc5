"""Running a study's trials: each planned (`plan`: its values, directory, key), claimed (a new draw or a
killed sweep's trial, flows/sweep/study.py), run as a Prefect task (flows/sweep/trials.py) with at most
`at_once` side by side, and told to Optuna as it ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.sweep.claims import Claimed, claim_next
from flows.sweep.command import pretrain_command
from flows.sweep.report import log_results
from flows.sweep.runs import SweepContext, TrialOutcome, TrialPlan
from flows.sweep.study import CRASHED, ENDED, origin, retry, trial_key
from flows.sweep.trials import run_trial
from tasks import home

trial_task = task(run_trial, name="trial", cache_policy=NO_CACHE, persist_result=False)
WAIT_S = 30.0  # how often a sweep looks at other processes' trials before its confirmation
STOP_WAIT_S = 300.0  # how long a stopping sweep waits for its trials' last checkpoints
STOP_CHECK_S = 5  # how often a sweep looks for a stop request (`python -m flows.sweep stop`)


class SweepStopped(KeyboardInterrupt):
    """`python -m flows.sweep stop`: the sweep stops its trials (each after a checkpoint) and ends."""


def attrs_of(trial: optuna.trial.Trial | FrozenTrial) -> dict[str, Any]:
    """A confirmation trial's candidate, values and seed (set when it was enqueued)."""
    return dict(trial.user_attrs)


def search_plan(ctx: SweepContext, study: optuna.Study) -> Callable[[Claimed], TrialPlan]:
    def plan_for(claimed: Claimed) -> TrialPlan:
        number, key = claimed.trial.number, trial_key(study, claimed.trial)
        label = f"trial-{origin(study, claimed.trial).number:03d}"  # a retry resumes its trial's directory
        return plan(ctx, number, "search", claimed.params, label, {}, claimed.adopted, key)

    return plan_for


def plan(
    ctx: SweepContext,
    number: int,
    kind: str,
    params: dict,
    label: str,
    extra: dict,
    adopted: bool,
    key: str,
) -> TrialPlan:
    spec = ctx.spec
    directory = ctx.directory / label
    values = {**ctx.values(params), **extra, "run_name": f"{spec.name}-{label}"}
    if kind != "winner":  # the winner is registered under the base's model name, the trials only if asked
        values["model_name"] = spec.sweep_model_name()
        values["register_version"] = spec.register_trials
    else:
        values["register_version"] = True
    # Its own run directory, which a resumed or retried trial continues; a pool's workers resolve it against
    # their own LLAMAFLOW_HOME (shared storage, as for any run there).
    run_dir = directory / "run"
    values["checkpoint_dir"] = str(run_dir) if spec.launch == "local" else home.portable(run_dir)
    prune = kind == "search" and spec.pruner.name != "none"
    return TrialPlan(number, kind, params, values, directory, prune, adopted, key)


def run_trials(
    study: optuna.Study,
    ctx: SweepContext,
    total: int | None,
    plan_for: Callable[[Claimed], TrialPlan],
    draw: Callable[[optuna.trial.Trial], dict[str, Any]],
) -> None:
    """Keep `parallel` trials running until `total` are finished (adopting those a killed sweep left);
    `total` None: until the study's queue is empty (flows/sweep/claims.py)."""
    spec = ctx.spec
    in_flight: dict[int, tuple[optuna.trial.Trial, Any]] = {}
    mine: set[int] = set()
    try:
        while True:
            check_stop(ctx)
            while len(in_flight) < ctx.at_once:
                claimed = claim_next(study, total, mine, draw)
                if claimed is None:
                    break
                plan = plan_for(claimed)
                mine.add(plan.number)
                first = origin(study, claimed.trial).number
                resumed = (
                    " (resumed: its sweep was stopped)"
                    if claimed.adopted
                    else f" (retry of trial {first}, which crashed)"
                    if first != plan.number
                    else ""
                )
                command = pretrain_command(ctx.values(plan.params))
                print(f"{plan.kind} trial {plan.number}{resumed}: {command}")
                future = trial_task.with_options(task_run_name=plan.run_name).submit(plan, claimed.trial, ctx)
                in_flight[plan.number] = (claimed.trial, future)
            if not in_flight:
                return
            waited = 0
            while not (done := [n for n, (_, f) in in_flight.items() if f.state.is_final()]):
                time.sleep(1.0)
                waited += 1
                if waited % STOP_CHECK_S == 0:
                    check_stop(ctx)
            for number in done:
                trial, future = in_flight.pop(number)
                _tell(study, trial, future.result(), ctx.spec.max_retries)
            log_results(
                spec, study, ctx.parent_run_id, ctx.uri, plots=False
            )  # a killed sweep leaves its table
    except BaseException:
        # Ctrl-C, a cancelled flow run, a failed trial task: stop the other trials too (each writes a
        # checkpoint and stays RUNNING in the study, released, for the next sweep to continue).
        ctx.stopping.set()
        for _, future in in_flight.values():
            future.wait(timeout=STOP_WAIT_S)
        raise


def check_stop(ctx: SweepContext) -> None:
    if ctx.stop_asked():
        raise SweepStopped("`python -m flows.sweep stop` was run")


def wait_for_other_sweeps(study: optuna.Study, ctx: SweepContext, search: Callable[[], None]) -> None:
    """Wait while other sweep processes still run trials of this study, taking over any whose process dies."""
    while running := study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        print(f"waiting for {len(running)} trial(s) other sweep processes run before the confirmation")
        for _ in range(int(WAIT_S / STOP_CHECK_S)):
            time.sleep(STOP_CHECK_S)
            check_stop(ctx)
        search()


def _tell(study: optuna.Study, trial: optuna.trial.Trial, outcome: TrialOutcome, max_retries: int) -> None:
    trial.set_user_attr("seconds", round(outcome.seconds, 1))
    trial.set_user_attr("steps", outcome.steps)
    if outcome.run_id:
        trial.set_user_attr("mlflow_run_id", outcome.run_id)
    if outcome.message:
        trial.set_user_attr("message", outcome.message[-500:])
    if outcome.crashed:
        trial.set_user_attr(ENDED, CRASHED)
    if outcome.state == TrialState.COMPLETE:
        study.tell(trial, outcome.value)
    else:
        study.tell(trial, state=outcome.state)
    value = "" if outcome.value is None else f" {outcome.value:.5f}"
    print(
        f"trial {outcome.number}: {outcome.state.name}{value} after {outcome.steps} steps, "
        f"{outcome.seconds:,.0f} s {outcome.message}".rstrip()
    )
    # A crash for infrastructure reasons (the process killed, the flow run CRASHED) is retried from the
    # trial's checkpoints; a failure of the run itself (a diverged loss, bad input) is not.
    if outcome.crashed and retry(study, trial, max_retries):
        print(
            f"trial {outcome.number} crashed for reasons outside training: it runs again from its checkpoint"
        )
