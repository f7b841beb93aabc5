"""train: the Prefect task around the training engine (`tasks.training.fit`).

The engine is plain PyTorch; this wrapper adds what only an orchestrated run has: MLflow metrics,
a progress artifact in Prefect's UI, step metrics in Prefect's logs at a readable interval, and
retries that resume from the newest checkpoint (the engine resumes whenever `checkpoint_dir` holds one).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training import MetricSink, TrainingInterrupted, TrainSettings, fit
from tasks.training.budget import BudgetTerms


def _logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("llamaflow.train")


class FanOut:
    """Sends each step's metrics to several sinks."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self.sinks = list(sinks)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log_metrics(metrics, step)


class PrefectProgress:
    """A progress artifact and a log line at most every `interval_s` seconds (and at the last step).

    The artifact is updated by a thread of its own with the latest value: an unreachable Prefect API costs
    a warning and a stale bar, never a step of training. Call `close()` when training ends."""

    def __init__(self, total_steps: int | None, interval_s: float = 15.0) -> None:
        self.total_steps = total_steps
        self.interval_s = interval_s
        self._last = 0.0
        self._artifact_id = None
        self._log = _logger()
        self._progress: float | None = None
        self._changed = threading.Event()
        self._closed = False
        self._updater: threading.Thread | None = None
        if TaskRunContext.get() is not None:
            try:
                self._artifact_id = create_progress_artifact(
                    0.0, key="training-progress", description="Optimizer steps done"
                )
            except Exception as err:
                self._log.warning(f"no progress artifact: the Prefect API did not answer ({err})")
            else:  # the thread runs in this context: the task run and the API it talks to
                context = contextvars.copy_context()
                self._updater = threading.Thread(
                    target=context.run, args=(self._update_loop,), name="prefect-progress", daemon=True
                )
                self._updater.start()

    def _update_loop(self) -> None:
        failing = False
        while True:
            self._changed.wait()
            self._changed.clear()
            progress = self._progress
            if progress is not None:
                try:
                    update_progress_artifact(self._artifact_id, progress=progress)
                except Exception as err:
                    if not failing:
                        self._log.warning(f"training progress not shown in Prefect: {err}; training goes on")
                    failing = True
                else:
                    failing = False
            if self._closed and not self._changed.is_set():
                return

    def close(self, timeout_s: float = 10.0) -> None:
        """Send the last value (waiting at most `timeout_s` for the API) and stop the thread."""
        self._closed = True
        self._changed.set()
        if self._updater is not None:
            self._updater.join(timeout_s)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        total = int(metrics.get("train/total_steps", self.total_steps or 0)) or None
        now = time.monotonic()
        if now - self._last < self.interval_s and step != total:
            return
        self._last = now
        shown = {k.removeprefix("train/"): v for k, v in metrics.items() if k != "train/total_steps"}
        text = " ".join(f"{k}={v:.4g}" for k, v in shown.items())
        self._log.info(f"step {step}/{total or '?'} {text}")
        if self._artifact_id is not None and total:
            self._progress = 100.0 * step / total
            self._changed.set()


def train(
    model: ModelRef,
    dataset: DatasetRef,
    settings: TrainSettings,
    run_dir: str,
    *,
    run_id: str | None = None,
    log_interval_s: float = 15.0,
    budget: BudgetTerms | None = None,
) -> CheckpointRef:
    """Train `model` on `dataset` in `run_dir` (resuming what it holds); metrics go to MLflow run `run_id`.

    The run id is kept in `run_dir` beside the checkpoints, so a rerun that resumes them continues the
    same MLflow run (`tasks.tracking.runs`); the sink fills in the steps MLflow missed before a kill.
    `budget` (with settings.time_budget): when the flow's budget started and what follows training; the
    plan's numbers reach MLflow as `budget/*` metrics with the first step.
    """
    progress = PrefectProgress(settings.max_steps, log_interval_s)
    sinks: list[MetricSink] = [progress]
    mlflow_sink, monitor = None, None
    if run_id is not None:
        from tasks.tracking.runs import write_run_record
        from tasks.tracking.sink import MlflowSink, start_system_metrics, stop_system_metrics

        write_run_record(run_dir, run_id)
        mlflow_sink = MlflowSink(run_id, run_dir=run_dir)
        sinks.append(mlflow_sink)
        monitor = start_system_metrics(run_id)
    try:
        checkpoint = fit(model, dataset, settings, run_dir, FanOut(sinks), budget=budget)
    except BaseException:
        if mlflow_sink is not None:
            try:  # what it cannot write now is in metrics.jsonl, for the run that continues this one
                mlflow_sink.close(timeout_s=10.0)
            except Exception as err:  # the training error is the one to report
                _logger().warning(f"could not write the last metrics to MLflow: {err}")
        raise
    finally:
        progress.close()
        if monitor is not None:
            stop_system_metrics(monitor)
    if mlflow_sink is not None:
        mlflow_sink.close()
    return checkpoint


def retry_unless_stopped(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition of the train task: retry crashes and errors, never a deliberate stop.

    Cancelling a run sends SIGTERM; training stops after a checkpoint and raises TrainingInterrupted.
    Retrying that would resume training in a run that is being cancelled, until Prefect's SIGKILL.
    """
    try:
        state.result()
    except TrainingInterrupted:
        return False
    except BaseException:
        return True
    return True


train_task = task(
    train, name="train", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_stopped
)
