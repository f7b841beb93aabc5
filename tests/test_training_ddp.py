"""Data parallel: `nproc_per_node=2` launches torchrun with 2 gloo ranks; the result equals one process
accumulating twice as many micro-batches (same examples per step, same global token normalisation)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from model import LlamaConfig, LlamaForPretraining, get_preset
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.refs import DatasetRef
from tasks.training import TrainingError, TrainingInterrupted, TrainSettings, fit, read_metrics
from tasks.training.checkpoint import checkpoint_dirs, checkpoint_problem, sha256_file
from tasks.training.engine import run_process
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


def padded_dataset(directory: Path) -> DatasetRef:
    blocks = pattern_blocks(29, SEQ, VOCAB, 4)
    rng = np.random.default_rng(4)
    for row in range(0, 29, 3):
        blocks[row, rng.integers(2, SEQ) :] = PAD
    return write_packed_dataset(directory, blocks, pattern_blocks(4, SEQ, VOCAB, 5), vocab_size=VOCAB)


def split_settings(nproc: int, acc: int) -> TrainSettings:
    # 29 blocks, global batch 8: 4 steps of 8 blocks, the 4th across the epoch's end (its last 5 blocks,
    # then 3 of the next epoch), uneven padding.
    return TrainSettings(
        micro_batch_size=2,
        accumulate_steps=acc,
        nproc_per_node=nproc,
        epochs=1.0,
        lr=3e-3,
        warmup_steps=1,
        checkpoint_every=2,
        compile=False,
        dtype="fp32",
        device="cpu",
    )


def assert_plain_weight_names(checkpoint: str | Path, config: LlamaConfig) -> None:
    """Checkpoints hold the plain module's names: no `module.` (DDP) or `_orig_mod.` (compile) prefix."""
    expected = set(LlamaForPretraining(config).state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(load_file(str(Path(checkpoint) / "model.safetensors"))) == expected


def rng_of(checkpoint: Path, rank: int) -> dict:
    return torch.load(checkpoint / f"rng_rank_{rank}.pt", weights_only=True)


def mark_rng_state(checkpoint: Path, rank: int, seed: int) -> torch.Tensor:
    """Put a torch generator state no rank would reach by itself into rank `rank`'s RNG file of
    `checkpoint` (its checksum updated), and return it."""
    state = rng_of(checkpoint, rank)
    state["torch"] = torch.Generator().manual_seed(seed).get_state()
    torch.save(state, checkpoint / f"rng_rank_{rank}.pt")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["sha256"][f"rng_rank_{rank}.pt"] = sha256_file(checkpoint / f"rng_rank_{rank}.pt")
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return state["torch"]


def test_two_gloo_ranks_with_accumulation_k_equal_one_process_with_2k(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = padded_dataset(tmp_path / "packed")
    config = get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ)
    model = model_ref(config)

    single_sink = Recorder()
    single = fit(model, dataset, split_settings(1, 4), tmp_path / "single", single_sink, progress=False)

    # Both ranks crash before step 3; the retry resumes each rank from the step-2 checkpoint.
    monkeypatch.setenv(ENV_VAR, "crash_at_step=3")
    ddp_sink = Recorder()
    with pytest.raises(TrainingError, match="torchrun with 2 workers failed"):
        fit(model, dataset, split_settings(2, 2), tmp_path / "ddp", ddp_sink, progress=False)
    step2 = tmp_path / "ddp" / "step_000002"
    assert not torch.equal(rng_of(step2, 0)["torch"], rng_of(step2, 1)["torch"])  # seeded per rank
    markers = [mark_rng_state(step2, rank, seed=100 + rank) for rank in (0, 1)]
    ddp = fit(model, dataset, split_settings(2, 2), tmp_path / "ddp", ddp_sink, progress=False)
    monkeypatch.delenv(ENV_VAR)

    assert ddp.step == single.step == 4
    # 4 whole steps of 8 blocks: the epoch's 29 and 3 of the next (the leftover opens the 4th step).
    assert ddp.tokens_seen == single.tokens_seen > dataset.train_tokens
    assert [s for s, _ in checkpoint_dirs(Path(ddp.run_dir))] == [2, 4]
    assert ddp_sink.steps == [1, 2, 3, 4]  # forwarded from rank 0's metrics.jsonl
    assert read_metrics(ddp.run_dir).keys() == {1, 2, 3, 4}
    # AdamW hides a gradient off by a factor (the world size); the gradient norm of every step does not.
    for name, rtol in (("train/grad_norm", 1e-4), ("train/loss", 1e-5)):
        np.testing.assert_allclose(
            [ddp_sink.metrics[s][name] for s in range(1, 5)],
            [single_sink.metrics[s][name] for s in range(1, 5)],
            rtol=rtol,
            err_msg=name,
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
    assert_plain_weight_names(ddp.path, config)

    # One RNG file per rank, each in the manifest, and each rank restored its own on the retry: the retry
    # resumed from step 2, whose RNG files were replaced by markers above (nothing draws between steps,
    # so the step-4 files hold exactly what each rank restored; fresh generators would not match).
    step4 = Path(ddp.path)
    assert {"rng_rank_0.pt", "rng_rank_1.pt"} <= json.loads((step4 / "manifest.json").read_text())[
        "sha256"
    ].keys()
    for rank in (0, 1):
        assert torch.equal(rng_of(step4, rank)["torch"], markers[rank]), rank

    # The same run resumed by one process accumulating 4: the same global batch, so it may continue.
    resumed_dir = tmp_path / "one_process"
    shutil.copytree(ddp.run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "step_000004")
    resumed = fit(model, dataset, split_settings(1, 4), resumed_dir, progress=False)
    assert resumed.step == 4
    for name in a:
        torch.testing.assert_close(
            load_file(str(Path(resumed.path) / "model.safetensors"))[name], b[name], rtol=1e-4, atol=1e-5
        )

    # Launched without torchrun, the 2-rank settings would make a global batch of 4: refused, named.
    with pytest.raises(TrainingError, match=r"global batch .*checkpoint 2 x 2 x 2 = 8, now 2 x 2 x 1 = 4"):
        run_process(model, dataset, split_settings(2, 2), ddp.run_dir, progress=False)


def test_gradients_are_all_reduced_once_per_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """no_sync on every micro-batch but the last: one all-reduce per gradient bucket and optimizer step
    (a one-process gloo group: the engine wraps DDP whenever it runs in a process group, as under
    torchrun)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from tasks.training import parallelize

    dataset = padded_dataset(tmp_path / "packed")
    model = model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ))
    events: list[int | str] = []  # bucket indices all-reduced, and "step" at each optimizer.step()

    class CountingDDP(parallelize.DistributedDataParallel):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)

            # No annotations: DDP checks them, and this module's are strings (postponed evaluation).
            def counting_allreduce(state, bucket):
                events.append(bucket.index())
                return allreduce_hook(None, bucket)

            self.register_comm_hook(None, counting_allreduce)

    def step_marker(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        events.append("step")

    monkeypatch.setattr(parallelize, "DistributedDataParallel", CountingDDP)
    handle = register_optimizer_step_pre_hook(step_marker)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # Global batch 8 over 29 blocks: 4 steps of 4 micro-batches.
        run = split_settings(1, 4).model_copy(update={"checkpoint_every": 0})
        run_process(model, dataset, run, tmp_path / "run", progress=False)
    finally:
        dist.destroy_process_group()
        handle.remove()
    steps, current = [], []
    for event in events:
        if event == "step":
            steps.append(current)
            current = []
        else:
            current.append(event)
    assert len(steps) == 4 and not current
    for step, reduced in enumerate(steps, 1):
        assert reduced and len(reduced) == len(set(reduced)), f"step {step} all-reduced buckets {reduced}"


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
