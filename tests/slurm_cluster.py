"""A SLURM cluster on the namespaced hosts of tests/hosts.py, built by the test itself: one munge key, a
munged per host, slurmctld on the first (head) host, a slurmd on every host, and a slurm.conf generated
into the shared directory.

    with cluster_for_test(tmp_path, ["head", "node1"]) as hosts, slurm_cluster(hosts) as slurm:
        job = slurm.submit(script_path)
        slurm.wait(job, "COMPLETED")

Debian's packages (`slurm-wlm`, `munge`; .ci/run installs them where missing). No cgroups: processes are
tracked by parentage (proctrack/linuxproc), tasks are not bound (task/none). Each host's daemons keep their
sockets, state and logs in the host's node-local directory (`Cluster.local`, a different directory on each
host at the same path), so the munged of one host never answers for another. Everything is stopped on exit,
after a failure too: every job cancelled, then the daemons (the hosts' teardown kills whatever is left).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hosts import Cluster, HostsUnavailable

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
CTLD_PORT, SLURMD_PORT = 6817, 6818
# scancel's SIGKILL this long after its SIGTERM (Slurm's default: 30 s); a test job's stop_grace_s stays below.
KILL_WAIT_S = 10
PARTITION = "main"


@dataclass
class Slurm:
    hosts: Cluster
    conf: Path
    head: str

    @property
    def env(self) -> dict[str, str]:
        """What a SLURM client (sbatch, srun, scontrol) needs in its environment to find this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def client(self, argv: list[str], *, host: str | None = None, timeout: float = 60):
        return self.hosts[host or self.head].run(argv, env=self.env, timeout=timeout)

    def job_state(self, job: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, ...), '' once slurmctld forgot it."""
        done = self.client(["scontrol", "-o", "show", "job", job])
        for field_ in done.stdout.split():
            if field_.startswith("JobState="):
                return field_.split("=", 1)[1]
        return ""

    def wait(self, job: str, until: set[str], timeout: float) -> str:
        """Wait for the job to reach one of the states `until`; return it (TimeoutError with the last state)."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in until:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job} still {state or 'unknown'} after {timeout:.0f} s (waited for {until})")

    def open_partition(self) -> None:
        done = self.client(["scontrol", "update", f"PartitionName={PARTITION}", "State=UP"])
        assert done.returncode == 0, done.stdout + done.stderr

    def log(self, host: str, daemon: str) -> str:
        path = self.hosts.local_dir_of(host) / "slurm" / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def check_available() -> None:
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        raise HostsUnavailable(
            f"the SLURM test cluster needs {', '.join(missing)}: apt-get install slurm-wlm munge (.ci/run does)"
        )


def _conf(hosts: Cluster, cpus: int, partition: str) -> str:
    local = hosts.local
    names = list(hosts.hosts)
    head = hosts[names[0]]
    nodes = "".join(
        f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} CPUs={cpus} State=UNKNOWN\n"
        for h in hosts.hosts.values()
    )
    return f"""\
ClusterName=llamaflowtest
SlurmctldHost={head.name}({head.address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={local}/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
# The main scheduling loop every 2 s (default 60 s): a job waiting for an opened partition starts at once.
SchedulerParameters=sched_interval=2
KillWait={KILL_WAIT_S}
StateSaveLocation={local}/slurm/ctld
SlurmdSpoolDir={local}/slurm/spool
SlurmctldPidFile={local}/slurm/slurmctld.pid
SlurmdPidFile={local}/slurm/slurmd.pid
SlurmctldLogFile={local}/slurm/slurmctld.log
SlurmdLogFile={local}/slurm/slurmd.log
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
{nodes}PartitionName={PARTITION} Nodes={",".join(names)} Default=YES MaxTime=INFINITE State={partition}
"""


@contextlib.contextmanager
def slurm_cluster(
    hosts: Cluster, *, cpus: int = 2, ready_s: float = 60, partition_up: bool = True
) -> Iterator[Slurm]:
    """A SLURM cluster on `hosts` (the first host runs slurmctld), every node idle before it is yielded.
    `partition_up=False`: jobs are queued but none starts before `Slurm.open_partition()` (a test can submit
    while a server its jobs need is still starting)."""
    check_available()
    # slurmd's step sockets (SPOOL/HOST_JOB.4294967291) are Unix sockets, whose paths hold at most 108 bytes.
    longest = len(f"{hosts.local}/slurm/spool/{max(hosts.hosts, key=len)}_999999.4294967291")
    if longest > 107:
        raise ValueError(
            f"the hosts' root {hosts.root} is too long for SLURM's step sockets ({longest} > 107 bytes): "
            "build the cluster under a short directory (e.g. tempfile.mkdtemp(prefix='llf-'))"
        )
    root = hosts.shared / "slurm"
    root.mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(_conf(hosts, cpus, "UP" if partition_up else "DOWN"))
    # slurmd initialises a cgroup plugin even when no plugin uses it; its autodetection fails inside a
    # host (`ip netns exec` mounts a fresh /sys, without /sys/fs/cgroup), so name the version outright.
    (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    names = list(hosts.hosts)
    slurm = Slurm(hosts, conf, names[0])
    daemons: list[subprocess.Popen] = []
    try:
        for name in names:
            local = hosts.local_dir_of(name)
            for sub in ("munge", "slurm/ctld", "slurm/spool"):
                (local / sub).mkdir(parents=True, exist_ok=True)
            (local / "munge").chmod(0o700)
            m = f"{hosts.local}/munge"
            daemons.append(
                hosts[name].popen(
                    ["munged", "-F", "--force", f"--key-file={key}", f"--socket={m}/munge.socket",
                     f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
        for name in names:
            _wait_for(
                lambda n=name: (hosts.local_dir_of(n) / "munge" / "munge.socket").exists(), 20, "munged"
            )
        quiet = {
            "env": slurm.env,
            "stdout": subprocess.DEVNULL,
            "stderr": subprocess.DEVNULL,
        }  # logs: Slurm.log
        daemons.append(hosts[names[0]].popen(["slurmctld", "-D", "-i"], **quiet))
        for name in names:
            daemons.append(hosts[name].popen(["slurmd", "-D", "-N", name], **quiet))
        _wait_for(lambda: _all_idle(slurm, names), ready_s, "every slurmd registered and idle")
        yield slurm
    finally:
        with contextlib.suppress(Exception):
            slurm.client(["scancel", "--full", "--user=root"], timeout=20)
        for process in reversed(daemons):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)


def _all_idle(slurm: Slurm, names: list[str]) -> bool:
    done = slurm.client(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20)
    states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    return all(states.get(name) == "idle" for name in names)


def _wait_for(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the SLURM test cluster: {what} not ready within {timeout:.0f} s")
        time.sleep(0.3)
