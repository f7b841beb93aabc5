"""Progress of long data work (tokenizer training, tokenization, packing) with its rate and ETA: a tqdm bar
on a terminal, and where stderr is not one (a worker, a log file, CI) a log line at most every
`LLAMAFLOW_PROGRESS_SECONDS` (default 30 s) and one when the work is done, so logs stay readable."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TextIO

from tqdm import tqdm

from tasks.data.errors import data_logger

_LINE = "{desc}: {n_fmt}{unit}/{total_fmt}{unit} ({percentage:.0f}%), {rate_fmt}, ETA {remaining}"
_LINE_UNKNOWN_TOTAL = "{desc}: {n_fmt}{unit}, {rate_fmt}"


def log_interval() -> float:
    return float(os.environ.get("LLAMAFLOW_PROGRESS_SECONDS", "30"))


class Progress:
    """Thread-safe progress of `total` units (None: unknown) of one piece of work, named `what`."""

    def __init__(
        self, what: str, total: float | None, unit: str = "B", *, stream: TextIO | None = None
    ) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.done = 0.0
        self._stream = stream if stream is not None else sys.stderr
        self._logger = data_logger()  # taken here: worker threads have no run context
        self._lock = threading.Lock()
        self._started = self._last_line = time.monotonic()
        self._every = log_interval()
        self._bar: Any = None
        self._closed = False
        self._logged = 0.0
        if self._stream.isatty():
            self._bar = tqdm(
                total=total, desc=what, unit=unit, unit_scale=True, file=self._stream, leave=True
            )

    def update(self, amount: float) -> None:
        with self._lock:
            self.done += amount
            if self._bar is not None:
                self._bar.update(amount)
                return
            now = time.monotonic()
            if now - self._last_line >= self._every:
                self._last_line, self._logged = now, self.done
                self._logger.info(self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self._started
        return tqdm.format_meter(
            self.done,
            self.total,
            elapsed,
            prefix=self.what,
            unit=self.unit,
            unit_scale=True,
            bar_format=_LINE if self.total else _LINE_UNKNOWN_TOTAL,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._logged != self.done and time.monotonic() - self._started >= self._every:
            self._logger.info(self.line())  # the last count, unless just logged (short work needs none)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def counted_bytes(texts: Iterable[str], progress: Progress) -> Iterator[str]:
    """`texts` unchanged, each text's UTF-8 size counted into `progress` (closed after the last text)."""
    for text in texts:
        progress.update(len(text.encode("utf-8")))
        yield text
    progress.close()
