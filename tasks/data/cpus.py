"""How many CPUs this process may really use: the cores it is allowed to run on (`os.sched_getaffinity`:
taskset, Slurm's cpusets) and the CPU time its cgroup v2 grants (`/sys/fs/cgroup/cpu.max`: a container's
--cpus, a Kubernetes limit), not the machine's core count."""

from __future__ import annotations

import math
import os
from pathlib import Path

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cgroup_quota(path: Path = CPU_MAX) -> float | None:
    """CPUs' worth of time the cgroup grants ("QUOTA PERIOD" in microseconds; "max": no limit), or None."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def usable_cpus(cpu_max: Path = CPU_MAX) -> int:
    """min(cores in the affinity mask, the cgroup quota rounded up), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_quota(cpu_max)
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)
