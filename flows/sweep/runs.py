"""A trial as the sweep plans it (`TrialPlan`, what it ends as: `TrialOutcome`, the sweep around it:
`SweepContext`) and the MLflow run that records it (`RunWatch`).

The trial's run is found by a tag that names the trial and nothing else, never by its run name (a sweep
started over under the same name reuses the names): a local trial's run gets `llamaflow.sweep.key` (the
study's own id and Optuna's trial id) when the child creates it (MLflow's MLFLOW_RUN_CONTEXT), a deployment
trial's run is the one tagged with its flow run's id.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.entities import RunTag
from optuna.trial import TrialState

from flows.pretrain_config import PretrainConfig
from flows.sweep.gpus import GpuPool
from flows.sweep.parents import pinned
from flows.sweep.spec import METRICS, SweepSpec, trial_values
from tasks.tracking import store

TAG_SWEEP, TAG_TRIAL, TAG_STATE, TAG_KIND, TAG_KEY = (
    "llamaflow.sweep",
    "llamaflow.sweep.trial",
    "llamaflow.sweep.state",
    "llamaflow.sweep.kind",
    "llamaflow.sweep.key",
)
RUN_CONTEXT_ENV = "MLFLOW_RUN_CONTEXT"  # MLflow adds this JSON's tags to every run the process creates


@dataclass(frozen=True)
class TrialPlan:
    number: int  # Optuna's trial number (-1: not a trial, the winner's registration run)
    kind: str  # search | confirm | winner
    params: dict[str, Any]  # what the sampler drew (search), the candidate's values (confirm)
    values: dict[str, Any]  # the run's PretrainConfig values: base, params, budget, what the sweep sets
    directory: Path  # config.yaml and output.log here; the run's checkpoints too when it runs locally
    prune: bool
    adopted: bool
    key: str  # the trial's own tag value: its study's id and its trial id (flows.sweep.study.trial_key)

    @property
    def run_name(self) -> str:
        return str(self.values["run_name"])


@dataclass
class TrialOutcome:
    number: int
    state: TrialState
    value: float | None
    steps: int
    run_id: str | None
    seconds: float
    message: str = ""
    crashed: bool = False  # FAIL for infrastructure reasons (killed by a signal, flow run CRASHED): retried


@dataclass
class SweepContext:
    spec: SweepSpec
    uri: str  # MLflow store
    parent_run_id: str
    api_url: (
        str  # the Prefect API the trials report to (this sweep's temporary server on the embedded default)
    )
    limit: str | None  # Prefect global concurrency limit; None on the embedded API (see flows.sweep)
    study_uid: str  # the search study's own id (flows.sweep.study.study_uid)
    directory: Path  # the study's trial directories
    pins: dict[str, str] = field(default_factory=dict)  # init_from aliases pinned for the study (parents.py)
    at_once: int = 1  # trials side by side
    gpus: GpuPool | None = None  # local trials' GPUs (gpus_per_trial), else None
    stopping: threading.Event = field(default_factory=threading.Event)  # the sweep stops: so do its trials
    stop_asked: Callable[[], bool] = lambda: False  # `python -m flows.sweep stop` was run since this start

    def values(self, params: dict[str, Any]) -> dict[str, Any]:
        """A run's PretrainConfig values for these sampled values, its parent the study's pinned version."""
        return pinned(trial_values(self.spec, params), self.pins)


class RunWatch:
    """The trial's MLflow run: found by its own tag (`run_filter`), made a child of the sweep's run, read for
    scores. Looked up again until the trial ends: a trial killed before its run directory recorded its
    run starts a new one with the same tag, and the newest is the one that trains."""

    def __init__(self, plan: TrialPlan, ctx: SweepContext, run_filter: str) -> None:
        self.plan, self.ctx, self.run_filter = plan, ctx, run_filter
        self.client = store.get_client(ctx.uri)
        self.experiment = PretrainConfig(**plan.values).experiment
        self.run_id: str | None = None
        self.reported: set[int] = set()
        self.score_key = METRICS[ctx.spec.metric][1]

    def _find(self) -> str | None:
        experiment = self.client.get_experiment_by_name(self.experiment)
        if experiment is None:
            return None
        found = self.client.search_runs(
            [experiment.experiment_id],
            filter_string=self.run_filter,
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if found and found[0].info.run_id != self.run_id:
            self.run_id = found[0].info.run_id
            tags = {
                "mlflow.parentRunId": self.ctx.parent_run_id,
                TAG_SWEEP: self.ctx.spec.name,
                TAG_TRIAL: str(self.plan.number),
                TAG_KEY: self.plan.key,
                TAG_KIND: self.plan.kind,
                TAG_STATE: "RUNNING",
            }
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        return self.run_id

    def new_scores(self) -> list[tuple[int, float]]:
        if self._find() is None:
            return []
        history = self.client.get_metric_history(self.run_id, self.score_key)
        new = sorted({m.step: m.value for m in history if m.step not in self.reported}.items())
        self.reported.update(step for step, _ in new)
        return new

    def final_value(self) -> float | None:
        if self._find() is None:
            return None
        return self.client.get_run(self.run_id).data.metrics.get(METRICS[self.ctx.spec.metric][0])

    def steps_trained(self) -> int:
        if self._find() is None:
            return 0
        return max((m.step for m in self.client.get_metric_history(self.run_id, "train/loss")), default=0)

    def mark(self, state: TrialState) -> None:
        if self._find() is not None:
            self.client.set_tag(self.run_id, TAG_STATE, state.name)
