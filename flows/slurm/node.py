"""What each node of a SLURM pretraining job runs (`srun` starts it once per node; see flows/slurm/script.py):

    python -m flows.slurm.node CONFIG.yaml --nnodes N --nproc-per-node P --checkpoint-dir RUN

Node 0 (`SLURM_NODEID` 0) announces itself in the run directory, takes its own address on the nodes'
network (the route toward another node of the job, or `LLAMAFLOW_NODE_ADDR`; never a loopback address) and a
free port as the rendezvous endpoint, and runs the pretrain flow as node 0 (it hosts the store). The other
nodes join it (`tasks.training.join`): they wait for its announcement, then for its worker spec, and train
their part with its endpoint. The rendezvous id is the SLURM job's, so nodes of an earlier job never mix in.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from flows import cli
from flows.pretrain import main as pretrain_main
from tasks.network import is_loopback
from tasks.training import TrainingError, TrainingInterrupted
from tasks.training.errors import TrainingInputError
from tasks.training.join import announce_head, join
from tasks.training.rendezvous import NODE_ADDR_ENV, free_port_on, node_address


def _slurm(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise TrainingInputError(
            f"{name} is not set: python -m flows.slurm.node runs inside a SLURM job (srun)"
        )
    return value


def job_hosts() -> list[str]:
    done = subprocess.run(
        ["scontrol", "show", "hostnames", _slurm("SLURM_JOB_NODELIST")], capture_output=True, text=True
    )
    return done.stdout.split()


def head_address(others: list[str]) -> str:
    """Node 0's address as the other nodes reach it: `LLAMAFLOW_NODE_ADDR`, else its source address on the
    route to another node of the job."""
    address = node_address(others[0]) if others else os.environ.get(NODE_ADDR_ENV)
    if address is None or is_loopback(address):
        raise TrainingInputError(
            f"node 0 found no address of its own on the nodes' network (got {address}, toward {others}): set "
            f"{NODE_ADDR_ENV} to this machine's address that the other nodes reach (e.g. export "
            f"{NODE_ADDR_ENV}=$(hostname -I | cut -d' ' -f1) in the batch script)"
        )
    return address


def run_head(argv: list[str], nnodes: int, job: str, run_dir: str) -> int:
    announce_head(run_dir, job)
    extra = ["--rdzv-id", job, "--node-rank", "0"]
    if nnodes > 1:
        me = os.environ.get("SLURMD_NODENAME")
        address = head_address([h for h in job_hosts() if h != me])
        os.environ[NODE_ADDR_ENV] = address
        host = f"[{address}]" if ":" in address else address
        extra += ["--rdzv-endpoint", f"{host}:{free_port_on(address)}"]
    return pretrain_main([*argv, *extra])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.slurm.node")
    parser.add_argument("config")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    args = parser.parse_args(argv)
    pretrain_argv = [
        "--config", args.config, "--placement", "local", "--nnodes", str(args.nnodes),
        "--nproc-per-node", str(args.nproc_per_node), "--checkpoint-dir", args.checkpoint_dir,
    ]  # fmt: skip
    try:
        job = f"slurm-{_slurm('SLURM_JOB_ID')}"
        node = int(_slurm("SLURM_NODEID"))
        if node == 0:
            return run_head(pretrain_argv, args.nnodes, job, args.checkpoint_dir)
        wait_s = cli.config_from_args(pretrain_argv).rdzv_timeout_s
        ref = join(args.checkpoint_dir, job, node_rank=node, announce_wait_s=wait_s)
    except TrainingInputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except TrainingInterrupted as err:
        print(f"stopped: {err}", file=sys.stderr, flush=True)
        return 130
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    print(f"node {node}: trained to step {ref.step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
