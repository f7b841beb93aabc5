"""`python -m flows.k8s CONFIG.yaml --nodes N --gpus-per-node G [--trainjob]`: the Kubernetes manifest of a
multi-node pretraining job, printed for `kubectl apply -f -`: a JobSet (one Indexed Job of N pods, scheduled
and restarted as one group), or with --trainjob a Kubeflow Trainer TrainJob on its `torch-distributed`
runtime. Every pod runs `python -m flows.node` (flows/node.py): its node rank comes from the launcher
(JOB_COMPLETION_INDEX, or torchrun's PET_* variables that Trainer sets), node 0 is pod 0, reached by its
stable name through the job's headless service, and serves the rendezvous store on a fixed port.

Each pod mounts the ReadWriteMany claim `--claim` at `--mount`: the configuration, `checkpoint_dir` and
`LLAMAFLOW_HOME` (the packed dataset) live there. The pods' other environment (MLFLOW_TRACKING_URI, its
credentials, PREFECT_API_URL) comes from the Secret `--env-secret`, never from the manifest.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import PurePosixPath
from typing import Any

import yaml
from pydantic import ValidationError

from flows import cli
from flows.node import DEFAULT_PORT
from flows.pretrain_config import ConfigNote, PretrainConfig

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
REPLICATED_JOB = "node"  # Trainer's torch runtime names its trainer job `node` too


class K8sInputError(ValueError):
    """The manifest cannot work as asked; the message names the problem and the fix."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.k8s", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the YAML configuration, as its path inside the pods (on the claim)")
    parser.add_argument("--nodes", type=int, required=True, help="pods of the job, one per machine")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per pod, one rank each")
    parser.add_argument("--name", help="the job's name (default: the config's model_name)")
    parser.add_argument(
        "--image", default="registry.example.com/llamaflow-gpu:latest", help="the pods' image"
    )
    parser.add_argument("--claim", default="llamaflow-shared", help="a ReadWriteMany PersistentVolumeClaim")
    parser.add_argument("--mount", default="/shared", help="where every pod mounts the claim")
    parser.add_argument("--env-secret", default="llamaflow-env", help="Secret of the pods' environment")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the rendezvous port on pod 0")
    parser.add_argument("--max-restarts", type=int, default=3, help="JobSet: group restarts after a failure")
    parser.add_argument("--trainjob", action="store_true", help="a Kubeflow Trainer TrainJob instead")
    parser.add_argument("--runtime", default="torch-distributed", help="TrainJob: the ClusterTrainingRuntime")
    return parser


def check(args: argparse.Namespace, config: PretrainConfig, name: str) -> None:
    if args.nodes < 1 or args.gpus_per_node < 0:
        raise K8sInputError("--nodes must be 1 or more and --gpus-per-node 0 or more")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", name):
        raise K8sInputError(
            f"the job's name {name!r} is not a DNS label of at most 40 characters (lowercase letters, digits and "
            "'-'; the pods' names grow from it): give --name"
        )
    mount = PurePosixPath(args.mount)
    for what, path in (("the config", args.config), ("checkpoint_dir", config.checkpoint_dir)):
        if path is None or mount not in PurePosixPath(path).parents:
            raise K8sInputError(
                f"{what} is {path!r}, not under the shared claim's mount {args.mount}: every pod must read it at "
                f"the same path (set checkpoint_dir to a path under {args.mount}, and give the config's path "
                "there)"
            )


def _identity_env() -> list[dict[str, Any]]:
    """This start's rendezvous id: the JobSet's uid and its restart attempt (a group restart is a new
    incarnation: the nodes never take the last one's worker spec)."""

    def label(key: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": f"metadata.labels['jobset.sigs.k8s.io/{key}']"}}

    return [
        {"name": "LLAMAFLOW_JOBSET_UID", "valueFrom": label("jobset-uid")},
        {"name": "LLAMAFLOW_RESTART_ATTEMPT", "valueFrom": label("restart-attempt")},
        {"name": "LLAMAFLOW_JOB_ID", "value": "$(LLAMAFLOW_JOBSET_UID)-$(LLAMAFLOW_RESTART_ATTEMPT)"},
    ]


def _pod(args: argparse.Namespace, config: PretrainConfig, command: list[str]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": REPLICATED_JOB,
        "image": args.image,
        "command": command,
        "env": [{"name": "LLAMAFLOW_HOME", "value": f"{args.mount}/home"}, *_identity_env()],
        "envFrom": [{"secretRef": {"name": args.env_secret}}],
        "ports": [{"name": "rendezvous", "containerPort": args.port}],
        "volumeMounts": [
            {"name": "shared", "mountPath": args.mount},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if args.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": args.gpus_per_node}}
    return {
        "restartPolicy": "Never",
        # SIGTERM to the node's process, which forwards it to torchrun and waits for the stop checkpoint.
        "terminationGracePeriodSeconds": config.stop_grace_s + 30,
        "containers": [container],
        "volumes": [
            {"name": "shared", "persistentVolumeClaim": {"claimName": args.claim}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # the data loaders' shared memory
        ],
    }


def jobset(args: argparse.Namespace, config: PretrainConfig, name: str) -> dict[str, Any]:
    head = f"{name}-{REPLICATED_JOB}-0-0.{name}"  # pod 0 of job 0, through the JobSet's headless service
    command = ["python", "-m", "flows.node", args.config, "--nproc-per-node", str(args.gpus_per_node or 1),
               "--nnodes", str(args.nodes), "--head-addr", head, "--port", str(args.port)]  # fmt: skip
    job = {
        "parallelism": args.nodes,
        "completions": args.nodes,
        "completionMode": "Indexed",  # JOB_COMPLETION_INDEX is the node rank
        "backoffLimit": 0,  # a failed pod fails the group, which the JobSet restarts (resuming)
        "template": {"spec": _pod(args, config, command)},
    }
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "network": {"enableDNSHostnames": True},
            "failurePolicy": {"maxRestarts": args.max_restarts},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


def trainjob(args: argparse.Namespace, config: PretrainConfig, name: str) -> dict[str, Any]:
    """The runtime sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT in every pod; the
    claim, the grace and the pods' environment go in through a runtime patch of its `node` job."""
    pod = _pod(args, config, [])
    patch = {"name": REPLICATED_JOB, "template": {"spec": {"template": {"spec": {
        "terminationGracePeriodSeconds": pod["terminationGracePeriodSeconds"],
        "volumes": pod["volumes"],
        "containers": [{"name": REPLICATED_JOB, "volumeMounts": pod["containers"][0]["volumeMounts"]}],
    }}}}}  # fmt: skip
    container = pod["containers"][0]
    return {
        "apiVersion": TRAINJOB_API,
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": args.runtime},
            "trainer": {
                "image": args.image,
                "command": ["python", "-m", "flows.node", args.config],
                "args": ["--nproc-per-node", str(args.gpus_per_node or 1)],
                "env": container["env"],
                "numNodes": args.nodes,
                **({"resourcesPerNode": container["resources"]} if args.gpus_per_node else {}),
            },
            "runtimePatches": [
                {
                    "manager": "llamaflow",
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [patch]}}},
                }
            ],
        },
    }


def manifest(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigNote)
        config = cli.config_from_args(["--config", args.config])
    name = args.name or config.model_name
    check(args, config, name)
    return trainjob(args, config, name) if args.trainjob else jobset(args, config, name)


def main(argv: list[str] | None = None) -> int:
    try:
        document = manifest(argv)
    except ValidationError as err:
        print(f"invalid configuration:\n{cli.describe_validation_error(err)}", file=sys.stderr)
        return 2
    except K8sInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(document, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
