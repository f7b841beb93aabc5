"""Training metrics into an MLflow run: a buffered metric sink, and MLflow's system-metrics sampler."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import mlflow
from mlflow.entities import Metric
from mlflow.utils.validation import MAX_METRICS_PER_BATCH

from tasks.tracking.store import check_tracking_store, get_client, use_tracking_uri


class MlflowSink:
    """Buffers per-step metrics and writes them with `log_batch`.

    One synchronous MLflow call per metric costs ~20 ms on SQLite and a round trip on a server; the
    sink flushes every `flush_every_steps` distinct steps or `flush_every_s` seconds, and on `close()`.
    A failed flush (store briefly unreachable) warns and keeps the metrics for the next one, so a
    tracking hiccup does not kill training; `close()` raises if they still cannot be written.
    Implements the engine's `MetricSink` (`log_metrics`); call `close()` when training ends.
    """

    max_buffered = 200_000

    def __init__(
        self,
        run_id: str,
        *,
        uri: str | None = None,
        flush_every_steps: int = 50,
        flush_every_s: float = 10.0,
    ) -> None:
        if flush_every_steps < 1:
            raise ValueError(f"flush_every_steps must be >= 1, got {flush_every_steps}.")
        self.run_id = run_id
        self.uri = check_tracking_store(uri)
        self._client = get_client(self.uri)
        try:
            self._client.get_run(run_id)
        except mlflow.exceptions.MlflowException as exc:
            raise ValueError(
                f"MLflow run {run_id!r} does not exist in {self.uri}; create it with tasks.tracking.store.start_run()."
            ) from exc
        self._flush_every_steps = flush_every_steps
        self._flush_every_s = flush_every_s
        self._buffer: list[Metric] = []
        self._steps_buffered: set[int] = set()
        self._new_since_flush = 0
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self.flushes = 0
        self.failed_flushes = 0
        self.dropped = 0
        self.last_error: Exception | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            raise RuntimeError(f"MlflowSink for run {self.run_id} is closed; create a new one.")
        timestamp = int(time.time() * 1000)
        entries = []
        for key, value in metrics.items():
            entries.append(Metric(key=key, value=float(value), timestamp=timestamp, step=int(step)))
        with self._lock:
            self._buffer.extend(entries)
            self._steps_buffered.add(int(step))
            self._new_since_flush += len(entries)
            due = (
                len(self._steps_buffered) >= self._flush_every_steps
                or time.monotonic() - self._last_flush >= self._flush_every_s
                or self._new_since_flush >= MAX_METRICS_PER_BATCH
            )
        if due:
            self.flush()

    def flush(self) -> bool:
        """Write everything buffered; False (with a warning, metrics kept) if the store refused."""
        with self._lock:
            pending, self._buffer = self._buffer, []
            self._steps_buffered = set()
            self._new_since_flush = 0
            self._last_flush = time.monotonic()
        sent = 0
        try:
            while sent < len(pending):
                chunk = pending[sent : sent + MAX_METRICS_PER_BATCH]
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)
                sent += len(chunk)
        except Exception as exc:  # any store failure: keep the metrics and let training go on
            with self._lock:
                self._buffer = pending[sent:] + self._buffer
                overflow = len(self._buffer) - self.max_buffered
                if overflow > 0:
                    del self._buffer[:overflow]
                    self.dropped += overflow
            self.failed_flushes += 1
            self.last_error = exc
            warnings.warn(
                f"MLflow did not take {len(pending) - sent} metrics for run {self.run_id} ({exc}); "
                f"{len(self._buffer)} kept for the next flush, {self.dropped} dropped so far.",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        if pending:
            self.flushes += 1
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.flush() or self.dropped:
            raise RuntimeError(
                f"{len(self._buffer)} metrics could not be written to MLflow run {self.run_id} at close "
                f"and {self.dropped} were dropped earlier; last error: {self.last_error}"
            )


def start_system_metrics(
    run_id: str, sampling_interval_s: float = 10.0, uri: str | None = None
) -> Any | None:
    """Start MLflow's CPU/GPU/memory/disk sampler for `run_id` (needs psutil, a dependency).

    Returns the monitor; call `.finish()` on it when training ends.
    """
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # MLflow 3.17's monitor reads the process-wide URI in places even when given its own, so both are set:
    # a stale process-wide URI (another store, a stopped server) would stall it in HTTP retries.
    uri = use_tracking_uri(uri)
    monitor = SystemMetricsMonitor(run_id, sampling_interval=sampling_interval_s, tracking_uri=uri)
    monitor.start()
    return monitor
