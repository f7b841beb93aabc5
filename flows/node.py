"""The per-node command of a multi-node job, for every launcher: each machine runs it once.

    python -m flows.node CONFIG.yaml --nproc-per-node P [--checkpoint-dir RUN]
        [--nnodes N --node-rank K --head-addr HOST --port 29500 --job-id ID]

This node's rank, the node count, node 0's address and the job's identity come from the launcher's
environment (`place_of`), the first of:
- explicit flags (`--node-rank`, `--nnodes`, `--head-addr`): a user with ssh and a few machines;
- SLURM (srun): `SLURM_NODEID`, `SLURM_NNODES`, `SLURM_JOB_ID` and `SLURM_RESTART_COUNT` (a requeued job
  keeps its id: each incarnation is a new rendezvous, so nothing of the last one is taken);
- torchrun's variables as Kubeflow Trainer (TrainJob) and PyTorchJob set them: `PET_NODE_RANK`,
  `PET_NNODES`, `PET_MASTER_ADDR`, `PET_MASTER_PORT`;
- a JobSet or an Indexed Job: `JOB_COMPLETION_INDEX`, with `--head-addr` (pod 0's name through the headless
  service) and `--nnodes`.

Where the head's address is known up front the endpoint is HEAD:PORT, and node 0 serves the rendezvous store
on that port from its start. Under SLURM node 0 takes its own address on the nodes' network and serves the
store on a port it binds at once; the other nodes find the endpoint in node 0's worker spec. Node 0 runs the
pretrain flow (data stages, its torchrun, evaluation, registration); node k waits for node 0's spec in the
shared run directory and trains its part (`tasks.training.join`).

On SIGTERM (scancel, a time limit, a pod deleted) this process forwards the stop to its torchrun and waits
for it (up to `stop_grace_s`), so the stop checkpoint is written before a batch system kills what is left.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from flows import cli
from flows.pretrain import main as pretrain_main
from tasks.network import is_loopback
from tasks.training import TrainingError, TrainingInterrupted
from tasks.training.errors import TrainingInputError
from tasks.training.join import announce_head, join
from tasks.training.rendezvous import NODE_ADDR_ENV, NODE_IFACE_ENV, job_id, node_address, serve_store

DEFAULT_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class NodePlace:
    """Where this node stands in its job, as its launcher says."""

    launcher: str
    node_rank: int
    nnodes: int
    job: str | None  # the rendezvous id of this incarnation; None: derived from the run directory
    head: str | None  # node 0's address, known up front; None: node 0 takes its own (SLURM)
    port: int  # the rendezvous port; 0: node 0 binds one when it starts


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise TrainingInputError(
            f"{name}={env.get(name)!r}: the launcher should set it to a number"
        ) from None


def place_of(args: argparse.Namespace, env: Mapping[str, str]) -> NodePlace:
    """This node's place, from the flags, else from the launcher's environment; TrainingInputError naming
    what is missing when neither says."""
    job = args.job_id or env.get("LLAMAFLOW_JOB_ID") or None
    if args.node_rank is not None:
        if args.nnodes is None or not args.head_addr:
            raise TrainingInputError(
                "--node-rank needs --nnodes and --head-addr (node 0's address as every node reaches it), the "
                "same on every node"
            )
        return NodePlace("flags", args.node_rank, args.nnodes, job, args.head_addr, args.port or DEFAULT_PORT)
    if env.get("SLURM_JOB_ID") and env.get("SLURM_NODEID"):
        restart = int(env.get("SLURM_RESTART_COUNT") or 0)
        slurm_job = f"slurm-{env['SLURM_JOB_ID']}" + (f"-r{restart}" if restart else "")
        nnodes = _int(env, "SLURM_NNODES") if env.get("SLURM_NNODES") else args.nnodes
        return NodePlace(
            "slurm", _int(env, "SLURM_NODEID"), nnodes or 1, job or slurm_job, None, args.port or 0
        )
    if env.get("PET_NODE_RANK") is not None and env.get("PET_MASTER_ADDR"):
        port = _int(env, "PET_MASTER_PORT") if env.get("PET_MASTER_PORT") else DEFAULT_PORT
        return NodePlace(
            "torchrun (PET_*)",
            _int(env, "PET_NODE_RANK"),
            _int(env, "PET_NNODES"),
            job,
            env["PET_MASTER_ADDR"],
            port,
        )
    if env.get("JOB_COMPLETION_INDEX") is not None:
        if not args.head_addr or args.nnodes is None:
            raise TrainingInputError(
                "JOB_COMPLETION_INDEX is set (a JobSet or an Indexed Job) but node 0's address is not: give "
                "--head-addr (pod 0's name through the headless service, e.g. JOBSET-node-0-0.JOBSET) and --nnodes"
            )
        index = _int(env, "JOB_COMPLETION_INDEX")
        return NodePlace("indexed job", index, args.nnodes, job, args.head_addr, args.port or DEFAULT_PORT)
    raise TrainingInputError(
        "no launcher says where this node stands: run it under srun (SLURM), in a TrainJob or PyTorchJob "
        "(PET_NODE_RANK, PET_NNODES, PET_MASTER_ADDR), in a JobSet or Indexed Job (JOB_COMPLETION_INDEX with "
        "--head-addr and --nnodes), or give --node-rank, --nnodes and --head-addr"
    )


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises TrainingInterrupted once, in the main thread: the launcher (`fit`) then forwards the stop
    to its torchrun and waits for its checkpoint. Later copies (SLURM signals every process of the step, a
    requeue signals again) are ignored: a second exception would cut that wait short."""

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise TrainingInterrupted("stopped by SIGTERM (the launcher's stop): training stops at a checkpoint")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def slurm_hosts(env: Mapping[str, str]) -> list[str]:
    done = subprocess.run(
        ["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")], capture_output=True, text=True
    )
    return done.stdout.split()


def head_address(others: list[str]) -> str:
    """Node 0's address as the other nodes reach it: `LLAMAFLOW_NODE_ADDR` (or the address of interface
    `LLAMAFLOW_NODE_IFACE`), else its source address on the route to another node of the job."""
    address = node_address(others[0]) if others else node_address("")
    if address is None or is_loopback(address):
        raise TrainingInputError(
            f"node 0 found no address of its own on the nodes' network (got {address}, toward {others}): set "
            f"{NODE_IFACE_ENV} to the interface of that network (e.g. export {NODE_IFACE_ENV}=eth0 in the batch "
            f"script: the same name on every node), or {NODE_ADDR_ENV} to this machine's address, set on this "
            f"machine only (a batch script's export is copied to every node by srun, and every node would claim it)"
        )
    return address


def run_head(pretrain_argv: list[str], place: NodePlace, job: str, run_dir: str, timeout_s: int) -> int:
    announce_head(run_dir, job)
    extra = ["--rdzv-id", job, "--node-rank", "0"]
    if place.nnodes > 1:
        if place.head is None:  # SLURM: this node's own address, toward another node of the job
            me = os.environ.get("SLURMD_NODENAME")
            address = head_address([h for h in slurm_hosts(os.environ) if h != me])
            os.environ[NODE_ADDR_ENV] = address
        else:
            address = place.head
        # Bound now, served by this process for the job's life: the other nodes connect while the data stages run.
        extra += ["--rdzv-endpoint", serve_store(address, place.port, timeout_s)]
    return pretrain_main([*pretrain_argv, *extra])


def build_parser(prog: str = "python -m flows.node") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML file of PretrainConfig fields, on every node")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks on this node (one per GPU)")
    parser.add_argument("--checkpoint-dir", help="the run directory every node shares (else the config's)")
    parser.add_argument("--nnodes", type=int, help="machines of the job (where the launcher does not say)")
    parser.add_argument("--node-rank", type=int, help="this machine's index (explicit placement, e.g. ssh)")
    parser.add_argument("--head-addr", help="node 0's address or name, as every node reaches it")
    parser.add_argument("--port", type=int, help=f"the rendezvous port on node 0 (default {DEFAULT_PORT})")
    parser.add_argument(
        "--job-id", help="this start's rendezvous id, the same on every node (LLAMAFLOW_JOB_ID)"
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m flows.node") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        with stop_on_sigterm():
            return _run(args)
    except TrainingInputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except TrainingInterrupted as err:
        print(f"stopped: {err}", file=sys.stderr, flush=True)
        return 130
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace) -> int:
    place = place_of(args, os.environ)
    overrides = ["--checkpoint-dir", args.checkpoint_dir] if args.checkpoint_dir else []
    pretrain_argv = ["--config", args.config, "--placement", "local", "--nnodes", str(place.nnodes),
                     "--nproc-per-node", str(args.nproc_per_node), *overrides]  # fmt: skip
    config = cli.config_from_args(pretrain_argv)
    if not config.checkpoint_dir:
        raise TrainingInputError(
            "a multi-node job needs checkpoint_dir (in the config, or --checkpoint-dir): a directory every node "
            "mounts at the same path"
        )
    run_dir = str(config.checkpoint_dir)
    job = place.job or job_id(config, Path(run_dir).resolve())
    if place.node_rank == 0:
        return run_head(pretrain_argv, place, job, run_dir, config.rdzv_timeout_s)
    ref = join(run_dir, job, node_rank=place.node_rank, announce_wait_s=config.rdzv_timeout_s)
    print(f"node {place.node_rank}: trained to step {ref.step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
