"""`python -m flows.slurm` without a cluster: the batch script it prints, the inputs it refuses before
anything is written or submitted, and what the other nodes of a job do before node 0 is there
(tasks/training/join.py). The job itself runs in tests/test_slurm_hosts.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from flows import cli
from flows.node import build_parser, place_of
from flows.slurm.__main__ import main
from flows.slurm.node import head_address
from flows.slurm.script import check_kill_wait
from model import get_preset
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.training import TrainSettings
from tasks.training.control import StopSignals
from tasks.training.errors import TrainingInputError
from tasks.training.join import announce_head, wait_for_head, wait_for_spec
from tasks.training.launch import SPEC_FILE, WorkerSpec, write_worker_spec


def _config(tmp_path: Path, **fields: object) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"preset": "tiny", "max_steps": 10, **fields}))
    return path


def test_the_script_runs_one_node_step_per_node_with_a_rank_per_gpu(tmp_path: Path, capsys) -> None:
    run = tmp_path / "shared" / "run"
    config = _config(tmp_path, checkpoint_dir=str(run), model_name="m7")
    assert main([str(config), "--nodes", "4", "--gpus-per-node", "8", "--sbatch=--time=1:00:00"]) == 0
    script = capsys.readouterr().out
    for directive in (
        "--nodes=4",
        "--ntasks-per-node=1",
        "--exclusive",
        "--gpus-per-node=8",
        "--time=1:00:00",
        "--job-name=m7",
    ):
        assert f"#SBATCH {directive}\n" in script, script
    assert f"#SBATCH --output={run}/slurm-%j.out\n" in script
    step = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in step and f"flows.node {config}" in step, step
    assert f"--nproc-per-node 8 --checkpoint-dir {run} &" in step, step  # nodes: from SLURM's environment
    assert not run.exists()  # printing writes nothing


def test_the_job_requeues_itself_before_its_time_limit_unless_told_not_to(tmp_path: Path, capsys) -> None:
    """USR1 stop_grace_s + 60 s before the limit, to the batch shell only (B:), whose trap requeues the job:
    every node then stops at a checkpoint and the next incarnation resumes. The step runs in the background,
    as bash runs a trap only between commands; the script's exit status is still the step's."""
    config = _config(tmp_path, checkpoint_dir=str(tmp_path / "run"), stop_grace_s=20)
    assert main([str(config), "--nodes", "2", "--gpus-per-node", "8"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --requeue\n" in script and "#SBATCH --signal=B:USR1@80\n" in script, script
    assert 'scontrol requeue "$SLURM_JOB_ID"\' USR1' in script, script
    assert 'until wait "$step"; do status=$?; kill -0 "$step" 2>/dev/null || exit "$status"; done' in script
    argv = [str(config), "--nodes", "2", "--gpus-per-node", "8", "--no-requeue", "--no-requeue-before-limit"]
    assert main(argv) == 0
    script = capsys.readouterr().out
    assert "--requeue" not in script and "--signal" not in script and "trap" not in script, script
    assert next(line for line in script.splitlines() if line.startswith("srun ")).endswith(
        str(tmp_path / "run")
    )


def test_a_stop_grace_longer_than_killwait_is_named_with_its_fix(tmp_path: Path) -> None:
    config = cli.config_from_args(["--preset", "tiny", "--stop-grace-s", "30"])
    assert check_kill_wait(config, None) is None and check_kill_wait(config, 31) is None
    says = check_kill_wait(config, 30)
    assert says is not None and "stop_grace_s=30 does not fit in this cluster's KillWait=30 s" in says
    assert "Set stop_grace_s below 30" in says


@pytest.mark.parametrize(
    ("args", "fields", "says"),
    [
        (["--nodes", "0"], {}, "--nodes 0: a job needs at least one node"),
        ([], {"checkpoint_dir": None}, "a SLURM job needs checkpoint_dir"),
        ([], {"checkpoint_dir": "runs/x"}, "is relative: give an absolute path on the shared file system"),
        (
            [],
            {"checkpoint_dir": "/dev/shm/llamaflow-slurm-test"},
            "on a tmpfs file system, which only this machine",
        ),
        ([], {"placement": "deployment"}, "set placement: local"),
        ([], {"lr": -1.0}, "invalid configuration"),
    ],
)
def test_bad_input_is_refused_before_anything_is_submitted(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, args: list[str], fields: dict, says: str
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: a submission would fail differently
    config = _config(tmp_path, **{"checkpoint_dir": str(tmp_path / "run"), **fields})
    argv = [str(config), "--nodes", "2", "--gpus-per-node", "8", "--submit", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert not (tmp_path / "run").exists() and not Path("/dev/shm/llamaflow-slurm-test").exists()


def test_submit_without_sbatch_names_the_fix(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    config = _config(tmp_path, checkpoint_dir=str(tmp_path / "run"))
    assert main([str(config), "--nodes", "2", "--gpus-per-node", "8", "--submit"]) == 2
    err = capsys.readouterr().err
    assert "sbatch, which is not on PATH" in err and "leave out --submit" in err, err
    assert not (tmp_path / "run").exists()


def test_a_node_that_never_sees_node_0_in_the_run_directory_stops_naming_shared_storage(
    tmp_path: Path,
) -> None:
    announce_head(tmp_path / "elsewhere", "slurm-7")  # node 0's mark, in a directory node k does not see
    with pytest.raises(TrainingInputError, match="file system every node mounts at the same path"):
        wait_for_head(tmp_path / "run", "slurm-7", 0.5)
    announce_head(tmp_path / "run", "slurm-6")  # an earlier job's mark is not this job's
    with pytest.raises(TrainingInputError, match="node 0 of job slurm-7 did not announce itself"):
        wait_for_head(tmp_path / "run", "slurm-7", 0.5)
    announce_head(tmp_path / "run", "slurm-7")
    wait_for_head(tmp_path / "run", "slurm-7", 0.5)


def test_a_spec_left_by_an_earlier_job_is_not_taken(tmp_path: Path) -> None:
    dataset = write_packed_dataset(
        tmp_path / "p", pattern_blocks(4, 8, 32, 0), pattern_blocks(2, 8, 32, 1), vocab_size=32
    )
    model = model_ref(get_preset("tiny", vocab_size=32, max_position_embeddings=8))

    def spec(job: str) -> WorkerSpec:
        settings = TrainSettings(max_steps=1, nnodes=2, rdzv_endpoint="198.18.0.1:29500", rdzv_id=job)
        return WorkerSpec(
            model_ref=model, dataset_ref=dataset, settings=settings, run_dir=str(tmp_path), progress=False
        )

    write_worker_spec(spec("slurm-6"))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(wait_for_spec, tmp_path, "slurm-7")
        with pytest.raises(TimeoutError):
            waiting.result(timeout=1.5)
        write_worker_spec(spec("slurm-7"))
        assert waiting.result(timeout=10).settings.rdzv_id == "slurm-7"
    assert json.loads((tmp_path / SPEC_FILE).read_text())["settings"]["rdzv_id"] == "slurm-7"


def test_node_0_refuses_a_loopback_address_naming_llamaflow_node_addr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLAMAFLOW_NODE_ADDR", "127.0.1.1")
    with pytest.raises(TrainingInputError) as refused:
        head_address(["node1"])
    says = str(refused.value)
    # srun copies a batch script's export to every node: the fix must be one each node resolves for itself
    assert "export LLAMAFLOW_NODE_IFACE=eth0 in the batch script" in says, says
    assert "LLAMAFLOW_NODE_ADDR to this machine's address, set on this machine only" in says, says
    monkeypatch.delenv("LLAMAFLOW_NODE_ADDR")
    monkeypatch.setenv("LLAMAFLOW_NODE_IFACE", "lo")
    with pytest.raises(TrainingInputError, match="got 127.0.0.1"):
        head_address(["node1"])


def test_sigterm_from_slurm_and_torchrun_at_once_is_one_stop_request_but_ctrl_c_twice_is_not() -> None:
    signals = StopSignals()
    try:
        with signals.installed():
            os.kill(os.getpid(), signal.SIGTERM)  # scancel: SLURM signals every process of the job ...
            os.kill(os.getpid(), signal.SIGTERM)  # ... and torchrun forwards its own copy to its workers
    except KeyboardInterrupt as err:  # not raised on: it would end the whole pytest session
        pytest.fail(f"one scancel was taken for two stop requests: {err}")
    assert signals.received == "SIGTERM"
    signals = StopSignals()
    with signals.installed(), pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)


def test_the_trap_requeues_while_the_step_runs_and_the_script_ends_with_the_step(
    tmp_path: Path, capsys
) -> None:
    """The batch script as rendered, with the step replaced by a process of known length and `scontrol` by
    a function recording its call: bash runs the USR1 trap at once (not after the step), then waits for the
    step and ends with its exit status."""
    config = _config(tmp_path, checkpoint_dir=str(tmp_path / "run"))
    assert main([str(config), "--nodes", "2", "--gpus-per-node", "8"]) == 0
    script = capsys.readouterr().out
    step = next(line for line in script.splitlines() if line.startswith("srun "))
    calls = tmp_path / "calls"
    stub = f'scontrol() {{ echo "$(date +%s.%N) $*" >> {calls}; }}\n'
    command = step.removesuffix(" &")
    body = script.replace("#!/bin/bash\n", f"#!/bin/bash\n{stub}").replace(command, "(sleep 4; exit 3)")
    (tmp_path / "job.sh").write_text(body)
    started = time.time()
    shell = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env={**os.environ, "SLURM_JOB_ID": "9"})
    time.sleep(1)
    shell.send_signal(signal.SIGUSR1)
    assert shell.wait(timeout=20) == 3  # the step's status, after the trap
    at, call = calls.read_text().split(" ", 1)
    assert call.strip() == "requeue 9"
    assert float(at) - started < 3, "the trap waited for the step to end"
    assert time.time() - started >= 4  # and the script waited for the step


def test_a_requeued_job_is_a_new_incarnation_that_never_takes_the_last_ones_spec(tmp_path: Path) -> None:
    """`scontrol requeue` keeps SLURM_JOB_ID: the incarnation's rendezvous id carries SLURM_RESTART_COUNT,
    so node k of the requeued job waits for its own node 0 instead of joining the dead endpoint in the spec
    the first incarnation left; and node 0 of the new incarnation removes that spec when it starts."""
    dataset = write_packed_dataset(
        tmp_path / "p", pattern_blocks(4, 8, 32, 0), pattern_blocks(2, 8, 32, 1), vocab_size=32
    )
    model = model_ref(get_preset("tiny", vocab_size=32, max_position_embeddings=8))
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "1", "SLURM_NNODES": "2"}
    args = build_parser().parse_args(["run.yaml", "--nproc-per-node", "1"])
    first = place_of(args, slurm).job
    second = place_of(args, {**slurm, "SLURM_RESTART_COUNT": "1"}).job
    assert first != second
    settings = TrainSettings(max_steps=1, nnodes=2, rdzv_endpoint="198.18.0.1:29500", rdzv_id=first)
    write_worker_spec(
        WorkerSpec(
            model_ref=model, dataset_ref=dataset, settings=settings, run_dir=str(tmp_path), progress=False
        )
    )
    mine = WorkerSpec(
        model_ref=model,
        dataset_ref=dataset,
        settings=settings.model_copy(update={"rdzv_id": second, "rdzv_endpoint": "198.18.0.1:29600"}),
        run_dir=str(tmp_path),
        progress=False,
    )
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(wait_for_spec, tmp_path, second)
        try:
            with pytest.raises(TimeoutError):
                waiting.result(timeout=1.5)
            announce_head(tmp_path, second)  # node 0 of the requeued job
            removed = not (tmp_path / SPEC_FILE).exists()
        finally:
            write_worker_spec(mine)  # the waiting node's spec comes whatever failed above: it never hangs
        assert waiting.result(timeout=10).settings.rdzv_endpoint == "198.18.0.1:29600"
    assert removed, "node 0 of the new incarnation left the last one's spec in place"
