"""The promotion lock (tasks.registry.lock) on a real SQLite MLflow store: one holder at a time when a holder
works past its lease, when a waiter's clock is skewed, and when two waiters find a crashed holder's lock.

Each holder records when it was inside; the intervals must not overlap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.registry.lock import promotion_lock

REPO = Path(__file__).resolve().parents[1]
LEASE_S = 1.0


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('lock-store') / 'mlflow.db'}"


@pytest.fixture()
def model() -> str:
    return f"lock-test-{uuid.uuid4().hex[:8]}"


def _client(uri: str, slow_deletes_s: float = 0.0) -> MlflowClient:
    """A client of its own (one per holder, as separate processes have); `slow_deletes_s`: a slow store,
    whose deletes take that long (the window in which another waiter acts is widened, the calls are real)."""
    client = MlflowClient(uri, registry_uri=uri)
    if slow_deletes_s:
        for method in ("delete_registered_model", "delete_model_version"):
            real = getattr(client, method)

            def slow(*args, _real=real, **kwargs):
                time.sleep(slow_deletes_s)
                return _real(*args, **kwargs)

            setattr(client, method, slow)
    return client


class Inside:
    """When each holder was inside the lock."""

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float, str]] = []
        self.errors: list[BaseException] = []
        self.entered = threading.Event()

    def hold(self, client: MlflowClient, model: str, label: str, body_s: float) -> None:
        try:
            with promotion_lock(client, model, lease_s=LEASE_S, wait_s=60):
                entered = time.monotonic()
                self.entered.set()
                time.sleep(body_s)
                self.intervals.append((entered, time.monotonic(), label))
        except BaseException as exc:
            self.errors.append(exc)

    def start(self, client: MlflowClient, model: str, label: str, body_s: float) -> threading.Thread:
        thread = threading.Thread(target=self.hold, args=(client, model, label, body_s), name=label)
        thread.start()
        return thread

    def assert_one_at_a_time(self, holders: int) -> None:
        assert not self.errors, self.errors
        spans = sorted(self.intervals)
        assert len(spans) == holders
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            assert start >= end, f"{second} entered {end - start:.2f} s before {first} left"


def test_a_holder_working_past_its_lease_keeps_the_lock(uri: str, model: str) -> None:
    inside = Inside()
    first = inside.start(_client(uri), model, "long holder", body_s=4 * LEASE_S)
    assert inside.entered.wait(30)
    inside.hold(_client(uri), model, "waiter", body_s=0.1)
    first.join()
    inside.assert_one_at_a_time(2)
    assert [label for _, _, label in sorted(inside.intervals)] == ["long holder", "waiter"]


def test_a_waiter_whose_clock_runs_an_hour_ahead_waits(
    uri: str, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    inside = Inside()
    first = inside.start(_client(uri), model, "holder", body_s=3 * LEASE_S)
    assert inside.entered.wait(30)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)  # this machine's clock is off
    inside.hold(_client(uri), model, "skewed waiter", body_s=0.1)
    first.join()
    inside.assert_one_at_a_time(2)


_CRASHING_HOLDER = """
import sys, time
from mlflow.tracking import MlflowClient
from tasks.registry.lock import promotion_lock
uri, model, lease_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
with promotion_lock(MlflowClient(uri, registry_uri=uri), model, lease_s=lease_s):
    print("HELD", flush=True)
    time.sleep(600)
"""


@pytest.fixture()
def crashed_holder(uri: str, model: str) -> Iterator[None]:
    """A process that took the lock and was killed with SIGKILL inside it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_HOLDER, uri, model, str(LEASE_S)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        yield
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_waiters_on_a_crashed_holder_never_hold_it_together(
    uri: str, model: str, crashed_holder: None
) -> None:
    """Both find the dead holder's lock within a poll of each other and break it; their deletes take 0.5 and
    1.5 s (a slow store), so the slower delete lands after the faster waiter took the lock."""
    inside = Inside()
    waiters = [inside.start(_client(uri, delay), model, f"waiter {delay}", 1.5) for delay in (0.5, 1.5)]
    for waiter in waiters:
        waiter.join()
    inside.assert_one_at_a_time(2)
