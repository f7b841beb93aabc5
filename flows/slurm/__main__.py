"""`python -m flows.slurm CONFIG.yaml --nodes N --gpus-per-node G [--submit]`: the batch script of a SLURM
pretraining job, printed, or written into the run directory and submitted with sbatch. Rerunning the same
command with --submit resumes the run from its newest checkpoint."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from pydantic import ValidationError

from flows import cli
from flows.pretrain_config import ConfigNote
from flows.slurm.script import (
    SlurmInputError,
    SlurmJob,
    check_job,
    check_kill_wait,
    check_sbatch,
    kill_wait_s,
    render,
    submit,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.slurm", description=__doc__)
    parser.add_argument(
        "config", type=Path, help="YAML file of PretrainConfig fields (as --config of flows.pretrain)"
    )
    parser.add_argument("--nodes", type=int, required=True, help="machines of the job (nnodes)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        required=True,
        help="GPUs per node, one rank each; 0: CPU nodes (nproc_per_node)",
    )
    parser.add_argument(
        "--checkpoint-dir", help="the run directory on the shared file system (else the config's)"
    )
    parser.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="extra #SBATCH option, e.g. --sbatch=--time=24:00:00",
    )
    parser.add_argument(
        "--submit", action="store_true", help="submit with sbatch instead of printing the script"
    )
    parser.add_argument(
        "--no-requeue",
        action="store_true",
        help="leave out --requeue (a node failure or a preemption then ends the job instead of requeueing it)",
    )
    parser.add_argument(
        "--no-requeue-before-limit",
        action="store_true",
        help="leave out --signal=B:USR1@T and its trap (the job then ends at its time limit; resubmit to resume)",
    )
    return parser


def job_of(argv: list[str] | None = None) -> tuple[SlurmJob, bool]:
    args = build_parser().parse_args(argv)
    config_path = args.config.resolve()
    overrides = ["--checkpoint-dir", args.checkpoint_dir] if args.checkpoint_dir else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigNote)  # the flow prints them again, on node 0
        config = cli.config_from_args(["--config", str(config_path), *overrides])
    run_dir = check_job(config, args.nodes, args.gpus_per_node, config.checkpoint_dir)
    if args.submit:
        check_sbatch()
    too_long = check_kill_wait(config, kill_wait_s())
    if too_long and args.submit:
        raise SlurmInputError(too_long)
    if too_long:
        print(f"warning: {too_long}", file=sys.stderr)
    job = SlurmJob(
        config_path,
        config,
        args.nodes,
        args.gpus_per_node,
        run_dir,
        tuple(args.sbatch),
        requeue=not args.no_requeue,
        requeue_before_limit=not args.no_requeue_before_limit,
    )
    return job, args.submit


def main(argv: list[str] | None = None) -> int:
    try:
        job, wants_submit = job_of(argv)
    except ValidationError as err:
        print(f"invalid configuration:\n{cli.describe_validation_error(err)}", file=sys.stderr)
        return 2
    except SlurmInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    script = render(job)
    if not wants_submit:
        print(script, end="")
        return 0
    try:
        job_id = submit(job, script)
    except SlurmInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"submitted job {job_id}: {job.run_dir}/slurm-{job_id}.out; rerun this command to resume after it ends"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
