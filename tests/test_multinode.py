"""Multi-node training, on this machine: torchrun's c10d rendezvous on the loopback address, and the pool.

The pool: a real Prefect server, the train deployment of prefect.yaml (run from this checkout), and two
process workers in two directories, each taking one flow run at a time (`--limit 1`), as one worker per GPU
machine would; they share LLAMAFLOW_HOME (the shared storage). A pretrain run with `nnodes: 2`,
`placement: deployment` starts one train run per node, loses a whole node mid-run (its torchrun agent and
worker SIGKILLed), starts both nodes again, resumes from the newest checkpoint, and registers the model.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
)
from prefect.states import Cancelled, Running

from flows.pool import nodes
from flows.pool.placement import PlacementError, check_placement, train_on_deployment
from flows.pretrain_config import PretrainConfig
from flows.services.processes import free_port
from model import get_preset
from prefect_server import (
    POOL,
    TINY_RUN,
    child_flow_runs,
    deploy_from_checkout,
    flow_run_logs,
    idle_train_deployment,
    pool_server,
    prefect_worker,
    tail,
)
from stdlib_corpus import STDLIB
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainingError, TrainSettings, fit
from tasks.training.faults import ENV_VAR
from tasks.training.rendezvous import NODE_ADDR_ENV

REPO = Path(__file__).resolve().parents[1]
VOCAB = 96
SEQ = 16


def _tiny_inputs(root: Path) -> tuple[ModelRef, DatasetRef]:
    dataset = write_packed_dataset(
        root / "packed", pattern_blocks(32, SEQ, VOCAB, 0), pattern_blocks(4, SEQ, VOCAB, 1), vocab_size=VOCAB
    )
    return model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ)), dataset


def test_a_node_that_never_arrives_ends_the_rendezvous_in_bounded_time_naming_the_count(
    tmp_path: Path,
) -> None:
    model, dataset = _tiny_inputs(tmp_path)
    settings = TrainSettings(
        micro_batch_size=2,
        compile=False,
        device="cpu",
        nnodes=2,
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_timeout_s=5,
    )
    started = time.monotonic()
    with pytest.raises(TrainingError) as failed:
        fit(model, dataset, settings, tmp_path / "run", progress=False)
    took_s = time.monotonic() - started
    message = str(failed.value)
    assert "gathered 1 of 2 nodes within rdzv_timeout_s=5 s" in message
    assert "reaches 127.0.0.1:" in message and "--limit 1" in message
    assert took_s < 60, f"the rendezvous gave up after {took_s:.0f} s"


def test_several_nodes_without_a_way_to_meet_are_refused_before_the_data_stages(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match="nnodes=2 with placement='local' needs rdzv_endpoint"):
        check_placement(PretrainConfig(preset="tiny", nnodes=2))
    check_placement(PretrainConfig(preset="tiny", nnodes=2, rdzv_endpoint="head:29500"))
    with pytest.raises(TrainingError, match="nnodes=2 needs rdzv_endpoint"):
        fit(*_tiny_inputs(tmp_path), TrainSettings(nnodes=2), tmp_path / "run")


def test_node_0_on_the_pool_never_publishes_a_guessed_loopback_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that reaches the Prefect API over loopback (a server on its machine, a local proxy) would
    guess a loopback address, which node 1 on another machine waits for in vain: refused at node 0, naming
    the variable that fixes it, before anything is published."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv(NODE_ADDR_ENV, raising=False)
    model, dataset = _tiny_inputs(tmp_path)
    settings = TrainSettings(nnodes=2)
    refused = pytest.raises(nodes.NodeError, match=f"a loopback address .* set {NODE_ADDR_ENV} in the worker")
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}), refused:
        nodes.open_rendezvous(settings, str(tmp_path / "run"), model, dataset, str(uuid.uuid4()))
    assert not (tmp_path / "run").exists()  # no token written, nothing published


# ---------------------------------------------------------------- the pool


@dataclass
class Pool:
    env: dict[str, str]
    logs: list[Path]
    tracking_uri: str


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    root = tmp_path_factory.mktemp("multinode")
    with pool_server(root, {"PREFECT_WORKER_QUERY_SECONDS": "1"}) as server:
        deploy_from_checkout(root, server.env, "gpu")
        # Every node run loses its node at step 3 the first time (a marker in the run directory). Both
        # "machines" are this one: said outright, as a loopback endpoint is refused otherwise.
        worker_env = {**server.env, ENV_VAR: "kill_node_at_step=3", NODE_ADDR_ENV: "127.0.0.1"}
        logs = []
        workers = []
        for name in ("machine-a", "machine-b"):
            (root / name).mkdir()
            logs.append(root / name / "worker.log")
            workers.append(
                prefect_worker(
                    POOL,
                    {**worker_env, "PREFECT_HOME": str(root / name / "prefect")},
                    root / name,
                    logs[-1],
                    limit=1,
                )
            )
        with workers[0], workers[1]:
            yield Pool(server.env, logs, server.tracking_uri)


@pytest.mark.e2e
def test_two_nodes_on_the_pool_lose_a_node_start_again_resume_and_register(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.pretrain import pretrain

    monkeypatch.setenv("MLFLOW_TRACKING_URI", pool.tracking_uri)
    model_name = f"nodes-{uuid.uuid4().hex[:8]}"
    config = PretrainConfig(
        **{**TINY_RUN, "max_steps": 6, "checkpoint_every": 2, "dtype": "fp32"},
        data=str(STDLIB / "email" / "*.py"),  # a small corpus: the data stages take seconds
        val_data=str(STDLIB / "json" / "*.py"),
        model_name=model_name,
        placement="deployment",
        nnodes=2,
        nproc_per_node=1,
        train_retries=1,
        rdzv_timeout_s=120,
        stop_grace_s=20,
        process_group_timeout_min=2,
    )
    try:
        result = pretrain(config)
    except BaseException:
        print("\n".join(tail(log, 6000) for log in pool.logs))
        raise

    assert result.checkpoint.step == 6 and result.registered.version == "1"
    children = child_flow_runs(uuid.UUID(Path(result.checkpoint.run_dir).name))
    states = [r.state.type.value for r in children]
    # Two tries of two node runs: the first lost a node (one failed, the other failed or was cancelled),
    # the second completed; each try ran on both machines at once.
    assert len(children) == 4 and states[2:] == ["COMPLETED", "COMPLETED"], states
    assert set(states[:2]) <= {"FAILED", "CANCELLED", "CRASHED"} and "FAILED" in states[:2], states
    for pair in (children[:2], children[2:]):
        assert sorted(r.parameters["node"] for r in pair) == [0, 1]
    node0 = next(r for r in children[2:] if r.parameters["node"] == 0)
    assert node0.labels.get(nodes.ENDPOINT_LABEL, "").startswith("127.0.0.1:")

    run_dir = Path(result.checkpoint.run_dir)
    assert (run_dir / ".fault-kill_node_at_step-3").exists()
    pretrain_logs = flow_run_logs(uuid.UUID(run_dir.name))
    assert any(
        "the 2-node training failed: node" in m and "starting the 2 nodes again" in m for m in pretrain_logs
    )
    events = [
        json.loads(line)["event"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"event"' in line
    ]
    assert [e["step"] for e in events if "resumed_from" in e] == [2]  # the second try resumed, not restarted

    mlflow = MlflowClient(pool.tracking_uri, registry_uri=pool.tracking_uri)
    steps = [m.step for m in mlflow.get_metric_history(result.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 7))  # every step once, from node 0 only


@pytest.mark.e2e
def test_node_runs_that_do_not_end_in_time_are_all_cancelled(pool: Pool, tmp_path: Path) -> None:
    idle = idle_train_deployment(pool.env)
    model, dataset = _tiny_inputs(tmp_path)
    settings = TrainSettings(micro_batch_size=2, nnodes=2, stop_grace_s=1)
    with pytest.raises(PlacementError, match=r"2-node training did not end in time.*node 0 .*never started"):
        train_on_deployment(
            "remote-train/idle",
            model,
            dataset,
            settings,
            str(tmp_path / "run"),
            run_id=None,
            retries=0,
            timeout_s=3,
        )
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[idle])))
    assert len(runs) == 2 and all(r.state.type.value == "CANCELLED" for r in runs)

    # The pretrain run stopped while it waits (a cancellation arrives as an exception in the flow run, as
    # Ctrl-C does): every node run is cancelled at once, not left to the server's cleanup pass. In a process
    # of its own: a KeyboardInterrupt in this one would leave Prefect's shared event loop mid-call.
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-X",
            "faulthandler",  # SIGABRT then prints every thread's stack: where a hang is
            "-c",
            "import sys; from flows.pool.placement import train_on_deployment; "
            "from tasks.refs import DatasetRef, ModelRef; from tasks.training import TrainSettings; "
            "train_on_deployment('remote-train/idle', ModelRef.model_validate_json(sys.argv[1]), "
            "DatasetRef.model_validate_json(sys.argv[2]), TrainSettings.model_validate_json(sys.argv[3]), "
            "sys.argv[4], run_id=None, retries=0, timeout_s=600)",
            model.model_dump_json(),
            dataset.model_dump_json(),
            settings.model_dump_json(),
            str(tmp_path / "run2"),
        ],
        env={**pool.env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # An earlier module can leave SIGINT ignored in this process; an ignored SIGINT is inherited across
        # exec, and Python then installs no KeyboardInterrupt handler: the child would never see the signal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        with get_client(sync_client=True) as client:
            filter_ = DeploymentFilter(id=DeploymentFilterId(any_=[idle]))
            while len(client.read_flow_runs(deployment_filter=filter_)) < 4:
                assert waiting.poll() is None, waiting.communicate()[0].decode()[-3000:]
                assert time.monotonic() < deadline, "the two node runs were never created"
                time.sleep(0.5)
        time.sleep(1)
        waiting.send_signal(signal.SIGINT)
        try:
            output = waiting.communicate(timeout=120)[0].decode()
        except subprocess.TimeoutExpired:
            waiting.send_signal(signal.SIGABRT)
            stacks = waiting.communicate(timeout=60)[0].decode()
            pytest.fail(
                f"the waiting run did not end within 120 s of SIGINT; its output and threads:\n{stacks[-8000:]}"
            )
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode != 0 and "KeyboardInterrupt" in output, output[-3000:]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[idle])))
    assert len(runs) == 4 and all(r.state.type.value == "CANCELLED" for r in runs)


@flow(name="node-0-stand-in")
def _node0_stand_in() -> None:
    """A flow run that plays node 0's part here (its labels and state); never run."""


@pytest.mark.e2e
def test_a_node_refuses_a_checkpoint_directory_it_does_not_share_with_node_0(
    pool: Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLAMAFLOW_NODE_ADDR", "127.0.0.1")  # every node on this machine: loopback is right
    model, dataset = _tiny_inputs(tmp_path)
    settings = TrainSettings(micro_batch_size=2, nnodes=2, rdzv_timeout_s=5)
    with get_client(sync_client=True) as client:
        node0 = client.create_flow_run(_node0_stand_in, state=Running())
    # Node 0 writes its token into its run directory; node 1's "same" directory is another disk.
    published = nodes.open_rendezvous(settings, str(tmp_path / "node0-disk"), model, dataset, str(node0.id))
    assert published.rdzv_endpoint.startswith("127.0.0.1:")
    with pytest.raises(nodes.NodeError, match=r"node 1: checkpoint directory .* is not shared with node 0"):
        nodes.join_rendezvous(settings, str(tmp_path / "node1-disk"), model, dataset, 1, str(node0.id))
    joined = nodes.join_rendezvous(settings, str(tmp_path / "node0-disk"), model, dataset, 1, str(node0.id))
    assert joined.rdzv_endpoint == published.rdzv_endpoint

    # A node 0 that ended before publishing: node 1 does not wait out the timeout.
    with get_client(sync_client=True) as client:
        silent = client.create_flow_run(_node0_stand_in, state=Cancelled())
    started = time.monotonic()
    with pytest.raises(nodes.NodeError, match="node 0 .* ended Cancelled before it published"):
        nodes.join_rendezvous(settings, str(tmp_path / "node0-disk"), model, dataset, 1, str(silent.id))
    assert time.monotonic() - started < 5
