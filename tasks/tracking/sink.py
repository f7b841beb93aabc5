"""Training metrics into an MLflow run, and MLflow's system-metrics sampler. Every (metric, step) reaches
the run exactly once, also when the store is down for a while and when the run is continued after a kill.

The training thread only queues each step in memory: a sender thread writes the queue to the store in
batches, about once a second. When the store does not answer (a restarting server, a network outage) the
sender keeps the metrics and tries again, pausing up to 10 s between tries, with one warning per outage;
training never waits. Through a tracking server each try is one request without MLflow's client retries
(which would hold a batch for minutes after the server is back).

The engine writes every logged step to `metrics.jsonl` synchronously, so what MLflow missed when a process
died is there. A sink opened on a run that already has metrics reads which steps it holds, fills in the
missing ones from `metrics.jsonl`, and drops the steps the resumed training recomputes (bit for bit) that
the run already has. The same file backs a very long outage: past `max_buffered` metrics the oldest are
dropped from memory and read back from it when the sink closes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_METRICS_PER_BATCH

from tasks.tracking.store import check_tracking_store, get_client, redact_error
from tasks.training.metrics import read_metrics

SYSTEM_PREFIX = "system/"
# Refusals that no retry mends (the run was deleted, the credentials are wrong): close() gives up at once.
_PERMANENT = {
    "INVALID_PARAMETER_VALUE",
    "RESOURCE_DOES_NOT_EXIST",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "BAD_REQUEST",
    "INVALID_STATE",
}
_log = logging.getLogger("llamaflow.tracking")


class MlflowSink:
    """Implements the engine's `MetricSink` (`log_metrics`); call `close()` when training ends.

    `log_metrics` never waits for the store. `flush()` sends what is queued now; `close()` waits up to
    `close_timeout_s` for everything to be written and raises if it cannot (the train task's retry then
    continues the run and fills in the rest from `metrics.jsonl`).
    """

    send_interval_s = 1.0  # batches a second of steps into one request
    max_pause_s = 10.0  # between tries while the store is down
    request_timeout_s = 30.0
    max_buffered = 500_000  # metrics held in memory during an outage; older ones are read back from the file
    close_timeout_s = 300.0

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
        self.run_dir = run_dir
        self.last_error: Exception | None = None
        self._lock = threading.Condition()
        self._pending: deque[Metric] = deque()
        self._sending = 0  # metrics taken by the sender and not yet written
        self._tries = 0  # batches the sender took so far
        self._last_failed_try = 0  # the number of the last try the store refused (0: none)
        self._failures_in_a_row = 0
        self._dropped = 0
        self._hurry = False  # skip the pause before the next try (flush)
        self._closing = False
        self._closed = False
        self._logged = self._steps_in_run(run.data.metrics)
        self._sender = threading.Thread(target=self._send_loop, name=f"mlflow-sink-{run_id[:8]}", daemon=True)
        self._sender.start()
        self.filled_in = self._fill_in(run_dir) if run_dir is not None else 0

    def _steps_in_run(self, latest: Mapping[str, float]) -> dict[str, set[int]]:
        return {
            key: {m.step for m in self._client.get_metric_history(self.run_id, key)}
            for key in latest
            if not key.startswith(SYSTEM_PREFIX)
        }

    def _fill_in(self, run_dir: str | Path) -> int:
        """Queue the steps of `run_dir/metrics.jsonl` that the run lacks."""
        before = self._count()
        for step, metrics in sorted(read_metrics(run_dir).items()):
            self._queue(metrics, step)
        return self._count() - before

    def _count(self) -> int:
        with self._lock:
            return sum(len(steps) for steps in self._logged.values())

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            raise RuntimeError(f"MlflowSink for run {self.run_id} is closed; create a new one.")
        self._queue(metrics, step)

    def _queue(self, metrics: Mapping[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)
        with self._lock:
            for key, value in metrics.items():
                steps = self._logged.setdefault(key, set())
                if step not in steps:
                    steps.add(step)
                    self._pending.append(
                        Metric(key=key, value=float(value), timestamp=timestamp, step=int(step))
                    )
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Keep at most `max_buffered` metrics in memory (the lock is held); `close` reads them back."""
        excess = len(self._pending) - self.max_buffered
        if excess <= 0:
            return
        if not self._dropped:
            _log.warning(
                f"MLflow has been unreachable for {self.max_buffered:,} metrics of run {self.run_id}: the oldest "
                f"are dropped from memory and read back from {self.run_dir or 'nowhere'} when training ends"
            )
        for _ in range(excess):
            dropped = self._pending.popleft()
            self._logged[dropped.key].discard(dropped.step)
        self._dropped += excess

    # ------------------------------------------------------------------------------- the sender thread

    def _send_loop(self) -> None:
        pause = self.send_interval_s
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closing or self._hurry, timeout=pause)
                self._hurry = False
                if not self._pending:
                    if self._closing:
                        return
                    pause = self.send_interval_s
                    continue
                batch = [
                    self._pending.popleft() for _ in range(min(len(self._pending), MAX_METRICS_PER_BATCH))
                ]
                self._sending, self._tries = len(batch), self._tries + 1
                this_try = self._tries
            error = self._write(batch)
            with self._lock:
                self._sending = 0
                if error is None:
                    pause = 0.0 if len(self._pending) >= MAX_METRICS_PER_BATCH else self.send_interval_s
                    if self._failures_in_a_row:
                        _log.warning(f"MLflow takes the metrics of run {self.run_id} again")
                    self._failures_in_a_row = 0
                else:
                    self._pending.extendleft(reversed(batch))
                    self._drop_oldest()
                    self._failures_in_a_row += 1
                    self._last_failed_try, self.last_error = this_try, error
                    pause = min(self.max_pause_s, 2.0 ** (self._failures_in_a_row - 1))
                self._lock.notify_all()
                if error is not None and self._closing and _permanent(error):
                    return

    def _write(self, batch: list[Metric]) -> Exception | None:
        try:
            if self.uri.startswith(("http://", "https://")):
                self._post(batch)
            else:
                self._client.log_batch(self.run_id, metrics=batch, synchronous=True)
        except Exception as exc:
            if not self._failures_in_a_row:
                _log.warning(
                    f"MLflow did not take {len(batch)} metrics of run {self.run_id} "
                    f"({redact_error(exc, self.uri)}); training goes on, they are sent again"
                )
            return exc
        return None

    def _post(self, batch: list[Metric]) -> None:
        """One log-batch request with MLflow's own REST client (its TLS and auth settings), no retries."""
        from mlflow.protos.service_pb2 import LogBatch
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.proto_json_utils import message_to_json
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        endpoint = "/api/2.0/mlflow/runs/log-batch"
        body = LogBatch(run_id=self.run_id, metrics=[m.to_proto() for m in batch])
        response = http_request(
            get_default_host_creds(self.uri),
            endpoint,
            "POST",
            max_retries=0,
            timeout=self.request_timeout_s,
            json=json.loads(message_to_json(body)),
        )
        verify_rest_response(response, endpoint)

    # ------------------------------------------------------------------------------- flush and close

    def _left(self) -> int:
        return len(self._pending) + self._sending

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Send what is queued now (no pause before the try); True when the store took it all, False when
        it refused a try made for this flush (the metrics stay queued) or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            before = self._tries
            while self._left():
                remaining = deadline - time.monotonic()
                if self._last_failed_try > before or remaining <= 0:
                    return False
                self._hurry = True
                self._lock.notify_all()
                self._lock.wait(min(remaining, 0.1))
            return True

    def close(self, timeout_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s)
        if self._dropped and self.run_dir is not None:
            self._read_back_dropped(deadline)
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._sender.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = self._left() + self._dropped  # dropped: not read back (no run_dir, or out of time)
        if left:
            raise RuntimeError(
                f"{left} metrics could not be written to MLflow run {self.run_id}; last error: "
                f"{redact_error(self.last_error, self.uri) if self.last_error else 'none (timed out)'}"
            )

    def _read_back_dropped(self, deadline: float) -> None:
        """Queue again, from metrics.jsonl, what an outage made `_drop_oldest` let go, as the queue empties."""
        assert self.run_dir is not None
        for step, metrics in sorted(read_metrics(self.run_dir).items()):
            size = len(metrics)
            with self._lock:
                room = self._lock.wait_for(  # room for the whole step: nothing is dropped again
                    lambda size=size: len(self._pending) + size <= self.max_buffered,
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                if not room:
                    return
                self._hurry = True
                self._lock.notify_all()
            self._queue(metrics, step)
        with self._lock:
            self._dropped = 0


def _permanent(error: Exception) -> bool:
    return isinstance(error, MlflowException) and error.error_code in _PERMANENT


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


def stop_system_metrics(monitor: Any, timeout_s: float = 15.0) -> None:
    """`monitor.finish()`, waiting at most `timeout_s`: a sample stuck in MLflow's retries against an
    unreachable store (minutes) is left to finish on its own instead of holding up the end of training."""
    stopper = threading.Thread(target=monitor.finish, name="system-metrics-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        _log.warning(f"the system-metrics sampler did not stop within {timeout_s:.0f} s (the store is slow)")
