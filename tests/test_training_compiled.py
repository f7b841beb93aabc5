"""Compiled bf16 training: agrees with eager, never recompiles, and resumes bit for bit after `kill -9`.

One in-process compiled run is the reference for every assertion here; the killed and resumed runs are
real subprocesses (`python -m tasks.training.rank`), sharing the inductor cache with this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from model import LlamaForPretraining, get_preset
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.data.packed import open_blocks
from tasks.home import PROJECT_ROOT
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training import TrainSettings, fit, read_metrics
from tasks.training.checkpoint import checkpoint_dirs, checkpoint_problem
from tasks.training.faults import ENV_VAR
from tasks.training.launch import WorkerSpec, write_worker_spec
from tasks.training.loader import BlockLoader

VOCAB = 96
SEQ = 16
PAD = 0


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelRef, DatasetRef]:
    blocks = pattern_blocks(29, SEQ, VOCAB, 0)
    rng = np.random.default_rng(1)
    for row in range(0, 29, 3):
        blocks[row, rng.integers(2, SEQ) :] = PAD
    dataset = write_packed_dataset(
        tmp_path_factory.mktemp("packed"), blocks, pattern_blocks(4, SEQ, VOCAB, 2), vocab_size=VOCAB
    )
    model = model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ))
    return model, dataset


def run_settings(**overrides: object) -> TrainSettings:
    # Global batch 9 over 29 blocks: 3 epochs are ceil(87 / 9) = 10 steps of 9 blocks; steps 4, 7 and 10
    # cross an epoch's end (its leftover blocks and the next epoch's first ones), as whole steps.
    base: dict[str, object] = dict(
        micro_batch_size=3,
        accumulate_steps=3,
        epochs=3.0,
        lr=3e-3,
        warmup_steps=2,
        compile=True,
        dtype="bf16",
        checkpoint_every=2,
        keep_checkpoints=2,
    )
    base.update(overrides)
    return TrainSettings(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def compiled_run(
    refs: tuple[ModelRef, DatasetRef], tmp_path_factory: pytest.TempPathFactory
) -> CheckpointRef:
    model, dataset = refs
    compiling_before = dynamo_compile_seconds()
    ref = fit(model, dataset, run_settings(), tmp_path_factory.mktemp("compiled") / "run", progress=False)
    COMPILE_SECONDS["compiled_run"] = dynamo_compile_seconds() - compiling_before
    return ref


COMPILE_SECONDS: dict[str, float] = {}  # what torch.compile itself measured while the fixture trained


def dynamo_compile_seconds() -> float:
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def losses(run_dir: str | Path) -> dict[int, float]:
    return {step: m["train/loss"] for step, m in read_metrics(run_dir).items()}


def test_compiled_bf16_agrees_with_eager_and_never_recompiles(
    refs: tuple[ModelRef, DatasetRef], compiled_run: CheckpointRef, tmp_path: Path
) -> None:
    model, dataset = refs
    eager = fit(model, dataset, run_settings(compile=False), tmp_path / "eager", progress=False)
    compiled_losses, eager_losses = losses(compiled_run.run_dir), losses(eager.run_dir)
    assert sorted(compiled_losses) == list(range(1, 11))
    np.testing.assert_allclose(
        [compiled_losses[s] for s in range(1, 11)], [eager_losses[s] for s in range(1, 11)], rtol=2e-2
    )
    assert compiled_losses[10] < compiled_losses[1] - 0.3  # it learns

    logged = read_metrics(compiled_run.run_dir)
    assert all(m["train/recompiles"] == 0 for m in logged.values())
    assert compiled_run.metrics["recompiles"] == 0
    assert compiled_run.metrics["compiles"] >= 1 and eager.metrics["compiles"] == 0  # the counter does count
    assert [s for s, m in logged.items() if "train/compile_time_s" in m] == [1]
    # Compilation is reported apart from the steady state, and holds all that torch.compile spent.
    compile_time = compiled_run.metrics["compile_time_s"]
    assert compile_time >= 0.9 * COMPILE_SECONDS["compiled_run"] > 0
    assert compile_time > 3 * np.median([logged[s]["train/step_time_s"] for s in range(2, 11)])

    # Every step, those across an epoch's end included, is 3 micro-batches of 3 (so no recompile).
    loader = BlockLoader(
        open_blocks(dataset.path), pad_id=PAD, micro_batch_size=3, accumulate_steps=3, seed=1337
    )
    counts = [len(loader.next_step().micro_batches) for _ in range(4)]
    assert counts == [3, 3, 3, 3]

    # MFU is model FLOPs (6 per matmul weight per token, plus attention) over the device's peak. Within 1%:
    # flops_per_token also counts the norms' weights, which are no matmul.
    config = get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ)
    plain = LlamaForPretraining(config)
    matmul_weights = sum(
        p.numel() for n, p in plain.named_parameters() if p.ndim == 2 and "embed_tokens" not in n
    )
    if config.tie_word_embeddings:
        matmul_weights += config.vocab_size * config.hidden_size  # the head's matmul, tied or not
    attention = 12 * config.num_hidden_layers * config.hidden_size * SEQ
    # The peak the run divided by is logged once; a CPU's is a measured matmul peak (a later call may
    # re-measure it when the first measure ran under load, so it is read from the run, not measured again).
    peak = logged[1]["train/peak_flops"]
    assert 1e9 < peak < 1e15
    for metrics in logged.values():
        expected = (6 * matmul_weights + attention) * metrics["train/tokens_per_s"] / peak
        assert metrics["train/mfu"] == pytest.approx(expected, rel=1e-2)
    assert compiled_run.metrics["mfu"] == pytest.approx(
        (6 * matmul_weights + attention) * compiled_run.metrics["tokens_per_s"] / peak, rel=1e-2
    )

    # The checkpoint holds the plain module's names, not the compiled wrapper's (`_orig_mod.`).
    expected_names = set(plain.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert set(load_file(str(Path(compiled_run.path) / "model.safetensors"))) == expected_names


def run_worker(
    settings: TrainSettings, run_dir: Path, refs: tuple[ModelRef, DatasetRef], fault: str = ""
) -> subprocess.Popen:
    spec = write_worker_spec(
        WorkerSpec(
            model_ref=refs[0], dataset_ref=refs[1], settings=settings, run_dir=str(run_dir), progress=False
        )
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    env[ENV_VAR] = fault
    return subprocess.Popen(
        [sys.executable, "-m", "tasks.training.rank", str(spec)],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def test_kill_9_at_any_moment_then_resume_reproduces_every_loss_bit_for_bit(
    refs: tuple[ModelRef, DatasetRef], compiled_run: CheckpointRef, tmp_path: Path
) -> None:
    settings, run_dir = run_settings(), tmp_path / "killed"

    code, output = finish(run_worker(settings, run_dir, refs, "kill_at_step=5"))
    assert code == -signal.SIGKILL, output
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [2, 4]
    assert max(read_metrics(run_dir)) == 5  # step 5 ran but was never checkpointed

    code, output = finish(run_worker(settings, run_dir, refs, "kill_in_checkpoint=8"))
    assert code == -signal.SIGKILL, output
    assert "resuming from checkpoint" in output and "step_000004 at step 4/10" in output
    assert list(run_dir.glob(".step_000008.tmp-*")), "the kill should have left a half-written checkpoint"
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [4, 6]

    code, output = finish(run_worker(settings, run_dir, refs))
    assert code == 0, output
    assert "step_000006 at step 6/10" in output
    assert not list(run_dir.glob(".*.tmp-*"))
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [8, 10]
    assert all(checkpoint_problem(path) is None for _, path in checkpoint_dirs(run_dir))

    assert losses(run_dir) == losses(compiled_run.run_dir)  # exact float equality, every step
    final = torch.load(run_dir / "step_000010" / "trainer_state.pt", weights_only=True)
    assert final["tokens_seen"] == compiled_run.tokens_seen


def test_sigterm_stops_after_a_checkpoint(refs: tuple[ModelRef, DatasetRef], tmp_path: Path) -> None:
    settings, run_dir = run_settings(epochs=400.0, checkpoint_every=1000, compile=False), tmp_path / "term"
    process = run_worker(settings, run_dir, refs)
    metrics_file = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics_file.exists() and metrics_file.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    code, output = finish(process, timeout=60)
    assert code != 0 and "TrainingInterrupted" in output and "SIGTERM" in output, output
    [(step, path)] = checkpoint_dirs(run_dir)
    assert 1 <= step < 2000 and checkpoint_problem(path) is None
    assert max(read_metrics(run_dir)) == step


def test_compile_watch_counts_a_recompile() -> None:
    from tasks.training.control import CompileWatch

    def affine(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    compiled = torch.compile(affine, dynamic=False)
    with CompileWatch().watching() as watch:
        compiled(torch.ones(3))
        first = watch.count
        compiled(torch.ones(3))
        assert watch.count == first == 1  # same shape: no new compile
        compiled(torch.ones(5))
        assert watch.count == 2  # new shape: a recompile
