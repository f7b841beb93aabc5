"""Several hosts on this machine, for tests of what only separate machines show (hostnames, addresses,
node-local disks): each host a Linux network + UTS + mount namespace that this helper creates and removes.

    with cluster(tmp_path, ["head", "node1"]) as hosts:
        server = hosts["head"].popen([sys.executable, "-m", "http.server", "--bind", hosts["head"].address])
        hosts["node1"].run(["curl", f"http://head:8000/"])

A host has
- its own network namespace, linked to every other host by a veth pair (a full mesh: no bridge, no route
  or NAT to any other interface; addresses in 198.18.0.0/15, the benchmarking range), loopback up;
- its own hostname, mapped to 127.0.1.1 in its own /etc/hosts as Debian and Ubuntu install it, with the
  other hosts' names mapped to their addresses (`ip netns exec` binds /etc/netns/NS/hosts over /etc/hosts);
- a node-local directory, `Cluster.local` (the same path on every host, a different directory on each; the
  other hosts' directories are hidden from it), and the shared directory `Cluster.shared` (the cluster's
  shared file system: the same directory at the same path everywhere).

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), `ip` (iproute2) and `unshare`/`mount` (util-linux).
`HostsUnavailable` says why when they are missing; tests turn it into a failure, never a skip.

Everything is removed on exit, after a failure or Ctrl-C too: every process still running in a host's
network namespace is killed, then the namespaces and their /etc/netns files go. Namespace names carry this
process's id; namespaces left by a process that no longer exists (killed with SIGKILL) are removed the next
time a cluster is built.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "lfh"  # every namespace this helper makes: lfh<pid>-<token>-<index>
NETNS_ETC = Path("/etc/netns")
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-\d+$")
# Runs inside `ip netns exec NS`: own hostname, own mounts (private: nothing propagates back), the host's
# directory bound at the node-local path, the other hosts' directories hidden under a tmpfs.
_ENTER = 'hostname "$1" && mount --bind "$2" "$3" && mount -t tmpfs lfh-hidden "$4" && shift 4 && exec "$@"'


class HostsUnavailable(RuntimeError):
    """This machine (or user) cannot build namespaced hosts; the message says what is missing."""


@dataclass
class Host:
    name: str
    netns: str
    address: str
    cluster: Cluster
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run on this host."""
        c = self.cluster
        return [
            "ip", "netns", "exec", self.netns,
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", _ENTER, "sh", self.name, str(c.hosts_dir / self.name), str(c.local), str(c.hosts_dir),
            *argv,
        ]  # fmt: skip

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on this host (in a session of its own); killed at the latest when the cluster ends."""
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.processes.append(process)
        return process

    def run(self, argv: Sequence[str], *, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def kill_all(self) -> None:
        """SIGKILL every process on this host (a machine that dies): whatever runs in its network namespace."""
        for _ in range(50):
            pids = _netns_pids(self.netns)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)


@dataclass
class Cluster:
    root: Path
    hosts: dict[str, Host]

    @property
    def shared(self) -> Path:
        """The shared file system: the same directory on every host (and in the test's own process)."""
        return self.root / "shared"

    @property
    def local(self) -> Path:
        """The node-local directory's path: on each host a directory only that host sees."""
        return self.root / "local"

    @property
    def hosts_dir(self) -> Path:
        return self.root / "hosts"

    def local_dir_of(self, name: str) -> Path:
        """What host `name` sees at `local`, as this (the test's) process sees it."""
        return self.hosts_dir / name

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")


def _netns_pids(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _remove_netns(netns: str) -> None:
    for _ in range(50):
        pids = _netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    subprocess.run(["ip", "netns", "delete", netns], capture_output=True)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Remove the namespaces (and /etc/netns entries) of clusters whose process is gone; return their names."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    removed = []
    for name in sorted(names):
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            _remove_netns(name)
            removed.append(name)
    return removed


def check_available() -> None:
    """Raise HostsUnavailable naming what this machine lacks to build namespaced hosts."""
    if os.geteuid() != 0:
        raise HostsUnavailable(
            "namespaced test hosts need root (network namespaces, veth links, mounts); run the tests as root, "
            "as CI does"
        )
    missing = [tool for tool in ("ip", "unshare", "mount", "hostname") if shutil.which(tool) is None]
    if missing:
        raise HostsUnavailable(
            f"namespaced test hosts need {', '.join(missing)}: apt-get install iproute2 util-linux hostname"
        )


@contextlib.contextmanager
def cluster(root: Path, names: Sequence[str], *, subnet: int = 0) -> Iterator[Cluster]:
    """Hosts `names` (the first is conventionally the head), host i at 198.18.<subnet>.<i+1>, under `root`."""
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"host names must be distinct and at least one: {list(names)}")
    check_available()
    remove_leftovers()
    token = secrets.token_hex(3)
    hosts: dict[str, Host] = {}
    made: list[str] = []
    the_cluster = Cluster(Path(root).resolve(), hosts)
    try:
        for sub in (the_cluster.shared, the_cluster.local, the_cluster.hosts_dir):
            sub.mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(names):
            netns = f"{PREFIX}{os.getpid()}-{token}-{i}"
            _ip("netns", "add", netns)
            made.append(netns)
            _ip("-n", netns, "link", "set", "lo", "up")
            hosts[name] = Host(name, netns, f"198.18.{subnet}.{i + 1}", the_cluster)
            the_cluster.local_dir_of(name).mkdir(exist_ok=True)
        _link_full_mesh(list(hosts.values()))
        for host in hosts.values():
            etc = NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            others = "".join(f"{o.address}\t{o.name}\n" for o in hosts.values() if o is not host)
            (etc / "hosts").write_text(
                f"127.0.0.1\tlocalhost\n127.0.1.1\t{host.name}\n{others}"
                "::1\tlocalhost ip6-localhost ip6-loopback\n"
            )
            (etc / "hostname").write_text(host.name + "\n")
        yield the_cluster
    finally:
        for host in hosts.values():
            host.kill_all()
        for netns in made:
            _remove_netns(netns)


@contextlib.contextmanager
def cluster_for_test(root: Path, names: Sequence[str], **kwargs) -> Iterator[Cluster]:
    """`cluster`, for a test: a machine that cannot build hosts fails the test with the reason (never a skip:
    CI runs as root and must run these tests)."""
    import pytest

    try:
        check_available()
    except HostsUnavailable as reason:
        pytest.fail(f"cannot build the test's hosts: {reason}", pytrace=False)
    with cluster(root, names, **kwargs) as built:
        yield built


def _link_full_mesh(hosts: list[Host]) -> None:
    """A veth pair between every two hosts; each host's one address on each of its links, a /32 route to each
    peer through the link to it (nothing else is routed)."""
    for i, a in enumerate(hosts):
        for j in range(i + 1, len(hosts)):
            b = hosts[j]
            end_a, end_b = f"v{j}", f"v{i}"  # in a's namespace the link to host j, in b's the link to host i
            _ip(
                "link",
                "add",
                end_a,
                "netns",
                a.netns,
                "type",
                "veth",
                "peer",
                "name",
                end_b,
                "netns",
                b.netns,
            )
            for host, end, peer in ((a, end_a, b), (b, end_b, a)):
                _ip("-n", host.netns, "addr", "add", f"{host.address}/32", "dev", end)
                _ip("-n", host.netns, "link", "set", end, "up")
                _ip("-n", host.netns, "route", "add", f"{peer.address}/32", "dev", end, "src", host.address)
