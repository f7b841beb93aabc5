"""One trial of a sweep: a `pretrain` run, started here (a child process running `python -m flows.pretrain
--config`, the command line itself) or on the pool (a run of the pretrain deployment), watched until it
ends.

The trial's MLflow run (found by a tag of its own: flows/sweep/runs.py) carries its periodic validation
scores (`val_subset/...`, logged by the engine every `eval_every` steps): they are reported to Optuna as they appear there, which works the same for a child
process and for a worker on another machine. A trial the pruner stops is stopped like any run (SIGTERM to
the child, cancellation of the flow run): training writes a checkpoint and ends. A child process also
gets SIGTERM when the sweep process dies (Linux), and a sweep that adopts a killed sweep's trial first
stops whatever of it still runs, then starts it again on the same run directory, which resumes training.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import optuna
import psutil
import yaml
from optuna.trial import TrialState

from flows.pretrain_config import PretrainConfig
from flows.services.processes import start_mark
from flows.sweep.claims import keep_alive, release
from flows.sweep.rungs import PRUNED, decision
from flows.sweep.runs import RUN_CONTEXT_ENV, TAG_KEY, RunWatch, SweepContext, TrialOutcome, TrialPlan
from flows.sweep.spec import METRICS, tokens_per_step
from tasks.home import child_pythonpath
from tasks.tracking.runs import FLOW_RUN_TAG
from tasks.training.checkpoint import checkpoint_dirs

# How often a running trial's MLflow run is read (its scores reach MLflow within ~1 s of the step).
POLL_S = float(os.environ.get("LLAMAFLOW_SWEEP_POLL_S", "2"))
LEASE_S = 120.0  # a slot of a killed sweep frees itself after this, unless the next sweep frees it first
CHILD, FLOW_RUN, LEASE = "child", "flow_run_id", "lease_id"  # trial user attributes


class SweepInterrupted(KeyboardInterrupt):
    """A trial was stopped from outside the sweep (Ctrl-C): the sweep stops, the trial stays to resume."""


def run_trial(plan: TrialPlan, trial: optuna.trial.Trial | None, ctx: SweepContext) -> TrialOutcome:
    """Run `plan` to its end; report its scores to `trial` (pruning it when the study's pruner says so)."""
    with keep_alive(trial), _pool_slot(ctx.limit, trial):  # alive while it waits for a slot too
        started = time.monotonic()
        launcher: LocalTrial | DeploymentTrial = (
            LocalTrial(plan, ctx, trial) if ctx.spec.launch == "local" else DeploymentTrial(plan, ctx, trial)
        )
        try:
            launcher.start()
            watch = RunWatch(plan, ctx, launcher.run_filter())
            (ok, message), stop_sent, shutdown = _follow(plan, trial, ctx, launcher, watch)
        finally:
            launcher.finish()
        seconds = time.monotonic() - started
    if shutdown or (not ok and not stop_sent and launcher.interrupted):
        if trial is not None:
            release(trial)
        raise SweepInterrupted(f"trial {plan.number} stopped with its sweep: {message}")
    value = watch.final_value() if ok else None
    if ok and value is not None:
        state = TrialState.COMPLETE
    elif stop_sent:
        state, message = TrialState.PRUNED, ""
    else:
        state = TrialState.FAIL
        message = message or f"the run ended without {METRICS[ctx.spec.metric][0]}"
    watch.mark(state)
    if state == TrialState.PRUNED and isinstance(launcher, LocalTrial) and not ctx.spec.keep_pruned:
        launcher.remove_checkpoints()
    crashed = state == TrialState.FAIL and launcher.crashed
    steps = watch.steps_trained()
    return TrialOutcome(plan.number, state, value, steps, watch.run_id, seconds, message, crashed)


def _follow(
    plan: TrialPlan,
    trial: optuna.trial.Trial | None,
    ctx: SweepContext,
    launcher: LocalTrial | DeploymentTrial,
    watch: RunWatch,
) -> tuple[tuple[bool, str], bool, bool]:
    """Report the run's scores until it ends, stopping it when pruned or when the sweep stops:
    ((ok, message), stop sent, stopped with the sweep)."""
    per_step = tokens_per_step(PretrainConfig(**plan.values))
    scale = per_step if ctx.spec.budget_unit == "tokens" else 1
    stop_sent, shutdown = False, False
    while True:
        ended = launcher.poll()
        if ended is None and ctx.stopping.is_set() and not stop_sent:
            launcher.stop()  # it writes a checkpoint and ends; the study keeps the trial to continue
            stop_sent = shutdown = True
        for step, value in watch.new_scores():
            if trial is None:
                continue
            trial.report(value, step * scale)
            if plan.prune and not stop_sent and trial.should_prune():
                cut = decision(trial, step, step * per_step, value)
                trial.set_user_attr(PRUNED, cut)
                print(
                    f"trial {plan.number}: pruned at rung {cut['rung']}, step {step}, {step * per_step:,} tokens "
                    f"(subset score {value:.4f}, against {[round(a['score'], 4) for a in cut['against']]}); stopping it"
                )
                launcher.stop()
                stop_sent = True
        if ended is not None:
            return ended, stop_sent, shutdown
        time.sleep(POLL_S)


@contextmanager
def _pool_slot(limit: str | None, trial: optuna.trial.Trial | None) -> Iterator[None]:
    """A slot of the global concurrency limit for the trial's lifetime. Its lease id is kept on the trial,
    so that a sweep adopting it after a kill -9 hands the dead process's slot back at once."""
    if limit is None:
        yield
        return
    # The composition `prefect.concurrency.sync.concurrency` makes, opened up for the lease id.
    from prefect.concurrency._leases import maintain_concurrency_lease
    from prefect.concurrency._sync import (
        acquire_concurrency_slots_with_lease,
        release_concurrency_slots_with_lease,
    )

    if trial is not None and (stale := trial.user_attrs.get(LEASE)):
        with suppress(Exception):  # already expired and revoked
            release_concurrency_slots_with_lease(stale)
    response = acquire_concurrency_slots_with_lease([limit], 1, lease_duration=LEASE_S, strict=True)
    if trial is not None:
        trial.set_user_attr(LEASE, str(response.lease_id))
    try:
        with maintain_concurrency_lease(response.lease_id, LEASE_S):
            yield
    finally:
        release_concurrency_slots_with_lease(response.lease_id)


class LocalTrial:
    """`python -m flows.sweep.child --config <directory>/config.yaml`: the pretrain command line, as a child."""

    def __init__(self, plan: TrialPlan, ctx: SweepContext, trial: optuna.trial.Trial | None) -> None:
        self.plan, self.ctx, self.trial = plan, ctx, trial
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped = False
        self.interrupted = False
        self.crashed = False  # killed by a signal it was not sent by the sweep (the OOM killer, an operator)
        self.log = plan.directory / "output.log"
        self.devices: list[str] = []  # its GPUs (gpus_per_trial), given back when it ends

    def start(self) -> None:
        if self.trial is not None:
            _stop_left_over(self.trial.user_attrs.get(CHILD))
        self.plan.directory.mkdir(parents=True, exist_ok=True)
        config = self.plan.directory / "config.yaml"
        config.write_text(yaml.safe_dump(self.plan.values, sort_keys=False))
        env = dict(os.environ)
        env["PREFECT_API_URL"] = self.ctx.api_url
        env["PYTHONPATH"] = child_pythonpath(env)
        context = json.loads(env.get(RUN_CONTEXT_ENV) or "{}")
        env[RUN_CONTEXT_ENV] = json.dumps({**context, TAG_KEY: self.plan.key})
        if self.ctx.at_once > 1 and "OMP_NUM_THREADS" not in env:  # trials side by side share the cores
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.ctx.at_once))
        if self.ctx.gpus is not None:
            self.devices = self.ctx.gpus.take(self.ctx.stopping)
            if not self.devices:
                raise SweepInterrupted(
                    f"trial {self.plan.number} stopped with its sweep while it waited for GPUs"
                )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        command = [sys.executable, "-m", "flows.sweep.child", str(os.getpid()), "--config", str(config)]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        if self.trial is not None:
            pid = self.process.pid
            child = {"host": socket.gethostname(), "pid": pid, "started": start_mark(pid)}
            self.trial.set_user_attr(CHILD, {**child, "gpus": self.devices} if self.devices else child)

    def remove_checkpoints(self) -> None:
        """A pruned trial's checkpoints: no one resumes them (spec.keep_pruned keeps them)."""
        run_dir = self.plan.values.get("checkpoint_dir")
        for _, path in checkpoint_dirs(Path(run_dir)) if run_dir else ():
            shutil.rmtree(path, ignore_errors=True)

    def finish(self) -> None:
        if self.ctx.gpus is not None and self.devices:
            self.ctx.gpus.give_back(self.devices)
            self.devices = []

    def run_filter(self) -> str:
        return f"tags.`{TAG_KEY}` = '{self.plan.key}'"

    def poll(self) -> tuple[bool, str] | None:
        assert self.process is not None
        code = self.process.poll()
        if code is None:
            return None
        self.interrupted = code == 130 and not self.stopped
        self.crashed = code < 0 and not self.stopped
        if self.crashed:
            return False, f"killed by signal {-code}"
        return code == 0, "" if code == 0 else f"exit code {code}: {_last_line(self.log)}"

    def stop(self) -> None:
        assert self.process is not None
        self.stopped = True
        with suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)


def _stop_left_over(child: Any, grace_s: float = 120.0) -> None:
    """Stop the process a killed sweep left running for this trial (on this host), before it runs again."""
    if not isinstance(child, dict) or child.get("host") != socket.gethostname():
        return
    try:
        process = psutil.Process(int(child["pid"]))
        if start_mark(process.pid) != str(child["started"]):
            return  # another process now has that pid
        process.send_signal(signal.SIGTERM)  # it writes a checkpoint, then ends
        process.wait(grace_s)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        process.kill()


def _last_line(path: Path) -> str:
    if not path.is_file():
        return ""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class DeploymentTrial:
    """A run of the pretrain deployment on its pool; a killed sweep's trial whose run still goes is rejoined."""

    def __init__(self, plan: TrialPlan, ctx: SweepContext, trial: optuna.trial.Trial | None) -> None:
        self.plan, self.ctx, self.trial = plan, ctx, trial
        self.flow_run_id: str | None = None
        self.interrupted = False
        self.crashed = False  # its flow run CRASHED (the worker or its machine lost), not FAILED

    def start(self) -> None:
        from prefect.deployments import run_deployment

        recorded = self.trial.user_attrs.get(FLOW_RUN) if self.trial is not None else None
        state = self._state(recorded) if recorded else None
        # Still running: rejoined. Completed while no sweep watched it (the sweep was killed): its result is
        # read from its MLflow run, not trained again. Crashed or cancelled: a new flow run on the same
        # checkpoint directory resumes it.
        if state is not None and (not state.is_final() or state.is_completed()):
            self.flow_run_id = recorded
            how = "reading the result of its completed" if state.is_completed() else "rejoining its running"
            print(f"trial {self.plan.number}: {how} flow run {recorded}")
            return
        if state is not None:
            print(
                f"trial {self.plan.number}: its flow run {recorded} ended {state.name}; a new one resumes "
                f"from {self.plan.values['checkpoint_dir']}"
            )
        from prefect.exceptions import ObjectNotFound

        try:
            flow_run = run_deployment(
                self.ctx.spec.deployment,
                parameters={"config": self.plan.values},
                timeout=0,
                tags=[f"sweep:{self.ctx.spec.name}", f"trial:{self.plan.number}"],
            )
        except ObjectNotFound as err:
            raise ValueError(
                f"deployment {self.ctx.spec.deployment!r} does not exist on the Prefect server: deploy it "
                "(prefect deploy) or name an existing one in the spec's `deployment`"
            ) from err
        self.flow_run_id = str(flow_run.id)
        if self.trial is not None:
            self.trial.set_user_attr(FLOW_RUN, self.flow_run_id)

    def _state(self, flow_run_id: str) -> Any:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id).state

    def run_filter(self) -> str:
        return f"tags.`{FLOW_RUN_TAG}` = '{self.flow_run_id}'"

    def finish(self) -> None:
        return None

    def poll(self) -> tuple[bool, str] | None:
        assert self.flow_run_id is not None
        state = self._state(self.flow_run_id)
        if state is None or not state.is_final():
            return None
        self.crashed = state.is_crashed()
        return state.is_completed(), f"flow run {self.flow_run_id} {state.name}: {state.message or ''}"

    def stop(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(
                self.flow_run_id, Cancelling(message=f"pruned by sweep {self.ctx.spec.name}")
            )
