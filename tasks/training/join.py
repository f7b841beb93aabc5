"""The other nodes of a job whose node 0 is started by hand or by a batch system (SLURM): node 0 announces
itself in the shared run directory at its start and, once its data stages are done, its launcher writes the
worker spec (`torchrun_spec.json`) there; node k waits for both, then runs `fit` for its node with node 0's
inputs and endpoint, as node 0 runs it for its own.

    announce_head(run_dir, job)                        # node 0, before its data stages
    join(run_dir, job, node_rank=k, announce_wait_s=300)   # node k

The announcement tells a node quickly whether it shares node 0's storage: a run directory it never sees the
announcement in is not on a shared file system, and the node stops with that reason instead of waiting for a
spec that cannot arrive. The spec is waited for as long as node 0 prepares its data (its failure ends the
job: under SLURM, `srun --kill-on-bad-exit`). A spec left by an earlier job in the same run directory (a
resubmission resumes there) is not this job's: only a spec with this job's `rdzv_id` is taken.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from model.atomic import write_text_atomic
from tasks.refs import CheckpointRef
from tasks.training.errors import TrainingInputError
from tasks.training.launch import SPEC_FILE, WorkerSpec, fit
from tasks.training.rendezvous import ARRIVALS_DIR

POLL_S = 0.5


def _announcement(run_dir: Path, job: str) -> Path:
    return run_dir / ARRIVALS_DIR / f"head-{job}.json"


def announce_head(run_dir: str | Path, job: str) -> None:
    """Node 0: mark the shared run directory as this job's (before the data stages, which may take long). The
    worker spec a former start left is removed first: only this start's node 0 writes the next one."""
    (Path(run_dir) / SPEC_FILE).unlink(missing_ok=True)
    path = _announcement(Path(run_dir), job)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}))


def _listed(path: Path) -> bool:
    """Whether `path` exists, listing its directory first: an NFS client caches a negative lookup (~60 s)."""
    try:
        os.listdir(path.parent)
    except OSError:
        return False
    return path.exists()


def wait_for_head(run_dir: Path, job: str, wait_s: float) -> None:
    """Raise TrainingInputError when node 0's announcement does not show within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while not _listed(_announcement(run_dir, job)):
        if time.monotonic() > deadline:
            raise TrainingInputError(
                f"node 0 of job {job} did not announce itself in the run directory {run_dir} within {wait_s:.0f} s, "
                f"as this host ({socket.gethostname()}) sees it: put checkpoint_dir on the file system every node "
                "mounts at the same path (NFS, Lustre; not /tmp or a node-local disk), and check that node 0 started"
            )
        time.sleep(POLL_S)


def wait_for_spec(run_dir: Path, job: str) -> WorkerSpec:
    """Node 0's worker spec for job `job` (written once its data stages are done); waits while it is not there."""
    path = run_dir / SPEC_FILE
    while True:
        if _listed(path):
            try:
                spec = WorkerSpec.model_validate_json(path.read_text())
            except (OSError, ValueError):
                spec = None  # replaced while read: read again
            if spec is not None and spec.settings.rdzv_id == job:
                return spec
        time.sleep(POLL_S)


def join(run_dir: str | Path, job: str, *, node_rank: int, announce_wait_s: float) -> CheckpointRef:
    """Node `node_rank` (> 0) of job `job`: wait for node 0, then train this node's part of the job."""
    run_dir = Path(run_dir).resolve()
    if node_rank < 1:
        raise TrainingInputError(f"join is for the other nodes (node_rank >= 1), not node_rank={node_rank}")
    wait_for_head(run_dir, job, announce_wait_s)
    spec = wait_for_spec(run_dir, job)
    if node_rank >= spec.settings.nnodes:
        raise TrainingInputError(
            f"node {node_rank} has no part in job {job}: node 0 trains with nnodes={spec.settings.nnodes}"
        )
    settings = spec.settings.model_copy(update={"node_rank": node_rank})
    return fit(spec.model_ref, spec.dataset_ref, settings, run_dir, None, progress=spec.progress)
