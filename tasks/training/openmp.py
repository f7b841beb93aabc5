"""OpenMP wait policy for training processes, chosen from the machine's load when a process starts.

torch's CPU kernels run on libgomp. Its default lets idle threads spin, which is fastest on a quiet machine,
but when another process holds a core, every parallel region's barrier waits for a descheduled thread and a
2-thread step gets 3-8x slower. `OMP_WAIT_POLICY=PASSIVE` makes idle threads sleep. Measured on 2 cores
(benchmarks/README.md, "Threads and OpenMP"): PASSIVE costs 7% on a quiet machine and is 1.7x faster next to
a busy neighbour; GOMP_SPINCOUNT=10000, the middle ground, costs as much when quiet and gains only 1.3x.
So no single setting is best in both: PASSIVE when the load average says another process is running.

libgomp reads the variable once, when torch is imported, so the policy applies to processes started after
it is chosen (the torchrun workers, or a shell: `eval "$(python -m tasks.training.openmp)"`).
"""

from __future__ import annotations

import os

# Load beyond this share of the cores, before our process starts, means someone else is computing.
BUSY_LOAD_PER_CORE = 0.5


def wait_policy(load_1min: float, cores: int) -> str | None:
    """ "PASSIVE" when another process is likely to hold a core, else None (libgomp's default)."""
    return "PASSIVE" if load_1min >= BUSY_LOAD_PER_CORE * cores else None


def openmp_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables to add to a new training process's environment; a policy the user set is kept."""
    environ = dict(os.environ) if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    policy = wait_policy(os.getloadavg()[0], os.cpu_count() or 1)
    return {} if policy is None else {"OMP_WAIT_POLICY": policy}


if __name__ == "__main__":
    for name, value in openmp_env().items():
        print(f"export {name}={value}")
