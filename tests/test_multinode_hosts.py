"""Multi-node training across separate hosts (tests/hosts.py: namespaces with their own address, a Debian
hostname on 127.0.1.1, one shared directory): the plain engine (`fit`, torchrun's c10d rendezvous) on each
host, as a SLURM job or a hand-started cluster runs it. What one machine cannot show: who hosts the store,
which address a node gives, how long the others wait for a head still preparing its data."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.services.processes import free_port
from hosts import Cluster, cluster_for_test
from model import get_preset
from model.atomic import write_text_atomic
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training import TrainingError, TrainSettings, fit
from tasks.training.launch import RESULT_FILE, read_result
from tasks.training.rendezvous import NODE_ADDR_ENV

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 96, 16
# One node of the job: `fit` with the settings given, then the step it ended at.
NODE = """
import sys
from pathlib import Path
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainSettings, fit
from tasks.training.errors import TrainingError
shared = Path(sys.argv[1])
try:
    ref = fit(ModelRef.model_validate_json((shared / "model.json").read_text()),
              DatasetRef.model_validate_json((shared / "dataset.json").read_text()),
              TrainSettings.model_validate_json(sys.argv[2]), shared / "run", progress=False)
except TrainingError as e:
    print("REFUSED", type(e).__name__, e, flush=True)
    sys.exit(3)
print("ENDED AT STEP", ref.step, flush=True)
"""


def _tiny_inputs(root: Path) -> tuple[ModelRef, DatasetRef]:
    dataset = write_packed_dataset(
        root / "packed", pattern_blocks(32, SEQ, VOCAB, 0), pattern_blocks(4, SEQ, VOCAB, 1), vocab_size=VOCAB
    )
    return model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ)), dataset


def _inputs(hosts: Cluster, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The job's inputs on the shared file system; the environment every node runs with."""
    home = hosts.shared / "home"
    monkeypatch.setenv("LLAMAFLOW_HOME", str(home))
    model, dataset = _tiny_inputs(hosts.shared)
    (hosts.shared / "model.json").write_text(model.model_dump_json())
    (hosts.shared / "dataset.json").write_text(dataset.model_dump_json())
    env = {k: v for k, v in os.environ.items() if k != NODE_ADDR_ENV}
    return {**env, "LLAMAFLOW_HOME": str(home), "PYTHONPATH": str(REPO)}


def _start(hosts: Cluster, name: str, settings: TrainSettings, env: dict[str, str], log: Path):
    return hosts[name].popen(
        [sys.executable, "-c", NODE, str(hosts.shared), settings.model_dump_json()],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=hosts.shared,
    )


def _settings(endpoint: str, node_rank: int, **overrides) -> TrainSettings:
    return TrainSettings(
        **{
            "micro_batch_size": 2,
            "max_steps": 3,
            "warmup_steps": 1,
            "compile": False,
            "device": "cpu",
            "dtype": "fp32",
            "nnodes": 2,
            "rdzv_endpoint": endpoint,
            "node_rank": node_rank,
            "rdzv_timeout_s": 150,
            "stop_grace_s": 10,
            "process_group_timeout_min": 2,
            **overrides,
        }
    )


def test_a_node_started_well_before_the_head_waits_for_it_and_the_head_hosts_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """node1 starts 30 s before the head, as the other nodes of a SLURM job start while the head prepares its
    data; node1 waits for the head's store (up to rdzv_timeout_s, see the bound test below: torch's own wait
    is 60-120 s, so a delay that outlasts it for sure would cost CI over two minutes). The endpoint is the
    head's address, as a published endpoint is: torch's hostname guess does not recognise it on a host whose
    name maps to 127.0.1.1, so without is_host nobody hosts the store; and gloo, left to the hostname, would
    listen on 127.0.1.1."""
    with cluster_for_test(tmp_path, ["head", "node1"]) as hosts:
        env = _inputs(hosts, monkeypatch)
        endpoint = f"{hosts['head'].address}:29511"
        logs = {name: tmp_path / f"{name}.log" for name in ("head", "node1")}
        node1 = _start(hosts, "node1", _settings(endpoint, 1), env, logs["node1"])
        time.sleep(30)
        assert node1.poll() is None, (
            f"node1 gave up before the head came:\n{logs['node1'].read_text()[-3000:]}"
        )
        head = _start(hosts, "head", _settings(endpoint, 0), env, logs["head"])
        deadline = time.monotonic() + 180
        while any(p.poll() is None for p in (head, node1)) and time.monotonic() < deadline:
            time.sleep(0.5)
        outputs = {name: log.read_text() for name, log in logs.items()}
        for name, process in (("head", head), ("node1", node1)):
            assert process.returncode == 0, f"{name} failed:\n" + "\n".join(
                f"--- {n}\n{o[-3000:]}" for n, o in outputs.items()
            )
            assert "ENDED AT STEP 3" in outputs[name], outputs[name][-2000:]


def test_a_node_whose_address_is_loopback_is_refused_naming_the_variable_that_fixes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The endpoint names the head, whose own name maps to 127.0.1.1 (Debian): its address for the other
    nodes would be loopback (MASTER_ADDR too, where global rank 0 lands on it). Refused at once, before
    torchrun starts."""
    with cluster_for_test(tmp_path, ["head", "node1"]) as hosts:
        env = _inputs(hosts, monkeypatch)
        settings = _settings("head:29512", 0, rdzv_timeout_s=5)
        started = time.monotonic()
        head = _start(hosts, "head", settings, env, tmp_path / "head.log")
        head.wait(timeout=120)
        output = (tmp_path / "head.log").read_text()
        assert head.returncode == 3, output[-3000:]
        assert (
            "REFUSED TrainingInputError node 0: this node's address for the other nodes would be 127."
            in output
        )
        assert f"Set {NODE_ADDR_ENV} to this machine's address" in output, output[-3000:]
        assert time.monotonic() - started < 30


def test_node_0_on_a_machine_the_endpoint_does_not_name_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0 hosts the store at the endpoint; started elsewhere (a pool worker on another host took node
    0's run, a hand-started job mixed up), every node would wait out the rendezvous. Refused before any work."""
    with cluster_for_test(tmp_path, ["head", "node1"]) as hosts:
        env = _inputs(hosts, monkeypatch)
        settings = _settings(f"{hosts['head'].address}:29513", 0, rdzv_timeout_s=5)
        started = time.monotonic()
        node1 = _start(hosts, "node1", settings, env, tmp_path / "node1.log")
        node1.wait(timeout=120)
        output = (tmp_path / "node1.log").read_text()
        assert node1.returncode == 3, output[-3000:]
        assert (
            "node 0 hosts the rendezvous store at rdzv_endpoint=198.18.0.1:29513, but 198.18.0.1 is not this"
            in output
        )
        assert "start node 0 (node_rank=0) on the machine that endpoint names" in output
        assert time.monotonic() - started < 30


def test_a_node_waits_for_node_0s_store_as_long_as_rdzv_timeout_s_not_torchs_default(tmp_path: Path) -> None:
    """torch's own wait for the store (its c10d `read_timeout`, 60 s, then a retry after a random backoff:
    60-120 s in all) is replaced by rdzv_timeout_s: short here, so the bound shows in seconds; long in
    the test above, so node1 outwaits a late head."""
    model, dataset = _tiny_inputs(tmp_path)
    settings = _settings(f"127.0.0.1:{free_port()}", 1, rdzv_timeout_s=10)  # node 0 never comes
    started = time.monotonic()
    with pytest.raises(
        TrainingError, match=r"node 1 could not reach the rendezvous store at 127.0.0.1:\d+ within"
    ):
        fit(model, dataset, settings, tmp_path / "run", progress=False)
    assert time.monotonic() - started < 50  # 10 s, a backoff of at most 10 s, torchrun's start


def test_a_node_reads_rank_0s_result_that_shows_after_its_own_torchrun_ended(tmp_path: Path) -> None:
    """Global rank 0 may run on another node; its result can show late on this node's view of the shared
    disk (an NFS client's cached "no such file"). The launcher waits for it, within a bound."""
    path = tmp_path / RESULT_FILE
    ref = CheckpointRef(path=str(tmp_path / "step_000003"), run_dir=str(tmp_path), step=3, tokens_seen=96)
    threading.Timer(1.5, lambda: write_text_atomic(path, ref.model_dump_json())).start()
    assert read_result(path, wait_s=20) == ref
    started = time.monotonic()
    assert read_result(tmp_path / "never-written.json", wait_s=1) is None
    assert time.monotonic() - started < 5
