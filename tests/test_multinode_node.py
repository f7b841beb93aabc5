"""`python -m flows.node`, the per-node command of every launcher: the place each launcher's environment
gives a node (SLURM, torchrun's PET_* of Kubeflow, a JobSet's JOB_COMPLETION_INDEX, flags), the rendezvous
store node 0 serves on a port it holds, and a stop: the node's process outlives its torchrun, so the stop
checkpoint is written before a batch system (SLURM's proctrack/cgroup, a pod's end) kills what is left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from flows.node import NodePlace, build_parser, place_of
from model import get_preset
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.training import TrainSettings
from tasks.training.checkpoint import load_trainer_state
from tasks.training.errors import TrainingInputError
from tasks.training.join import announce_head
from tasks.training.metrics import read_metrics
from tasks.training.rendezvous import serve_store, stop_serving

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 96, 16


def _place(argv: list[str], env: dict[str, str]) -> NodePlace:
    return place_of(build_parser().parse_args(["run.yaml", "--nproc-per-node", "8", *argv]), env)


def test_each_launchers_environment_gives_the_nodes_place() -> None:
    slurm = {"SLURM_JOB_ID": "41", "SLURM_NODEID": "1", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "n[1-4]"}
    assert _place([], slurm) == NodePlace("slurm", 1, 4, "slurm-41", None, 0)
    # a requeued job keeps its id: its incarnation is another rendezvous, whose spec is not the last one's
    assert _place([], {**slurm, "SLURM_RESTART_COUNT": "2"}).job == "slurm-41-r2"
    assert _place([], {**slurm, "SLURM_RESTART_COUNT": "0"}).job == "slurm-41"
    pet = {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    assert _place([], pet) == NodePlace("torchrun (PET_*)", 1, 2, None, "job-node-0-0.job", 29400)
    assert _place([], {**pet, "LLAMAFLOW_JOB_ID": "uid-3"}).job == "uid-3"
    jobset = {"JOB_COMPLETION_INDEX": "3"}
    assert _place(["--nnodes", "4", "--head-addr", "js-node-0-0.js"], jobset) == NodePlace(
        "indexed job", 3, 4, None, "js-node-0-0.js", 29500
    )
    flags = [
        "--node-rank",
        "0",
        "--nnodes",
        "2",
        "--head-addr",
        "198.18.0.9",
        "--port",
        "29600",
        "--job-id",
        "a",
    ]
    assert _place(flags, slurm) == NodePlace("flags", 0, 2, "a", "198.18.0.9", 29600)  # flags win


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        ([], {}, "no launcher says where this node stands"),
        ([], {"JOB_COMPLETION_INDEX": "1"}, "give --head-addr"),
        (["--node-rank", "1"], {}, "--node-rank needs --nnodes and --head-addr"),
        ([], {"PET_NODE_RANK": "x", "PET_MASTER_ADDR": "h", "PET_NNODES": "2"}, "PET_NODE_RANK='x'"),
    ],
)
def test_a_node_without_its_place_is_refused_naming_what_is_missing(
    argv: list[str], env: dict[str, str], says: str
) -> None:
    with pytest.raises(TrainingInputError, match=says):
        _place(argv, env)


def test_node_0_holds_the_rendezvous_port_from_the_moment_it_is_chosen() -> None:
    """No port is drawn free and bound later: the store binds it when it is chosen (port 0), and a fixed port
    another process holds is refused at once, naming the fix."""
    endpoint = serve_store("127.0.0.1")
    port = int(endpoint.rsplit(":", 1)[1])
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with socket.socket() as taken:
            taken.bind(("", 0))
            taken.listen()
            busy = taken.getsockname()[1]
            with pytest.raises(TrainingInputError, match=f"cannot serve the rendezvous store on port {busy}"):
                serve_store("127.0.0.1", busy)
    finally:
        stop_serving(endpoint)


NODE0 = """
import sys
from pathlib import Path
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainSettings, fit
shared = Path(sys.argv[1])
fit(ModelRef.model_validate_json((shared / "model.json").read_text()),
    DatasetRef.model_validate_json((shared / "dataset.json").read_text()),
    TrainSettings.model_validate_json(sys.argv[2]), shared / "run", progress=False)
"""


@pytest.mark.e2e
def test_a_nodes_process_outlives_its_torchrun_on_sigterm_and_the_stop_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLURM (proctrack/cgroup) signals every process of node 1's step at once and kills what is left when the
    node's process ends; a pod's end does the same. Node 1's process must stay until its torchrun is done."""
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "home"))
    dataset = write_packed_dataset(
        tmp_path / "packed",
        pattern_blocks(64, SEQ, VOCAB, 0),
        pattern_blocks(4, SEQ, VOCAB, 1),
        vocab_size=VOCAB,
    )
    (tmp_path / "model.json").write_text(
        model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ)).model_dump_json()
    )
    (tmp_path / "dataset.json").write_text(dataset.model_dump_json())
    run, job = tmp_path / "run", "stop-test"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = TrainSettings(
        micro_batch_size=2, max_steps=100000, compile=False, device="cpu", dtype="fp32", nnodes=2,
        rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=job, rdzv_timeout_s=120, stop_grace_s=30,
        process_group_timeout_min=2,
    )  # fmt: skip
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"preset": "tiny", "checkpoint_dir": str(run), "rdzv_timeout_s": 120}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMAFLOW_HOME": str(tmp_path / "home")}
    announce_head(run, job)
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("node0", "node1")}
    node0 = subprocess.Popen(
        [sys.executable, "-c", NODE0, str(tmp_path), settings.model_dump_json()],
        env=env, stdout=logs["node0"], stderr=subprocess.STDOUT,
    )  # fmt: skip
    node1 = subprocess.Popen(
        [sys.executable, "-m", "flows.node", str(config), "--nproc-per-node", "1", "--node-rank", "1",
         "--nnodes", "2", "--head-addr", "127.0.0.1", "--port", str(port), "--job-id", job],
        env=env, stdout=logs["node1"], stderr=subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip

    def output() -> str:
        return "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in logs)

    try:
        deadline = time.monotonic() + 300
        while max(read_metrics(run), default=0) < 3:
            assert node0.poll() is None and node1.poll() is None and time.monotonic() < deadline, output()
            time.sleep(0.5)
        tree = [psutil.Process(node1.pid), *psutil.Process(node1.pid).children(recursive=True)]
        torchrun = next(p for p in tree if "torch.distributed.run" in " ".join(p.cmdline()))
        for process in tree:  # every process of the node at once, as slurmstepd signals a step
            process.send_signal(signal.SIGTERM)
        while torchrun.is_running() and torchrun.status() != psutil.STATUS_ZOMBIE:
            assert node1.poll() is None, "node 1's process ended while its torchrun still ran:\n" + output()
            time.sleep(0.05)
        node1.wait(timeout=60)
        node0.wait(timeout=120)
    finally:
        for process in (node0, node1):
            if process.poll() is None:
                process.kill()
    assert node1.returncode == 130, output()
    newest = max(run.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    summary = load_trainer_state(newest)["summary"]
    assert summary["stopped_early"] == 1.0, (summary, output())
    assert json.loads((run / "torchrun_spec.json").read_text())["settings"]["rdzv_id"] == job
