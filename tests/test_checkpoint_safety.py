"""Checkpoints that never lose a run: a run directory whose checkpoints are all invalid stops the run instead
of training from step 0 over them; the manifest's work list is one rank's, so ranks whose directory
listings differ (NFS clients) still write a manifest that validates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def manifest_on_ranks(directory: Path, out: Path) -> None:
    """The ranks' side (under torchrun): each writes its files, rank 1 lists the directory without one of
    rank 0's files (as an NFS client whose cached listing lags), then both write the manifest together."""
    import torch.distributed as dist

    from tasks.training import checkpoint
    from tasks.training.checkpoint import REQUIRED_FILES, checkpoint_problem, rng_file, write_manifest
    from tasks.training.distributed import context_from_env, leave_process_group

    dist.init_process_group("gloo")
    context = context_from_env()
    (directory / "optimizer").mkdir(parents=True, exist_ok=True)
    (directory / rng_file(context.rank)).write_bytes(os.urandom(64))
    (directory / "optimizer" / f"__{context.rank}_0.distcp").write_bytes(os.urandom(64))
    if context.is_main:
        for name in (*REQUIRED_FILES, "model.safetensors"):
            (directory / name).write_bytes(os.urandom(64))
    dist.barrier()
    if context.rank == 1:
        listed = checkpoint.checkpoint_files
        checkpoint.checkpoint_files = lambda root: [n for n in listed(root) if n != "config.json"]
    write_manifest(directory, 1, context)
    if context.is_main:
        out.write_text(json.dumps({"problem": checkpoint_problem(directory)}))
    leave_process_group()


def test_ranks_that_list_the_checkpoint_differently_still_write_a_manifest_that_validates(
    tmp_path: Path,
) -> None:
    out = tmp_path / "result.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), str(Path(__file__).parent)]),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    subprocess.run([*command, str(tmp_path / "step_000001"), str(out)], env=env, check=True, timeout=300)
    assert json.loads(out.read_text()) == {"problem": None}


if __name__ == "__main__":
    manifest_on_ranks(Path(sys.argv[1]), Path(sys.argv[2]))
