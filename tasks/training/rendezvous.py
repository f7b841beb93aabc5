"""What torchrun is told, and what it says when it fails: the command line (`--standalone` on one node, a
c10d rendezvous across nodes), this node's address, the arrivals of nodes in the shared run directory, and
torchrun's own error file.

Nothing here starts a server or a process group: torchrun's elastic agent does the rendezvous (its c10d
backend hosts a TCP store on the node whose address is the endpoint) and starts, watches and restarts the
workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tasks.training.settings import TrainSettings

NODE_ADDR_ENV = (
    "LLAMAFLOW_NODE_ADDR"  # this machine's address as the other nodes reach it (overrides the guess)
)
ARRIVALS_DIR = ".rendezvous"


def uses_torchrun(settings: TrainSettings) -> bool:
    """One process trains in the caller's process; more ranks, more nodes or restarts need torchrun."""
    return settings.nproc_per_node > 1 or settings.nnodes > 1 or settings.max_restarts > 0


def job_id(settings: TrainSettings, run_dir: Path) -> str:
    """The rendezvous id: `rdzv_id`, else one derived from the checkpoint directory (the same on every node,
    which all see it at the same path)."""
    if settings.rdzv_id:
        return settings.rdzv_id
    return "llamaflow-" + hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]


def lock_identity(settings: TrainSettings, run_dir: Path) -> str:
    """Who may share the run directory's lock: the nodes of one job, i.e. one id at one endpoint (a retried
    job publishes a new endpoint, so its nodes never mistake the stopping nodes of the last try for theirs)."""
    return f"{job_id(settings, run_dir)}@{settings.rdzv_endpoint}"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def node_address(toward: str) -> str | None:
    """This machine's address on the route to host `toward` (what the other nodes, which reach the same
    place, can reach), or `LLAMAFLOW_NODE_ADDR`; None when no route is found. No packet is sent."""
    if os.environ.get(NODE_ADDR_ENV):
        return os.environ[NODE_ADDR_ENV]
    try:
        infos = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.connect(address)  # UDP: picks the route and the source address, sends nothing
            return str(probe.getsockname()[0])
    return None


def free_port_on(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def torchrun_command(settings: TrainSettings, spec_path: Path, run_dir: Path) -> list[str]:
    """`python -m torch.distributed.run ... -m tasks.training.rank SPEC` for this node.

    torchrun's shutdown timeout (how long workers get after a stop signal before SIGKILL; 30 s by default)
    is the stop grace, so a stop during a slow checkpoint write or the first compile keeps its checkpoint.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={settings.nproc_per_node}",
        f"--max-restarts={settings.max_restarts}",
        f"--shutdown-timeout={settings.stop_grace_s}",
    ]
    if settings.nnodes == 1:
        command.append("--standalone")
    else:
        if settings.rdzv_endpoint is None:
            raise ValueError("nnodes > 1 needs rdzv_endpoint")  # checked by the caller with its own message
        host, _ = split_endpoint(settings.rdzv_endpoint)
        command += [
            f"--nnodes={settings.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={settings.rdzv_endpoint}",
            f"--rdzv-id={job_id(settings, run_dir)}",
            f"--rdzv-conf=join_timeout={settings.rdzv_timeout_s}",
        ]
        local = node_address(host)
        if local is not None:
            command.append(f"--local-addr={local}")
    return [*command, "-m", "tasks.training.rank", str(spec_path)]


def stop_wait_s(settings: TrainSettings) -> float:
    """How long the launcher waits for torchrun after a stop: torchrun's own shutdown timeout comes first."""
    return settings.stop_grace_s + 15.0


# ---------------------------------------------------------------- arrivals of nodes (multi-node jobs)


def _arrivals(run_dir: Path, settings: TrainSettings) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", lock_identity(settings, run_dir))
    return run_dir / ARRIVALS_DIR / safe


@contextlib.contextmanager
def arrival(run_dir: Path, settings: TrainSettings) -> Iterator[None]:
    """Mark this node as arrived in the shared run directory while its torchrun runs (for the count in the
    message of a rendezvous that times out)."""
    if settings.nnodes == 1:
        yield
        return
    folder = _arrivals(run_dir, settings)
    folder.mkdir(parents=True, exist_ok=True)
    mark = folder / f"{socket.gethostname()}-{os.getpid()}"
    mark.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}))
    try:
        yield
    finally:
        mark.unlink(missing_ok=True)


def arrived(run_dir: Path, settings: TrainSettings, since: float) -> int:
    """Nodes of this job whose launcher arrived since `since` (epoch seconds) and is still there."""
    folder = _arrivals(run_dir, settings)
    if not folder.is_dir():
        return 0
    return sum(1 for mark in folder.iterdir() if mark.stat().st_mtime >= since - 1)


# ---------------------------------------------------------------- what torchrun says when it fails


def read_agent_error(path: Path) -> str | None:
    """The exception torchrun's agent ended with (`TORCHELASTIC_ERROR_FILE`), e.g. `RendezvousTimeoutError: `."""
    try:
        record = json.loads(path.read_text())
        message = record["message"]
        return str(message["message"] if isinstance(message, dict) else message).strip() or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def failure_message(
    settings: TrainSettings, run_dir: Path, agent_error: str | None, returncode: int, started: float
) -> str:
    """One sentence for a failed torchrun: what went wrong, what to check, how to resume."""
    resume = f"Rerun with the same checkpoint_dir ({run_dir}) to resume from its newest checkpoint"
    if agent_error is not None and agent_error.startswith(
        ("RendezvousTimeoutError", "RendezvousClosedError")
    ):
        n = arrived(run_dir, settings, started)
        return (
            f"the rendezvous of job {job_id(settings, run_dir)} at {settings.rdzv_endpoint} gathered {n} of "
            f"{settings.nnodes} nodes within rdzv_timeout_s={settings.rdzv_timeout_s} s and gave up: check that "
            f"all {settings.nnodes} node runs started (on a Prefect pool, a free worker per node: start each "
            f"node's worker with --limit 1), that every node reaches {settings.rdzv_endpoint} (firewall; "
            f"{NODE_ADDR_ENV} sets the address a node gives), and that they share rdzv_id and checkpoint_dir. "
            + resume
        )
    shape = (
        f"{settings.nnodes} nodes x {settings.nproc_per_node}"
        if settings.nnodes > 1
        else str(settings.nproc_per_node)
    )
    restarts = f" after {settings.max_restarts} restarts" if settings.max_restarts else ""
    cause = f" ({agent_error.splitlines()[0][:300]})" if agent_error else ""
    lost = (
        f"; a node that stops answering fails the job within process_group_timeout_min="
        f"{settings.process_group_timeout_min:g} min"
        if settings.nnodes > 1
        else ""
    )
    ended = (
        f"was killed by {_signal_name(-returncode)}" if returncode < 0 else f"failed (exit code {returncode})"
    )
    return f"torchrun with {shape} workers {ended}{restarts}{cause}; see the workers' output above{lost}. {resume}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
