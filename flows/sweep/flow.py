"""The `sweep` flow: search PretrainConfig values with Optuna, every trial a real `pretrain` run.

    python -m flows.sweep benchmarks/sweeps/muon_weight_decay.yaml
    python -m flows.sweep spec.yaml --register        # then train the winner under the base's model name

    from flows.sweep import sweep
    from flows.sweep.spec import load_spec
    result = sweep(load_spec("spec.yaml"))

The spec (flows/sweep/spec.py) names a base configuration and a space; Optuna (flows/sweep/study.py) draws
each trial's values and keeps the study in a store that outlives the process, so the same command after a
crash or kill -9 goes on where it stopped; each trial (flows/sweep/trials.py) is a pretrain run with its
own MLflow run nested under the sweep's (flows/sweep/report.py), not registered (`register_trials: true`
registers each under a model name of the sweep's own, `<model_name>-sweep-<name>`), so no trial moves the
aliases of the base's model; the winner is registered once, under the base's name, when asked.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import optuna
from optuna.trial import TrialState
from prefect import flow
from pydantic import BaseModel

from flows.sweep import confirm, loop
from flows.sweep.claims import Claimed, stop_requested
from flows.sweep.command import pretrain_command
from flows.sweep.gpus import GpuPool, host_gpus, trials_at_once
from flows.sweep.parents import pin_parents
from flows.sweep.report import (
    Recommendation,
    confirmation_lines,
    log_confirmation,
    log_results,
    markdown_table,
    open_parent,
    recommend,
    trial_rows,
)
from flows.sweep.runs import SweepContext, TrialPlan
from flows.sweep.spec import SweepSpec, check_spec
from flows.sweep.study import (
    counts,
    home_free,
    open_study,
    storage_url,
    study_uid,
    suggest,
    trial_key,
    trials_dir,
)
from flows.sweep.trials import run_trial
from tasks.home import apply_embedded_defaults
from tasks.register import RUN_TAG_VERSION
from tasks.tracking import store


class SweepResult(BaseModel):
    name: str
    trials: dict[str, int]
    best_params: dict[str, Any] | None
    best_value: float | None
    command: str | None  # the recommended `python -m flows.pretrain` command
    confirmation: list[str]
    parent_run_id: str
    storage: str


@flow(name="sweep", log_prints=True, validate_parameters=True)
def sweep(spec: SweepSpec, register_winner: bool | None = None) -> SweepResult:
    """Run the sweep `spec` (or continue it: the study is found by its name in its storage)."""
    apply_embedded_defaults()
    spec = check_spec(spec)
    uri = store.check_tracking_store()
    study = open_study(spec)
    ctx = _context(spec, uri, study)
    done = counts(study)
    print(
        f"sweep {spec.name}: {spec.n_trials} trials, {spec.sampler} sampler, pruner {spec.pruner.name}, "
        f"{ctx.at_once} at a time ({spec.launch}"
        + (f", {spec.gpus_per_trial} GPU(s) each" if ctx.gpus else "")
        + f"); study in {home_free(storage_url(spec))}"
        + (
            f"; continuing: {done['complete']} complete, {done['pruned']} pruned, {done['running']} to resume"
            if sum(done.values())
            else ""
        )
    )
    print(f"MLflow: {store.run_link(ctx.parent_run_id, uri)}")
    try:
        result = _search_and_confirm(spec, ctx, study, register_winner)
    except BaseException as err:  # the sweep's run says how it ended; a rerun sets it RUNNING again
        store.end_run(ctx.parent_run_id, "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", uri)
        raise
    store.end_run(ctx.parent_run_id, "FINISHED", uri)
    return result


def _search_and_confirm(
    spec: SweepSpec, ctx: SweepContext, study: optuna.Study, register_winner: bool | None
) -> SweepResult:
    started = time.monotonic()

    def search() -> None:
        plan_for = loop.search_plan(ctx, study)
        loop.run_trials(study, ctx, spec.n_trials, plan_for, draw=lambda t: suggest(t, spec))

    try:
        search()
        if spec.seeds:
            loop.wait_for_other_sweeps(study, ctx, search)  # the candidates come from the whole study
    finally:
        log_results(spec, study, ctx.parent_run_id, ctx.uri)
    print(markdown_table(trial_rows(study)))
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    best = min(complete, key=lambda t: t.value) if complete else None
    found = _confirm(spec, ctx, study) if spec.seeds and best is not None else None
    advice = recommend(spec, best, found, ctx.values)
    confirmation = confirmation_lines(found, spec.seeds, spec.metric) if found else []
    lines = [*confirmation, *advice.lines]
    if register_winner if register_winner is not None else spec.register_winner:
        lines += _register_winner(spec, ctx, advice)
    elapsed = f"this process: {time.monotonic() - started:,.0f} s"
    print("\n".join(["", "=" * 72, *lines, elapsed, "=" * 72]))
    return SweepResult(
        name=spec.name,
        trials=counts(study),
        best_params=best.params if best else None,
        best_value=best.value if best else None,
        command=None if advice.params is None else pretrain_command(ctx.values(advice.params)),
        confirmation=confirmation,
        parent_run_id=ctx.parent_run_id,
        storage=home_free(storage_url(spec)),
    )


def _context(spec: SweepSpec, uri: str, study: optuna.Study) -> SweepContext:
    """Where the trials report to, and the concurrency limit they share with every other sweep."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    at_once = trials_at_once(spec)  # before anything starts: too few GPUs is refused here
    with get_client(sync_client=True) as client:
        api_url = str(client.api_url).rstrip("/")
        limit = None
        # The embedded API is this process's temporary server: no other sweep shares it, and it keeps
        # concurrency leases in memory, so a slot it counted would outlive a kill -9 of this process.
        if PREFECT_API_URL.value():
            limit = spec.concurrency_limit or _default_limit(spec, client)
            _ensure_limit(client, limit, at_once, own=spec.concurrency_limit is not None)
    uid, directory = study_uid(study), trials_dir(spec.name, study)
    pins = pin_parents(spec, study, uri)
    gpus = (
        GpuPool(host_gpus(), spec.gpus_per_trial) if spec.gpus_per_trial and spec.launch == "local" else None
    )
    parent = open_parent(spec, study, uri)
    started = time.time()
    ctx = SweepContext(spec, uri, parent, api_url, limit, uid, directory, pins, at_once, gpus)
    ctx.stop_asked = lambda: stop_requested(study, started)
    return ctx


def _default_limit(spec: SweepSpec, client: Any) -> str:
    if spec.launch == "local":
        return f"llamaflow-sweeps-{socket.gethostname()}"
    pool = client.read_deployment_by_name(spec.deployment).work_pool_name
    return f"llamaflow-sweeps-{pool}"


def _ensure_limit(client: Any, name: str, slots: int, *, own: bool) -> None:
    """The limit, created with `slots`; the host's default one (`own` False) is raised to the largest
    `parallel` asked for, so the first sweep on a host does not hold the others to its own."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    try:
        found = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
        print(f"concurrency limit {name!r} created with {slots} slots, shared by every sweep that uses it")
        return
    if found.limit >= slots:
        return
    if not own:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=slots))
        print(f"concurrency limit {name!r} raised from {found.limit} to {slots} slots (parallel={slots})")
        return
    print(
        f"note: concurrency limit {name!r} holds {found.limit} slots, fewer than parallel={slots}: trials wait "
        f"for a slot (raise it with `prefect gcl update {name} --limit {slots}`)"
    )


# ---------------------------------------------------------------------- confirmation and the winner


def _confirm(spec: SweepSpec, ctx: SweepContext, study: optuna.Study) -> list:
    """Rerun the best `confirm_top` configurations and the base once per seed (flows/sweep/confirm.py);
    the verdicts compare each with the base seed by seed."""
    chosen = confirm.candidates(spec, study)
    study_of_seeds = open_study(
        spec, suffix=".confirm", pruned=False, sampler=optuna.samplers.RandomSampler(seed=spec.seed)
    )
    confirm.enqueue(study_of_seeds, chosen, spec.seeds)
    done, total = confirm.finished(study_of_seeds, chosen, spec.seeds)
    print(
        f"confirmation: {len(chosen)} configurations x {len(spec.seeds)} seeds ({done} of {total} finished)"
    )

    def plan_for(claimed: Claimed) -> TrialPlan:
        a, key = claimed.params, trial_key(study_of_seeds, claimed.trial)
        label = f"confirm-{a['key']}-seed{a['seed']}"
        extra = {"seed": a["seed"]}
        return loop.plan(
            ctx, claimed.trial.number, "confirm", a["params"], label, extra, claimed.adopted, key
        )

    loop.run_trials(study_of_seeds, ctx, None, plan_for, draw=loop.attrs_of)  # the queue is the work
    result = confirm.verdicts(study_of_seeds, chosen, spec.seeds)
    if not result:
        print("confirmation: the best configurations are the base itself; nothing to compare")
    log_confirmation(ctx.parent_run_id, result, ctx.uri)
    return result


def _register_winner(spec: SweepSpec, ctx: SweepContext, advice: Recommendation) -> list[str]:
    """Train the recommended configuration once more under the base's model name: the registry's own rule
    (the alias moves only when it is better) decides, exactly as for the printed command."""
    if not advice.params:
        return ["nothing registered: " + ("no trial completed" if advice.params is None else "keep the base")]
    key = f"{ctx.study_uid}.winner"
    plan = loop.plan(ctx, -1, "winner", advice.params, "winner", {}, adopted=False, key=key)
    print(f"registering the winner: {pretrain_command(ctx.values(advice.params))}")
    outcome = run_trial(plan, None, ctx)
    if outcome.state != TrialState.COMPLETE or outcome.run_id is None:
        return [f"registering the winner failed: {outcome.message}"]
    tags = store.get_client(ctx.uri).get_run(outcome.run_id).data.tags
    version = tags.get(RUN_TAG_VERSION, f"{spec.base_config().model_name}/?")  # NAME/VERSION
    return [
        f"registered: models:/{version} ({spec.metric} "
        f"{outcome.value:.5f}); the registry decided whether @{spec.base_config().alias} moved"
    ]
