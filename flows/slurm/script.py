"""The batch script of a SLURM pretraining job, and the checks that run before it is printed or submitted."""

from __future__ import annotations

import os
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
        *job.sbatch_options,
    ]
    node = [
        sys.executable, "-m", "flows.slurm.node", str(job.config_path),
        "--nnodes", str(job.nodes), "--nproc-per-node", str(job.nproc_per_node),
        "--checkpoint-dir", str(job.run_dir),
    ]  # fmt: skip
    lines = [
        "#!/bin/bash",
        f"# llamaflow: {job.config_path} on {job.nodes} node(s); resubmit to resume from the newest checkpoint",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        "# Every node runs its part: node 0 the pretrain flow (it hosts the rendezvous), the others wait for it.",
        "# One node failing ends them all. The environment is the submitter's (sbatch's default).",
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {shlex.join(node)}",
        "",
    ]
    return "\n".join(lines)


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
