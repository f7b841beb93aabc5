"""Checkpoints that never lose a run: a run directory whose checkpoints are all invalid stops the run instead
of training from step 0 over them; the manifest's work list is one rank's, so ranks whose directory
listings differ (NFS clients) still write a manifest that validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from model import get_preset
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.training import TrainingInputError, TrainSettings, fit
from tasks.training.checkpoint import MODEL_FILE, checkpoint_dirs

VOCAB, SEQ = 96, 16


def test_checkpoints_that_are_all_invalid_stop_the_run_instead_of_being_overwritten(tmp_path: Path) -> None:
    dataset = write_packed_dataset(
        tmp_path / "packed",
        pattern_blocks(32, SEQ, VOCAB, 0),
        pattern_blocks(4, SEQ, VOCAB, 1),
        vocab_size=VOCAB,
    )
    model = model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ))
    settings = TrainSettings(
        micro_batch_size=2, max_steps=4, checkpoint_every=2, compile=False, device="cpu", dtype="fp32"
    )
    run_dir = tmp_path / "run"
    fit(model, dataset, settings, run_dir, progress=False)
    damaged = {}
    for _, path in checkpoint_dirs(run_dir):  # one byte flipped in each checkpoint's weights
        weights = path / MODEL_FILE
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        damaged[weights] = bytes(data)
    assert len(damaged) == 2

    with pytest.raises(TrainingInputError) as refused:
        fit(model, dataset, settings, run_dir, progress=False)
    message = str(refused.value)
    assert f"{run_dir} holds 2 checkpoint(s) and none is valid" in message
    assert "step_000004: model.safetensors does not match its sha256" in message
    assert f"mv {run_dir}/step_* {run_dir}/invalid/" in message and "another checkpoint_dir" in message
    assert all(weights.read_bytes() == data for weights, data in damaged.items())  # nothing overwritten

    # Moved away as the message says, the run starts over.
    (run_dir / "invalid").mkdir()
    for _, path in checkpoint_dirs(run_dir):
        path.rename(run_dir / "invalid" / path.name)
    assert fit(model, dataset, settings, run_dir, progress=False).step == 4
