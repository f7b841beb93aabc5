"""The batch script of a SLURM pretraining job, and the checks that run before it is printed or submitted."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from flows.pretrain_config import PretrainConfig

SCRIPT_FILE = "sbatch.sh"  # in the run directory, beside the checkpoints
# File systems that are node-local by nature: a checkpoint directory there is seen by one node only.
NODE_LOCAL_FS = {"tmpfs", "ramfs", "devtmpfs"}


class SlurmInputError(ValueError):
    """The job cannot run as asked; the message names the problem and the fix."""


@dataclass(frozen=True)
class SlurmJob:
    config_path: Path  # absolute
    config: PretrainConfig
    nodes: int
    gpus_per_node: int
    run_dir: Path  # absolute, on the shared file system
    sbatch_options: tuple[str, ...] = ()
    requeue: bool = True  # --requeue: a node failure or preemption requeues the job, which resumes
    requeue_before_limit: bool = True  # --signal=B:USR1@T: near the time limit the job requeues itself

    @property
    def signal_s(self) -> int:
        """How long before the time limit the job requeues itself: its stop checkpoint happens within KillWait
        after the requeue, and SLURM's timer may fire up to a minute late."""
        return self.config.stop_grace_s + 60

    @property
    def nproc_per_node(self) -> int:
        """One rank per GPU; on CPU nodes (`--gpus-per-node 0`) the configuration's nproc_per_node."""
        return self.gpus_per_node or self.config.nproc_per_node


def check_job(config: PretrainConfig, nodes: int, gpus_per_node: int, run_dir: str | None) -> Path:
    """Raise SlurmInputError for what would fail on the cluster; return the absolute run directory."""
    if nodes < 1:
        raise SlurmInputError(f"--nodes {nodes}: a job needs at least one node (--nodes 1 or more)")
    if gpus_per_node < 0:
        raise SlurmInputError(f"--gpus-per-node {gpus_per_node}: give 0 (CPU nodes) or more")
    if config.placement != "local":
        raise SlurmInputError(
            f"placement={config.placement!r}: under SLURM the job's own nodes train; set placement: local "
            "(the pool's placement='deployment' starts node runs through Prefect instead)"
        )
    if not run_dir:
        raise SlurmInputError(
            "a SLURM job needs checkpoint_dir (in the config, or --checkpoint-dir): a directory on the file "
            "system every node mounts at the same path, the same for every submission (a resubmission resumes there)"
        )
    path = Path(run_dir)
    if not path.is_absolute():
        raise SlurmInputError(
            f"checkpoint_dir {run_dir!r} is relative: give an absolute path on the shared file system (the "
            "nodes' working directories may differ)"
        )
    fs = _fs_type(path)
    if fs in NODE_LOCAL_FS:
        raise SlurmInputError(
            f"checkpoint_dir {run_dir} is on a {fs} file system, which only this machine sees: the other nodes "
            "and a resubmission on other nodes could not read the checkpoints; put it on the shared file system "
            "(NFS, Lustre, ...)"
        )
    return path


def check_sbatch() -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SlurmInputError(
            "--submit needs SLURM's sbatch, which is not on PATH: run this on a SLURM login node (Debian/Ubuntu: "
            "apt-get install slurm-client), or leave out --submit and submit the printed script yourself"
        )
    return sbatch


def kill_wait_s() -> int | None:
    """The cluster's KillWait (`scontrol show config`): seconds from a stop's SIGTERM to its SIGKILL; None
    where scontrol is missing or does not say."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    done = subprocess.run([scontrol, "show", "config"], capture_output=True, text=True)
    match = re.search(r"^KillWait\s*=\s*(\d+)", done.stdout, re.M)
    return int(match.group(1)) if match else None


def check_kill_wait(config: PretrainConfig, kill_wait: int | None) -> str | None:
    """Why the stop checkpoint would not fit in KillWait, with the fix; None where it fits or is unknown."""
    if kill_wait is None or config.stop_grace_s < kill_wait:
        return None
    return (
        f"stop_grace_s={config.stop_grace_s} does not fit in this cluster's KillWait={kill_wait} s (scontrol show "
        "config): on scancel, a requeue or the time limit SLURM kills every process KillWait seconds after its "
        "SIGTERM, before the stop checkpoint is written, and the job resumes from the last periodic one. Set "
        f"stop_grace_s below {kill_wait} in the config (time for a step and a checkpoint write), or ask the "
        "administrators for a longer KillWait"
    )


def _fs_type(path: Path) -> str | None:
    """The file system type of the mount holding `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    path = path.resolve()
    best, kind = "", None
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def render(job: SlurmJob) -> str:
    """The batch script: one task per node, each running `python -m flows.slurm.node`."""
    directives = [
        f"--job-name={job.config.model_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        # Whole nodes: otherwise the one task per node is allocated one CPU, and under task/cgroup its
        # torchrun, ranks and data loading would all be confined to it.
        "--exclusive",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        f"--output={job.run_dir}/slurm-%j.out",
        "--open-mode=append",
        *(["--requeue"] if job.requeue else []),
        *([f"--signal=B:USR1@{job.signal_s}"] if job.requeue_before_limit else []),
        *job.sbatch_options,
    ]
    node = [
        sys.executable, "-m", "flows.node", str(job.config_path),
        "--nproc-per-node", str(job.nproc_per_node), "--checkpoint-dir", str(job.run_dir),
    ]  # fmt: skip
    step = f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {shlex.join(node)}"
    lines = [
        "#!/bin/bash",
        f"# llamaflow: {job.config_path} on {job.nodes} node(s); resubmit to resume from the newest checkpoint",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        "# Every node runs its part: node 0 the pretrain flow (it hosts the rendezvous), the others wait for it.",
        "# One node failing ends them all. The environment is the submitter's (sbatch's default).",
        *(_requeue_step(step) if job.requeue_before_limit else [step]),
        "",
    ]
    return "\n".join(lines)


def _requeue_step(step: str) -> list[str]:
    """The step in the background, so that the USR1 of `--signal` runs the trap at once (bash runs a trap
    only after the foreground command ends)."""
    return [
        "# Near the time limit SLURM sends USR1 here: the job requeues itself. Every node then gets SIGTERM and",
        "# stops at a checkpoint (within KillWait); the next incarnation resumes from it.",
        'trap \'echo "llamaflow: the time limit is near: requeueing job $SLURM_JOB_ID"; '
        'scontrol requeue "$SLURM_JOB_ID"\' USR1',
        f"{step} &",
        "step=$!",
        "# wait returns when a trapped signal arrives: wait again until the step itself has ended",
        'until wait "$step"; do status=$?; kill -0 "$step" 2>/dev/null || exit "$status"; done',
    ]


def submit(job: SlurmJob, script: str) -> str:
    """Write the script into the run directory and sbatch it; return the job id."""
    sbatch = check_sbatch()
    job.run_dir.mkdir(parents=True, exist_ok=True)
    path = job.run_dir / SCRIPT_FILE
    path.write_text(script)
    done = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SlurmInputError(f"sbatch refused the job ({path}): {(done.stderr or done.stdout).strip()}")
    return done.stdout.strip().split(";")[0]
