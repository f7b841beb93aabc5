"""Faults under torchrun and around the run directory: a rank killed mid-run (torchrun restarts the group,
training resumes, every step reaches the sink once), a stop whose checkpoint outlasts torchrun's default
30 s shutdown timeout, and two jobs on one checkpoint directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from model import get_preset
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainingInputError, TrainingInterrupted, TrainSettings, fit
from tasks.training.checkpoint import MODEL_FILE, checkpoint_dirs, checkpoint_problem
from tasks.training.faults import ENV_VAR
from tasks.training.launch import WorkerSpec
from tasks.training.metrics import METRICS_FILE
from tasks.training.run_lock import RunDirectoryBusy

REPO = Path(__file__).resolve().parents[1]
VOCAB = 96
SEQ = 16


class Recorder:
    """A metrics sink that keeps every call, duplicates included."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.steps.append(step)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelRef, DatasetRef]:
    root = tmp_path_factory.mktemp("faults")
    dataset = write_packed_dataset(
        root / "packed", pattern_blocks(64, SEQ, VOCAB, 0), pattern_blocks(4, SEQ, VOCAB, 1), vocab_size=VOCAB
    )
    return model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ)), dataset


def _settings(**changes: object) -> TrainSettings:
    base = TrainSettings(micro_batch_size=2, compile=False, dtype="fp32", device="cpu", warmup_steps=1)
    return base.model_copy(update=changes)


def _events(run_dir: Path) -> list[dict]:
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return [json.loads(line)["event"] for line in lines if '"event"' in line]


def test_a_killed_rank_is_restarted_by_torchrun_and_every_step_reaches_the_sink_once(
    inputs: tuple[ModelRef, DatasetRef], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, dataset = inputs
    # Rank 1 is SIGKILLed right after step 3, past the checkpoint of step 2: the restarted group resumes
    # there and runs step 3 again, which rank 0 logs a second time in metrics.jsonl.
    monkeypatch.setenv(ENV_VAR, "kill_rank_at_step=3")
    settings = _settings(nproc_per_node=2, max_restarts=1, max_steps=6, checkpoint_every=2)
    sink = Recorder()
    result = fit(model, dataset, settings, tmp_path / "run", sink, progress=False)

    assert result.step == 6
    assert (tmp_path / "run" / ".fault-kill_rank_at_step-3").exists()  # the kill did happen
    assert [e["step"] for e in _events(tmp_path / "run") if "resumed_from" in e] == [2]
    logged = [
        json.loads(line)["step"]
        for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()
        if '"metrics"' in line
    ]
    assert logged.count(3) == 2  # the step re-run after the restart ...
    assert sink.steps == [1, 2, 3, 4, 5, 6]  # ... reached the sink once: complete, in order, no duplicates
    assert [s for s, _ in checkpoint_dirs(tmp_path / "run")] == [4, 6]


def test_bad_input_found_on_a_rank_reaches_the_caller_in_the_ranks_own_words(
    inputs: tuple[ModelRef, DatasetRef], tmp_path: Path
) -> None:
    """A TrainingInputError raised on the ranks under torchrun (here: the run directory's only checkpoint is
    damaged, which the ranks find when they look for one to resume) is what `fit` raises, with the ranks'
    message, not a generic "torchrun failed"."""
    model, dataset = inputs
    run_dir = tmp_path / "run"
    fit(model, dataset, _settings(max_steps=2, checkpoint_every=2), run_dir, progress=False)
    [(_, step_dir)] = checkpoint_dirs(run_dir)
    weights = bytearray((step_dir / MODEL_FILE).read_bytes())
    weights[-1] ^= 0xFF
    (step_dir / MODEL_FILE).write_bytes(bytes(weights))

    settings = _settings(nproc_per_node=2, max_steps=4, checkpoint_every=2)
    with pytest.raises(TrainingInputError) as refused:
        fit(model, dataset, settings, run_dir, progress=False)
    message = str(refused.value)
    assert message.startswith(f"{run_dir} holds 1 checkpoint(s) and none is valid"), message
    assert "model.safetensors does not match its sha256" in message and "torchrun" not in message


def test_a_stop_keeps_its_checkpoint_when_writing_it_outlasts_torchruns_default_shutdown_timeout(
    inputs: tuple[ModelRef, DatasetRef], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, dataset = inputs
    # torchrun's default: SIGKILL 30 s after it forwards the stop. The write takes longer than that here.
    monkeypatch.setenv(ENV_VAR, "checkpoint_delay_s=32")
    settings = _settings(max_restarts=1, max_steps=100_000)  # one worker, under torchrun
    sink = Recorder()
    stop_at = 0.0

    def stop() -> bool:
        nonlocal stop_at
        if sink.steps and not stop_at:
            stop_at = time.monotonic()
        return bool(sink.steps)

    with pytest.raises(TrainingInterrupted, match="stop request"):
        fit(model, dataset, settings, tmp_path / "run", sink, progress=False, should_stop=stop)
    took_s = time.monotonic() - stop_at
    [(step, path)] = checkpoint_dirs(tmp_path / "run")
    assert step >= 1 and checkpoint_problem(path) is None
    assert took_s > 32  # the write really outlasted torchrun's default


def _start_holder(
    model: ModelRef, dataset: DatasetRef, settings: TrainSettings, run_dir: Path, env: Mapping[str, str]
) -> subprocess.Popen:
    """A training job in another process (`fit`, as a flow run calls it), until killed."""
    spec = run_dir.parent / "holder.json"
    spec.write_text(
        WorkerSpec(
            model_ref=model, dataset_ref=dataset, settings=settings, run_dir=str(run_dir), progress=False
        ).model_dump_json()
    )
    code = (
        "import sys; from tasks.training.launch import WorkerSpec, fit; "
        "s = WorkerSpec.model_validate_json(open(sys.argv[1]).read()); "
        "fit(s.model_ref, s.dataset_ref, s.settings, s.run_dir, progress=False)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.Popen([sys.executable, "-c", code, str(spec)], env=env, start_new_session=True)


def test_a_second_job_on_a_checkpoint_directory_refuses_until_the_first_is_gone(
    inputs: tuple[ModelRef, DatasetRef], tmp_path: Path
) -> None:
    model, dataset = inputs
    run_dir = tmp_path / "run"
    settings = _settings(max_steps=12, checkpoint_every=2, stop_grace_s=1)
    # The first job checkpoints slowly (2 s a write), so it is still training while the second one tries.
    holder = _start_holder(model, dataset, settings, run_dir, {ENV_VAR: "checkpoint_delay_s=2"})
    try:
        deadline = time.monotonic() + 120
        while not checkpoint_dirs(run_dir):
            assert holder.poll() is None and time.monotonic() < deadline, "the first job did not checkpoint"
            time.sleep(0.2)

        second = settings.model_copy(update={"checkpoint_every": 0})
        with pytest.raises(RunDirectoryBusy) as refused:
            fit(model, dataset, second, run_dir, progress=False)
        message = str(refused.value)
        assert f"pid {holder.pid} on " in message and "own checkpoint_dir" in message
        assert "\n" not in message
        assert holder.poll() is None  # the first job trains on, untouched

        os.killpg(holder.pid, signal.SIGKILL)  # a crash: the kernel drops its lock
        holder.wait()
        newest = checkpoint_dirs(run_dir)[-1][0]
        assert newest < 12
        result = fit(model, dataset, second, run_dir, progress=False)
        assert result.step == 12
        assert [e["step"] for e in _events(run_dir) if "resumed_from" in e] == [newest]
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
