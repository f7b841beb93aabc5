"""What watches a running loop from outside the step: torch.compile's compilations, and stop signals."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class CompileWatch:
    """Counts torch.compile frame compilations (Dynamo start callbacks) to detect recompiles."""

    def __init__(self) -> None:
        self.count = 0

    def _on_start(self, *args: Any, **kwargs: Any) -> None:
        self.count += 1

    @contextmanager
    def watching(self) -> Iterator[CompileWatch]:
        handler = torch._dynamo.callback_handler
        handler.register_start_callback(self._on_start)
        try:
            yield self
        finally:
            handler.remove_start_callback(self._on_start)


class StopSignals:
    """SIGINT/SIGTERM set a flag checked after each step (handlers can only be installed in the main thread)."""

    # SIGTERMs this close to the first are the same request arriving by several paths: a batch system
    # signals every process of the job (SLURM's scancel, its time limit) and torchrun forwards its own copy.
    SAME_REQUEST_S = 2.0

    def __init__(self) -> None:
        self.received: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        echo = signum == signal.SIGTERM and now - self._first_at < self.SAME_REQUEST_S
        # The same signal twice (Ctrl-C, Ctrl-C) means: do not wait for the step. A different one is
        # usually a launcher forwarding the first (torchrun turns a terminal's SIGINT into SIGTERM).
        if self.received == name and not echo:
            raise KeyboardInterrupt(f"second {name}: stopping without a checkpoint")
        if self.received is None:
            self.received, self._first_at = name, now

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
