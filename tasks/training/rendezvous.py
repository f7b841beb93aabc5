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
from datetime import timedelta
from pathlib import Path

from tasks.network import is_loopback
from tasks.training.errors import TrainingInputError
from tasks.training.settings import TrainSettings

NODE_ADDR_ENV = (
    "LLAMAFLOW_NODE_ADDR"  # this machine's address as the other nodes reach it (overrides the guess)
)
# The interface whose address this machine gives (eth0, ib0): one name for every node, so a batch script can
# export it once (srun copies a batch script's LLAMAFLOW_NODE_ADDR to every node, and every node would claim it).
NODE_IFACE_ENV = "LLAMAFLOW_NODE_IFACE"
ARRIVALS_DIR = ".rendezvous"
# The rendezvous stores this process serves, by port: node 0's launcher binds the port and serves the store
# for the job's life (torchrun's c10d agents, on every node, connect to it as clients).
_SERVED: dict[int, object] = {}


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
    place, can reach), or `LLAMAFLOW_NODE_ADDR`, or the address of interface `LLAMAFLOW_NODE_IFACE`; None when
    no route is found. No packet is sent."""
    if os.environ.get(NODE_ADDR_ENV):
        return os.environ[NODE_ADDR_ENV]
    if os.environ.get(NODE_IFACE_ENV):
        return interface_address(os.environ[NODE_IFACE_ENV])
    try:
        infos = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.connect(address)  # UDP: picks the route and the source address, sends nothing
            return str(probe.getsockname()[0])
    return None


def interface_address(name: str) -> str:
    """The first address (IPv4 before IPv6) of this machine's interface `name`."""
    import psutil  # here: only a multi-node launch needs it (the GPU image's check runs without psutil)

    addresses = psutil.net_if_addrs().get(name)
    found = sorted(
        (a.family != socket.AF_INET, a.address.split("%")[0])
        for a in addresses or []
        if a.family in (socket.AF_INET, socket.AF_INET6)
    )
    if not found:
        known = ", ".join(sorted(psutil.net_if_addrs()))
        raise TrainingInputError(
            f"{NODE_IFACE_ENV}={name}: this machine ({socket.gethostname()}) has no interface {name} with an "
            f"address (it has {known}): name the interface of the network the nodes share"
        )
    return found[0][1]


def local_address(settings: TrainSettings) -> str | None:
    """The address this node gives the other nodes (torchrun's `--local-addr`, and MASTER_ADDR where global
    rank 0 lands): this machine's address toward the endpoint, or `LLAMAFLOW_NODE_ADDR`.

    Raises TrainingInputError for a loopback address while the endpoint is not a loopback one: the nodes
    then run on different machines, which cannot reach this one there. On Debian and Ubuntu a machine's
    own hostname maps to 127.0.1.1 in /etc/hosts, so an endpoint naming node 0 leads node 0 there."""
    if settings.nnodes == 1 or settings.rdzv_endpoint is None:
        return None
    host, _ = split_endpoint(settings.rdzv_endpoint)
    local = node_address(host)
    if local is not None and is_loopback(local) and not is_loopback(host):
        given = f"{NODE_ADDR_ENV}={local}" if os.environ.get(NODE_ADDR_ENV) else f"the route to {host}"
        raise TrainingInputError(
            f"node {settings.node_rank}: this node's address for the other nodes would be {local} ({given}), "
            f"a loopback address, while the rendezvous endpoint {settings.rdzv_endpoint} is not: the other "
            f"machines cannot reach it there (a hostname mapped to 127.0.1.1 in /etc/hosts does this). Set "
            f"{NODE_ADDR_ENV} to this machine's address on the network the nodes share (e.g. "
            f"{NODE_ADDR_ENV}=$(hostname -I | cut -d' ' -f1), set on that machine), or {NODE_IFACE_ENV} to the "
            f"interface of that network (e.g. {NODE_IFACE_ENV}=eth0: one name for every node), or give "
            "rdzv_endpoint as that address"
        )
    return local


def is_this_machine(host: str) -> bool:
    """Whether `host` (a name or an address) is an address of this machine: one it can bind to."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.bind((address[0], 0))
            return True
    return False


def transport_env(settings: TrainSettings, env: dict[str, str]) -> dict[str, str]:
    """Where the workers' gloo connections go: the interface holding this node's address. gloo otherwise
    binds to what this machine's hostname resolves to, on a Debian host 127.0.1.1, which the other nodes
    cannot reach ("Gloo connectFullMesh failed ... remote=[127.0.1.1]"). A GLOO_SOCKET_IFNAME already set wins."""
    if settings.nnodes == 1 or env.get("GLOO_SOCKET_IFNAME"):
        return {}
    local = local_address(settings)
    if local is None:
        return {}
    import psutil  # here: only a multi-node launch needs it (the GPU image's check runs without psutil)

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return {"GLOO_SOCKET_IFNAME": name}
    return {}


def serve_store(address: str, port: int = 0, timeout_s: float = 300) -> str:
    """Serve the job's rendezvous store from this process on `port` of every interface (0: a port the kernel
    picks, bound at once), for as long as this process lives or until `stop_serving`; return the endpoint
    `address:port` the other nodes connect to. The port is bound by the process that serves it, when it is
    chosen: never drawn first and bound later (torchrun's own c10d host binds only after node 0's data
    stages, and any process may take the port meanwhile). Serving the port again is a no-op."""
    from torch.distributed import TCPStore

    if port not in _SERVED:
        try:
            store = TCPStore(
                address, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
            )
        except RuntimeError as err:  # DistNetworkError: EADDRINUSE, EACCES
            raise TrainingInputError(
                f"node 0 cannot serve the rendezvous store on port {port} of {socket.gethostname()} ({err}): "
                "another process holds it; give rdzv_endpoint (or the launcher's port) a free port"
            ) from err
        port = store.port
        _SERVED[port] = store
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{port}"


def stop_serving(endpoint: str) -> None:
    _SERVED.pop(split_endpoint(endpoint)[1], None)  # the last reference: the server closes


@contextlib.contextmanager
def served_store(settings: TrainSettings) -> Iterator[None]:
    """Node 0 of a multi-node job serves the rendezvous store at its endpoint's port while the block runs,
    unless this process serves it already (a launcher that bound the port when it chose it: SLURM, pool)."""
    if settings.nnodes == 1 or settings.node_rank != 0 or settings.rdzv_endpoint is None:
        yield
        return
    host, port = split_endpoint(settings.rdzv_endpoint)
    if port in _SERVED:
        yield
        return
    endpoint = serve_store(host, port, settings.rdzv_timeout_s)
    try:
        yield
    finally:
        stop_serving(endpoint)


def worker_store(settings: TrainSettings, timeout: timedelta) -> object | None:
    """Where the workers of a multi-node job meet (a torchrun rank calls it): node 0's rendezvous store,
    served by its launcher, under a prefix of this rendezvous round; None on one node. Not a store that global
    rank 0 would bind at MASTER_PORT, a port its agent drew free and let go (any process may take it in the
    meantime): MASTER_PORT only names the round here, drawn anew each round and the same for all its workers."""
    if settings.nnodes == 1 or settings.rdzv_endpoint is None:
        return None
    from torch.distributed import PrefixStore, TCPStore

    host, port = split_endpoint(settings.rdzv_endpoint)
    store = TCPStore(host, port, is_master=False, timeout=timeout)
    env = os.environ
    return PrefixStore(
        f"llamaflow/workers/{env.get('TORCHELASTIC_RUN_ID')}/{env['MASTER_ADDR']}:{env['MASTER_PORT']}", store
    )


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
        command += [
            f"--nnodes={settings.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={settings.rdzv_endpoint}",
            f"--rdzv-id={job_id(settings, run_dir)}",
            f"--rdzv-conf={rdzv_conf(settings)}",
        ]
        local = local_address(settings)
        if local is not None:
            command.append(f"--local-addr={local}")
    return [*command, "-m", "tasks.training.rank", str(spec_path)]


def rdzv_conf(settings: TrainSettings) -> str:
    """torchrun's c10d options. No torchrun hosts the store: node 0's launcher serves it (`served_store`),
    every agent connects to it. Said, not guessed: torch otherwise compares the endpoint with this machine's
    hostname and addresses, which on a Debian host (hostname on 127.0.1.1) or a machine with several
    interfaces leaves the store unhosted, and on one machine makes every node try to host it. A node waits
    for the store as long as for the rendezvous (torch's `read_timeout`, 60 s by default, not
    `join_timeout`, bounds the wait for node 0, which may still be preparing its data)."""
    timeout = settings.rdzv_timeout_s
    return f"join_timeout={timeout},read_timeout={timeout},is_host=false"


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


def rank_input_error(agent_error: str | None) -> str | None:
    """The message of the TrainingInputError a rank ended with (bad input found on a rank: checkpoints
    that do not fit the settings, none valid), when it is the job's root cause; None otherwise. A rank's
    exception reaches the agent's error file as `TYPE: MESSAGE` through torchrun's `@record` (rank.py)."""
    kind, sep, message = (agent_error or "").partition(": ")
    names = {cls.__name__ for cls in (TrainingInputError, *TrainingInputError.__subclasses__())}
    return message.strip() if sep and kind in names and message.strip() else None


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
    if agent_error is not None and agent_error.startswith("RendezvousConnectionError"):
        return (
            f"node {settings.node_rank} could not reach the rendezvous store at {settings.rdzv_endpoint} within "
            f"rdzv_timeout_s={settings.rdzv_timeout_s} s: check that node 0 (node_rank=0, the machine at that "
            f"address, which hosts the store) started and that this node reaches it (firewall). " + resume
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
