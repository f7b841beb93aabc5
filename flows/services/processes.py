"""Long-running helper processes (servers, workers): start them detached, wait until they answer, know them
again, and stop them with everything they started.

Servers and Prefect's process worker start children in new sessions (every flow run gets its own), so
killing one process group leaves processes behind: `stop_tree` collects every descendant first. A saved pid
alone proves nothing (the system reuses pids): `ProcessIdentity` adds the start (`start_mark`) and command
line, and nothing is trusted or signalled unless all three still match.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

PRIVATE_UMASK = 0o077  # what servers write (logs, artifacts, databases) is their owner's only
# What a server inherits of this process's environment: where programs are and how text is encoded. Nothing
# else: the operator's environment holds credentials (readable in /proc/PID/environ by the server's user).
_INHERITED = ("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR")


def scrubbed_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _INHERITED or k.startswith("LC_")}
    return {**env, **extra}


class ProcessError(RuntimeError):
    """A helper process did not start; the message holds the end of its log."""


def _bindable(port: int, host: str = "127.0.0.1") -> socket.socket:
    # SO_REUSEADDR as the servers set it: a port left in TIME_WAIT by a server that just stopped is free
    # to them, so it must look free here too (else a quick restart moves every URL).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with _bindable(0, host) as sock:
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server may listen on `port` of `host` (the address it binds, not always loopback)."""
    try:
        _bindable(port, host).close()
    except OSError:
        return False
    return True


def start_mark(pid: int) -> str:
    """When process `pid` started, in a form no clock adjustment changes, to tell it from a later process
    that got its pid. On Linux: the boot's id and the clock ticks from that boot to the process's start.
    Not psutil's start time there: it adds /proc/stat's `btime`, re-read on every call, which follows every
    step of the wall clock (NTP, a VM's clock set after a pause: psutil #2526), so one process's two
    readings can differ by seconds or hours. Elsewhere the kernel keeps the start as a time of day, which
    psutil returns as it was recorded. Raises psutil.NoSuchProcess when there is no such process."""
    boot = _boot_id()
    if boot is None:
        return f"{psutil.Process(pid).create_time():.6f}"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError) as err:
        raise psutil.NoSuchProcess(pid) from err
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces and ")"
    return f"{boot}+{fields[19]}"  # field 22 of proc(5), `starttime`


@functools.cache
def _boot_id() -> str | None:
    path = Path("/proc/sys/kernel/random/boot_id")
    return path.read_text().strip() if path.is_file() else None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


EXEC_WAIT_S = 1.0


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as it was seen: pid, start (`start_mark`) and command line."""

    pid: int
    started: str
    cmdline: tuple[str, ...]

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """Who `pid` is now. A process just started can show an empty command line: Popen returns when
        the exec has closed the parent's pipe, before the kernel has set up the new program's arguments
        (a quarter of the reads right after Popen, on a busy 2-core host), and a record of that empty line
        would never match the server again. It is read again until it appears (kernel threads have none)."""
        try:
            proc = psutil.Process(pid)
            cmdline = proc.cmdline()
            deadline = time.monotonic() + EXEC_WAIT_S
            while not cmdline and time.monotonic() < deadline:
                time.sleep(0.001)
                cmdline = proc.cmdline()
            return cls(pid, start_mark(pid), tuple(cmdline))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def is_running(self) -> bool:
        """The same process is still alive: same pid, start and command line (not a reused pid)."""
        now = ProcessIdentity.of(self.pid)
        return (
            now is not None
            and now.started == self.started
            and now.cmdline == self.cmdline
            and alive(self.pid)
        )


def stop_tree(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM `pid`, its descendants and the process groups they created; SIGKILL what is left after
    `grace_s`. The caller vouches for `pid` (see `ProcessIdentity`).

    Servers and Prefect's flow-run processes start their children in new sessions, so killing one
    process group is not enough: every descendant is collected first. A process group is signalled only
    when its leader is one of these processes: a group this tree did not create (the shell's, say, which a
    child may still belong to) is never signalled, only the tree's own members in it.
    """
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    own = {proc.pid for proc in procs}
    for proc in procs:
        _signal(proc.pid, signal.SIGTERM, own)
    left = _wait_gone(procs, grace_s)
    for proc in left:
        _signal(proc.pid, signal.SIGKILL, own)
    _wait_gone(left, 5.0)


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until `procs` have exited (a zombie whose parent does not reap it counts as exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        psutil.wait_procs(procs, timeout=0)  # reaps this process's own children
        left = [proc for proc in procs if alive(proc.pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _signal(pid: int, sig: signal.Signals, own: set[int]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        group = os.getpgid(pid)
        if group in own:
            os.killpg(group, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def start_detached(args: Sequence[str], env: Mapping[str, str], log: Path) -> int:
    """Start a server in its own session (it outlives this command); output to `log` (mode 0600)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)  # a log an older version wrote with the umask's mode
    with os.fdopen(fd, "ab") as out:
        proc = subprocess.Popen(
            list(args),
            env=dict(env),
            cwd=log.parent,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=PRIVATE_UMASK,
        )
    return proc.pid


def wait_http(url: str, pid: int, log: Path, what: str, timeout_s: float) -> None:
    # Whether it answers, not whom to trust: an https URL's certificate is not checked here.
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            raise ProcessError(f"{what} exited while starting; its log {log} ends with:\n{tail(log)}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=2, context=context) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.5)
    raise ProcessError(f"{what} not healthy at {url} after {timeout_s:.0f} s; log {log}:\n{tail(log)}")


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"
