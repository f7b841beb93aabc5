"""Long-running helper processes (servers, workers): start them detached, wait until they answer, and stop
them with everything they started.

Servers and Prefect's process worker start children in new sessions (every flow run gets its own), so
killing one process group leaves processes behind: `stop_tree` collects every descendant first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil


class ProcessError(RuntimeError):
    """A helper process did not start; the message holds the end of its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_tree(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM `pid`, its descendants and their process groups; SIGKILL what is left after `grace_s`.

    Servers and Prefect's flow-run processes start their children in new sessions, so killing one
    process group is not enough: every descendant is collected first.
    """
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for proc in left:
        _signal_group(proc.pid, signal.SIGKILL)
    psutil.wait_procs(left, timeout=5)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(pid), sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def start_detached(args: Sequence[str], env: Mapping[str, str], log: Path) -> int:
    """Start a server in its own session (it outlives this command); output to `log`."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(args),
            env=dict(env),
            cwd=log.parent,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc.pid


def wait_http(url: str, pid: int, log: Path, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            raise ProcessError(f"{what} exited while starting; its log {log} ends with:\n{tail(log)}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.5)
    raise ProcessError(f"{what} not healthy at {url} after {timeout_s:.0f} s; log {log}:\n{tail(log)}")


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"
