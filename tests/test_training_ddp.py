"""Data parallel: `nproc_per_node=2` launches torchrun with 2 gloo ranks; the result equals one process
accumulating twice as many micro-batches (same examples per step, same global token normalisation)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from model import get_preset
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.training import TrainingError, TrainingInterrupted, TrainSettings, fit, read_metrics
from tasks.training.checkpoint import checkpoint_dirs, checkpoint_problem
from tasks.training.faults import ENV_VAR

VOCAB = 96
SEQ = 16
PAD = 0


class Recorder:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.metrics: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.steps.append(step)
        self.metrics[step] = dict(metrics)


def test_two_gloo_ranks_with_accumulation_k_equal_one_process_with_2k(tmp_path: Path) -> None:
    blocks = pattern_blocks(29, SEQ, VOCAB, 4)
    rng = np.random.default_rng(4)
    for row in range(0, 29, 3):
        blocks[row, rng.integers(2, SEQ) :] = PAD
    dataset = write_packed_dataset(
        tmp_path / "packed", blocks, pattern_blocks(4, SEQ, VOCAB, 5), vocab_size=VOCAB
    )
    model = model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ))

    def run(name: str, nproc: int, acc: int) -> tuple:
        # 29 blocks, global batch 8: steps of 8, 8, 8, 5 blocks. With 2 ranks the last step gives rank 0 four
        # real rows and rank 1 one real row plus three empty ones.
        settings = TrainSettings(
            micro_batch_size=2,
            accumulate_steps=acc,
            nproc_per_node=nproc,
            epochs=1.0,
            lr=3e-3,
            warmup_steps=1,
            compile=False,
            dtype="fp32",
            device="cpu",
        )
        sink = Recorder()
        return fit(model, dataset, settings, tmp_path / name, sink, progress=False), sink

    ddp, ddp_sink = run("ddp", nproc=2, acc=2)
    single, single_sink = run("single", nproc=1, acc=4)

    assert ddp.step == single.step == 4
    assert ddp.tokens_seen == single.tokens_seen == dataset.train_tokens
    assert [s for s, _ in checkpoint_dirs(Path(ddp.run_dir))] == [4]
    assert ddp_sink.steps == [1, 2, 3, 4]  # forwarded from rank 0's metrics.jsonl
    assert read_metrics(ddp.run_dir).keys() == {1, 2, 3, 4}
    np.testing.assert_allclose(
        [ddp_sink.metrics[s]["train/loss"] for s in range(1, 5)],
        [single_sink.metrics[s]["train/loss"] for s in range(1, 5)],
        rtol=1e-5,
    )
    a = load_file(str(Path(ddp.path) / "model.safetensors"))
    b = load_file(str(Path(single.path) / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
    moved = max(
        float((a[n] - load_file(str(Path(model.path) / "model.safetensors"))[n]).abs().max()) for n in a
    )
    assert moved > 1e-3  # the weights did train


def test_bad_input_fails_before_launch_and_a_failing_rank_raises_training_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = write_packed_dataset(
        tmp_path / "packed",
        pattern_blocks(8, SEQ, VOCAB, 0),
        pattern_blocks(2, SEQ, VOCAB, 1),
        vocab_size=VOCAB,
    )
    model = model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ))
    settings = TrainSettings(micro_batch_size=2, nproc_per_node=2, compile=False)
    missing = dataset.model_copy(update={"path": str(tmp_path / "missing")})
    with pytest.raises(FileNotFoundError, match="meta.json is missing"):
        fit(model, missing, settings, tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()  # refused before torchrun started

    monkeypatch.setenv(ENV_VAR, "nan_at_step=1")  # inherited by both ranks
    with pytest.raises(TrainingError, match="torchrun with 2 workers failed"):
        fit(model, dataset, settings, tmp_path / "r", progress=False)
    assert checkpoint_dirs(tmp_path / "r") == []


def test_a_stop_request_reaches_every_rank_through_torchrun_and_leaves_a_checkpoint(tmp_path: Path) -> None:
    dataset = write_packed_dataset(
        tmp_path / "packed",
        pattern_blocks(16, SEQ, VOCAB, 0),
        pattern_blocks(2, SEQ, VOCAB, 1),
        vocab_size=VOCAB,
    )
    model = model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ))
    settings = TrainSettings(
        micro_batch_size=2,
        nproc_per_node=2,
        max_steps=100_000,
        compile=False,
        dtype="fp32",
        device="cpu",
    )
    sink = Recorder()
    with pytest.raises(TrainingInterrupted, match="stop request"):
        fit(
            model,
            dataset,
            settings,
            tmp_path / "r",
            sink,
            progress=False,
            should_stop=lambda: bool(sink.steps),
        )
    [(step, path)] = checkpoint_dirs(tmp_path / "r")
    assert 1 <= step < 100_000 and checkpoint_problem(path) is None
