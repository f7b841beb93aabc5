"""The namespaced hosts of tests/hosts.py: what each host sees, what it cannot reach, and that nothing of them
outlives the test (failed, interrupted, or killed before it could clean up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hosts import NETNS_ETC, PREFIX, cluster_for_test

PY = sys.executable
# Run on a host: its name, what its name and the others' resolve to, and a TCP connection to `argv[1]`.
PROBE = """
import json, socket, sys
out = {"hostname": socket.gethostname(), "self": socket.gethostbyname(socket.gethostname())}
out["peers"] = {n: socket.gethostbyname(n) for n in sys.argv[2].split(",")}
host, port = sys.argv[1].rsplit(":", 1)
try:
    socket.create_connection((host, int(port)), timeout=2).close(); out["connect"] = "ok"
except OSError as e:
    out["connect"] = type(e).__name__ + ":" + str(e.errno)
try:
    socket.create_connection(("198.19.255.254", 9), timeout=2).close(); out["outside"] = "ok"
except OSError as e:
    out["outside"] = e.errno
print(json.dumps(out))
"""
LISTEN = "import socket,sys; s=socket.create_server((sys.argv[1], int(sys.argv[2]))); print('up', flush=True); s.accept()"


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    etc = {p.name for p in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set()
    return {n for n in names | etc if n.startswith(f"{PREFIX}{os.getpid()}-")}


def _listen(host, address: str, port: int) -> subprocess.Popen:
    server = host.popen([PY, "-c", LISTEN, address, str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "up"
    return server


def test_hosts_have_their_own_names_addresses_and_local_disks_and_reach_only_each_other(
    tmp_path: Path,
) -> None:
    with cluster_for_test(tmp_path, ["head", "node1"]) as hosts:
        head, node1 = hosts["head"], hosts["node1"]
        _listen(head, head.address, 7001)
        _listen(head, "127.0.0.1", 7002)  # head's loopback: not reachable from node1
        seen = json.loads(head.run([PY, "-c", PROBE, "127.0.0.1:7002", "node1"]).stdout)
        assert (
            seen
            == {
                "hostname": "head",
                "self": "127.0.1.1",  # a Debian host's /etc/hosts
                "peers": {"node1": "198.18.0.2"},
                "connect": "ok",
                "outside": 101,  # ENETUNREACH: no route leaves the namespace, not even to a 198.19 address off its links
            }
        )
        seen = json.loads(node1.run([PY, "-c", PROBE, "head:7001", "head"]).stdout)
        assert seen == {
            "hostname": "node1",
            "self": "127.0.1.1",
            "peers": {"head": "198.18.0.1"},
            "connect": "ok",
            "outside": 101,
        }
        refused = json.loads(node1.run([PY, "-c", PROBE, "127.0.0.1:7002", "head"]).stdout)["connect"]
        assert refused == "ConnectionRefusedError:111"

        write = "import pathlib,sys; pathlib.Path(sys.argv[1], sys.argv[2]).write_text(sys.argv[3])"
        for host in (head, node1):
            assert host.run([PY, "-c", write, str(hosts.local), "mine", host.name]).returncode == 0
            assert host.run([PY, "-c", write, str(hosts.shared), host.name, host.name]).returncode == 0
            listing = host.run(["ls", "-A", str(hosts.hosts_dir)]).stdout
            assert listing == "", f"{host.name} sees the other hosts' local directories: {listing}"
        assert (hosts.local_dir_of("head") / "mine").read_text() == "head"
        assert (hosts.local_dir_of("node1") / "mine").read_text() == "node1"
        assert not (hosts.local / "mine").exists()  # not on the test's own machine either
        assert sorted(p.name for p in hosts.shared.iterdir()) == ["head", "node1"]
        assert node1.run(["cat", str(hosts.shared / "head")]).stdout == "head"


@pytest.mark.parametrize("ending", [RuntimeError, KeyboardInterrupt])
def test_nothing_of_the_hosts_outlives_a_failed_or_interrupted_test(
    tmp_path: Path, ending: type[BaseException]
) -> None:
    with pytest.raises(ending), cluster_for_test(tmp_path, ["head", "node1"]) as hosts:
        assert len(_namespaces()) == 2
        # A process in a session of its own that ignores SIGTERM, and one started by it (not by the helper).
        sleeper = hosts["node1"].popen(["sh", "-c", "trap '' TERM; sleep 600 & wait"])
        raise ending("the test failed")
    assert sleeper.wait(timeout=10) != 0
    assert _namespaces() == set()
    orphans = subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True, text=True).stdout.split()
    mine = [p for p in orphans if Path(f"/proc/{p}/cmdline").read_bytes() == b"sleep\x00600\x00"]
    assert mine == [], "a host's process survived the test"


def test_namespaces_left_by_a_killed_test_process_are_removed_by_the_next_cluster(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"{PREFIX}{dead.pid}-abcdef-0"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    (NETNS_ETC / leftover).mkdir(parents=True, exist_ok=True)
    try:
        with cluster_for_test(tmp_path, ["head"]):
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert leftover not in listed and not (NETNS_ETC / leftover).exists()
    finally:
        subprocess.run(["ip", "netns", "delete", leftover], capture_output=True)


def test_a_test_that_cannot_build_hosts_fails_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "test_needs_hosts.py").write_text(
        textwrap.dedent(
            """
            from hosts import cluster_for_test

            def test_it(tmp_path):
                with cluster_for_test(tmp_path, ["head", "node1"]):
                    pass
            """
        )
    )
    bin_dir = tmp_path / "bin"  # a PATH without iproute2
    bin_dir.mkdir()
    done = subprocess.run(
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        env={**os.environ, "PATH": str(bin_dir), "PYTHONPATH": str(Path(__file__).parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout[-2000:]
    assert "1 failed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
    assert "cannot build the test's hosts: namespaced test hosts need ip" in done.stdout, done.stdout[-2000:]
