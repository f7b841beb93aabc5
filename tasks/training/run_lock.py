"""One training job per run directory: an OS lock (`flock`) on `<run_dir>/.train.lock`, held for the job's
whole life.

The process that calls `fit` takes it, and torchrun inherits it: torchrun's restarts happen inside it, and a
stop that outlives its launcher (Prefect kills a cancelled flow run's process after its own grace; torchrun,
in a session of its own, goes on checkpointing) keeps the directory locked until the workers are done. The
kernel drops the lock when its last holder exits, so a crash or `kill -9` never leaves a stale lock behind.

A second job waits a bounded time (a retry racing its predecessor's stop checkpoint gets the directory once
that checkpoint is written, and resumes from it, or finds the run finished), then refuses with one line.
The nodes of one multi-node job share the directory: the first launcher takes the lock and records the job's
rendezvous id in it; a launcher of the same job goes ahead without it, another job's waits and refuses.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tasks.training.errors import TrainingInputError

LOCK_FILE = ".train.lock"


class RunDirectoryBusy(TrainingInputError):
    """Another training job holds the run directory."""


@dataclass(frozen=True)
class RunLock:
    fd: int | None  # None: a fellow node of the same job holds the lock, or the file system has no locks
    path: Path


def _holder_record(job: str) -> dict[str, object]:
    return {
        "job": job,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:300],
    }


def _read_holder(fd: int) -> dict[str, object] | None:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        holder = json.loads(text)
    except (OSError, ValueError):
        return None  # being written right now
    return holder if isinstance(holder, dict) else None


def describe_holder(holder: dict[str, object] | None) -> str:
    if holder is None:
        return "a training job"
    return f"job {holder.get('job')} (pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')})"


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, job: str, *, shared_by_job: bool, wait_s: float) -> Iterator[RunLock]:
    """Hold `run_dir`'s lock for job `job` for the block; raise RunDirectoryBusy when another job keeps it
    longer than `wait_s` seconds. `shared_by_job`: launchers of the same job (the nodes of a multi-node job)
    go ahead while one of them holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        lock = _acquire(fd, path, job, shared_by_job=shared_by_job, wait_s=wait_s)
        yield lock
    finally:
        os.close(fd)  # releases the lock (torchrun may hold it on, through its inherited copy)


def _acquire(fd: int, path: Path, job: str, *, shared_by_job: bool, wait_s: float) -> RunLock:
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            warnings.warn(
                f"{path.parent} is on a file system without locks ({err.strerror}): a second training job in "
                "this directory would not be refused; give every run its own checkpoint_dir",
                RuntimeWarning,
                stacklevel=3,
            )
            return RunLock(None, path)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_holder_record(job)).encode(), 0)
            os.fsync(fd)
            return RunLock(fd, path)
        holder = _read_holder(fd)
        if shared_by_job and holder is not None and holder.get("job") == job:
            return RunLock(None, path)
        if time.monotonic() >= deadline:
            raise RunDirectoryBusy(
                f"checkpoint directory {path.parent} is in use by {describe_holder(holder)}: two jobs in one "
                "directory would delete each other's checkpoints. Wait for it to end, or give this run its "
                "own checkpoint_dir"
            )
        if not told and holder is not None:
            print(
                f"[llamaflow] {path.parent} is held by {describe_holder(holder)}; waiting up to {wait_s:.0f} s "
                "for it to end",
                file=sys.stderr,
                flush=True,
            )
            told = True
        time.sleep(0.5)
