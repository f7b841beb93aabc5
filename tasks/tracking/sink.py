"""Training metrics into an MLflow run (MLflow's asynchronous batched logging), and MLflow's system-metrics
sampler. Every (metric, step) reaches the run exactly once, also when the run is continued after a kill.

The engine writes every logged step to `metrics.jsonl` synchronously, so what MLflow missed when a process
died (metrics still queued) is there. A sink opened on a run that already has metrics reads which steps it
holds, fills in the missing ones from `metrics.jsonl`, and drops the steps the resumed training recomputes
(bit for bit) that the run already has.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.utils.async_logging.run_operations import RunOperations
from mlflow.utils.validation import MAX_METRICS_PER_BATCH

from tasks.tracking.store import check_tracking_store, get_client
from tasks.training.metrics import read_metrics

SYSTEM_PREFIX = "system/"


class MlflowSink:
    """Implements the engine's `MetricSink` (`log_metrics`); call `close()` when training ends.

    `log_metrics` hands each step to MLflow's async logging queue and returns at once: the training
    thread never waits for the store. A batch the store refused (a brief outage) is sent again by `flush()`
    and `close()`; `close()` raises if it still cannot be written.
    """

    max_in_flight = 256  # steps whose outcome is not yet checked; older ones are waited for

    def __init__(self, run_id: str, *, uri: str | None = None, run_dir: str | Path | None = None) -> None:
        self.uri = check_tracking_store(uri)
        self._client = get_client(self.uri)
        try:
            run = self._client.get_run(run_id)
        except MlflowException as exc:
            raise ValueError(
                f"MLflow run {run_id!r} does not exist in this store; create it with tasks.tracking.store.start_run()."
            ) from exc
        self.run_id = run_id
        self._in_flight: deque[tuple[RunOperations, list[Metric]]] = deque()
        self._failed: list[Metric] = []
        self._closed = False
        self.last_error: Exception | None = None
        self._logged = self._steps_in_run(run.data.metrics)
        self.filled_in = self._fill_in(run_dir) if run_dir is not None else 0

    def _steps_in_run(self, latest: Mapping[str, float]) -> dict[str, set[int]]:
        return {
            key: {m.step for m in self._client.get_metric_history(self.run_id, key)}
            for key in latest
            if not key.startswith(SYSTEM_PREFIX)
        }

    def _fill_in(self, run_dir: str | Path) -> int:
        """Log the steps of `run_dir/metrics.jsonl` (a resumed run directory) that the run lacks."""
        before = self._count()
        for step, metrics in sorted(read_metrics(run_dir).items()):
            self.log_metrics(metrics, step)
        return self._count() - before

    def _count(self) -> int:
        return sum(len(steps) for steps in self._logged.values())

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            raise RuntimeError(f"MlflowSink for run {self.run_id} is closed; create a new one.")
        timestamp = int(time.time() * 1000)
        entries = []
        for key, value in metrics.items():
            steps = self._logged.setdefault(key, set())
            if step not in steps:
                steps.add(step)
                entries.append(Metric(key=key, value=float(value), timestamp=timestamp, step=int(step)))
        if not entries:
            return
        operation = self._client.log_batch(self.run_id, metrics=entries, synchronous=False)
        self._in_flight.append((operation, entries))
        while len(self._in_flight) > self.max_in_flight:
            self._settle(*self._in_flight.popleft())

    def _settle(self, operation: RunOperations, entries: list[Metric]) -> None:
        try:
            operation.wait()
        except MlflowException as exc:
            self._failed.extend(entries)
            self.last_error = exc

    def flush(self) -> bool:
        """Wait for what is queued and send again what the store refused; True when nothing is left."""
        while self._in_flight:
            self._settle(*self._in_flight.popleft())
        pending, self._failed = self._failed, []
        for start in range(0, len(pending), MAX_METRICS_PER_BATCH):
            try:
                self._client.log_batch(
                    self.run_id, metrics=pending[start : start + MAX_METRICS_PER_BATCH], synchronous=True
                )
            except MlflowException as exc:
                self._failed.extend(pending[start:])
                self.last_error = exc
                warnings.warn(
                    f"MLflow did not take {len(self._failed)} metrics for run {self.run_id} ({exc}); they are "
                    "sent again at the next flush.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return False
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.flush():
            raise RuntimeError(
                f"{len(self._failed)} metrics could not be written to MLflow run {self.run_id}; "
                f"last error: {self.last_error}"
            )


def start_system_metrics(run_id: str, sampling_interval_s: float = 10.0, uri: str | None = None) -> Any:
    """Start MLflow's CPU/GPU/memory/disk sampler for `run_id` in the store at `uri` (needs psutil, a
    dependency; GPUs need nvidia-ml-py). A continued run's samples go on after its last logged step.

    Returns the monitor; call `.finish()` on it when training ends.
    """
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    uri = check_tracking_store(uri)
    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=sampling_interval_s, resume_logging=True, tracking_uri=uri
    )
    monitor.start()
    return monitor
