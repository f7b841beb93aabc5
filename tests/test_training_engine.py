"""Training engine, in-process and eager: data order, exact accumulation, schedule, health, checkpoints."""

from __future__ import annotations

import math
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from model import LlamaConfig, LlamaForPretraining, get_preset, load_weights
from synthetic import eager_settings, pattern_blocks, write_packed_dataset
from synthetic import model_ref as build_model_ref
from tasks.data.packed import open_blocks
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainingError, TrainSettings, fit, lr_at, read_metrics
from tasks.training.checkpoint import checkpoint_dirs, checkpoint_problem
from tasks.training.faults import ENV_VAR
from tasks.training.loader import IGNORE_INDEX, BlockLoader
from tasks.training.loss import count_targets

VOCAB = 96
SEQ = 16
PAD = 0


def tiny_config() -> LlamaConfig:
    return get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ)


def uneven_blocks(n: int, seed: int) -> np.ndarray:
    """Pattern text where a third of the blocks end in padding of different lengths."""
    blocks = pattern_blocks(n, SEQ, VOCAB, seed)
    rng = np.random.default_rng(seed + 100)
    for row in range(0, n, 3):
        blocks[row, rng.integers(2, SEQ) :] = PAD
    return blocks


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    # 29 blocks, global batch 8: step 4 holds epoch 0's last 5 blocks and epoch 1's first 3.
    directory = tmp_path_factory.mktemp("packed")
    return write_packed_dataset(
        directory, uneven_blocks(29, 0), pattern_blocks(4, SEQ, VOCAB, 1), vocab_size=VOCAB
    )


@pytest.fixture(scope="module")
def model_ref() -> ModelRef:
    return build_model_ref(tiny_config(), seed=0)


settings = partial(eager_settings, epochs=2.0, warmup_steps=2)


def final_weights(ref_path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(ref_path) / "model.safetensors"))


def assert_state_close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float
) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- loader


def rows_seen(blocks: np.ndarray, steps: int, mb: int, acc: int, world: int) -> list[list[int]]:
    """Per step: the first target token of every real row, over all ranks, in rank/micro-batch order."""
    loaders = [
        BlockLoader(
            blocks, pad_id=PAD, micro_batch_size=mb, accumulate_steps=acc, seed=7, rank=r, world_size=world
        )
        for r in range(world)
    ]
    seen = []
    for _ in range(steps):
        step_rows = []
        for loader in loaders:
            for inputs, _targets in loader.next_step().micro_batches:
                assert inputs.shape == (mb, SEQ)
                step_rows += [int(row[0]) for row in inputs if row.ne(PAD).any()]
        seen.append(step_rows)
    return seen


def test_example_order_does_not_depend_on_micro_batch_accumulation_or_ranks() -> None:
    blocks = pattern_blocks(29, SEQ, VOCAB, 3)  # no padding: every row is real
    reference = rows_seen(blocks, 8, mb=8, acc=1, world=1)  # 64 blocks: 2 epochs of 29, 6 of the third
    assert [len(s) for s in reference] == [8] * 8  # a whole global batch, across epoch ends too
    assert reference == rows_seen(blocks, 8, mb=2, acc=4, world=1)
    assert reference == rows_seen(blocks, 8, mb=1, acc=4, world=2)
    assert reference == rows_seen(blocks, 8, mb=4, acc=1, world=2)
    stream, every = sum(reference, []), sorted(int(b[0]) for b in blocks)
    assert sorted(stream[:29]) == every and sorted(stream[29:58]) == every  # every block once per epoch
    assert stream[:29] != stream[29:58]  # a new permutation each epoch


@pytest.mark.parametrize("n_blocks", [29, 5, 3])
def test_a_step_across_an_epoch_end_is_a_whole_batch_and_resumes_at_another_world_size(n_blocks: int) -> None:
    blocks = pattern_blocks(n_blocks, SEQ, VOCAB, 3)
    one = BlockLoader(blocks, pad_id=PAD, micro_batch_size=8, accumulate_steps=1, seed=7)
    while one.position.index + 8 <= n_blocks:  # the full steps of epoch 0 (none when 8 > n_blocks)
        one.next_step()
    state = one.state_dict()
    left = n_blocks - state["index"]  # epoch 0's leftover: 5, 5 and 3 blocks
    [(inputs, targets)] = one.next_step().micro_batches
    assert inputs.shape == (8, SEQ) and not (targets == IGNORE_INDEX).any()  # 8 real blocks, no empty row
    # The leftover, then the next epoch from its start (3 blocks: epochs 0, 1 and 2 in one step).
    assert (one.position.epoch, one.position.index) == divmod(state["index"] + 8, n_blocks)
    epoch1 = np.random.default_rng([7, 1]).permutation(n_blocks)
    assert torch.equal(inputs[left], torch.from_numpy(blocks[epoch1[0], :-1]))
    # The position is global: the same step on 2 ranks x 4 micro-batches of 1, from the 1-rank state.
    ranks = [
        BlockLoader(blocks, pad_id=PAD, micro_batch_size=1, accumulate_steps=4, seed=7, rank=r, world_size=2)
        for r in (0, 1)
    ]
    for loader in ranks:
        loader.load_state_dict(state)
    split = torch.cat([x for loader in ranks for x, _ in loader.next_step().micro_batches])
    assert torch.equal(split, inputs)


def test_loader_masks_padding_and_resumes_from_its_state() -> None:
    blocks = uneven_blocks(29, 5)
    loader = BlockLoader(blocks, pad_id=PAD, micro_batch_size=2, accumulate_steps=4, seed=1)
    for _ in range(3):
        loader.next_step()
    state = loader.state_dict()
    after = [loader.next_step() for _ in range(3)]
    again = BlockLoader(blocks, pad_id=PAD, micro_batch_size=2, accumulate_steps=4, seed=1)
    again.load_state_dict(state)
    for a, b in zip(after, (again.next_step() for _ in range(3)), strict=True):
        for (xa, ya), (xb, yb) in zip(a.micro_batches, b.micro_batches, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # Step 4 holds epoch 0's last 5 blocks and epoch 1's first 3: 4 micro-batches like every step.
    assert all(len(step.micro_batches) == 4 for step in after)
    assert loader.position.epoch == 1 and loader.position.index == 3 + 2 * 8
    all_targets = torch.cat([t for step in after for _, t in step.micro_batches])
    assert not (all_targets == PAD).any()
    # An epoch's targets are exactly the real (non-pad) tokens of every block.
    loader = BlockLoader(blocks, pad_id=PAD, micro_batch_size=1, accumulate_steps=1, seed=1)
    epoch = [loader.next_step() for _ in range(len(blocks))]
    assert loader.position.epoch == 1 and loader.position.index == 0
    assert count_targets([t for step in epoch for _, t in step.micro_batches]) == int(
        (blocks[:, 1:] != PAD).sum()
    )
    assert all(not (x == IGNORE_INDEX).any() for step in epoch for x, _ in step.micro_batches)
    with pytest.raises(ValueError, match="same dataset and seed"):
        BlockLoader(blocks, pad_id=PAD, micro_batch_size=2, accumulate_steps=4, seed=2).load_state_dict(state)


# ---------------------------------------------------------------- exact accumulation


def test_training_with_accumulation_matches_one_big_micro_batch(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    # 2 epochs of 29 blocks with a global batch of 8: steps of 8, 8, 8 and 5 blocks, uneven padding.
    blocks = open_blocks(dataset.path, "train")
    first = BlockLoader(blocks, pad_id=PAD, micro_batch_size=2, accumulate_steps=4, seed=1337).next_step()
    counts = [count_targets([t]) for _, t in first.micro_batches]
    assert len(set(counts)) > 1, "micro-batches must hold different token counts for this test to bite"
    split = fit(
        model_ref,
        dataset,
        settings(micro_batch_size=2, accumulate_steps=4),
        tmp_path / "k_by_b",
        progress=False,
    )
    whole = fit(
        model_ref, dataset, settings(micro_batch_size=8, accumulate_steps=1), tmp_path / "kb", progress=False
    )
    assert split.step == whole.step == 8
    # 64 blocks: 2 epochs and the first 6 blocks of a third.
    assert 2 * dataset.train_tokens < split.tokens_seen == whole.tokens_seen < 3 * dataset.train_tokens
    # The step's gradient is the same however it is split: its norm, step by step, then the losses.
    norms_split = [m["train/grad_norm"] for _, m in sorted(read_metrics(split.run_dir).items())]
    norms_whole = [m["train/grad_norm"] for _, m in sorted(read_metrics(whole.run_dir).items())]
    np.testing.assert_allclose(norms_split, norms_whole, rtol=1e-4)
    losses_split = [m["train/loss"] for _, m in sorted(read_metrics(split.run_dir).items())]
    losses_whole = [m["train/loss"] for _, m in sorted(read_metrics(whole.run_dir).items())]
    np.testing.assert_allclose(losses_split, losses_whole, rtol=1e-5)
    assert_state_close(final_weights(split.path), final_weights(whole.path), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- schedule


def closed_form_cosine(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / (total - warmup - 1)
    return lr * min_ratio + (lr - lr * min_ratio) * (1 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize(("mb", "acc", "expected_steps"), [(1, 1, 58), (2, 2, 15), (2, 4, 8), (4, 4, 4)])
def test_logged_lr_follows_the_closed_form_in_optimizer_steps(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef, mb: int, acc: int, expected_steps: int
) -> None:
    run = settings(micro_batch_size=mb, accumulate_steps=acc, warmup_steps=2, min_lr_ratio=0.1)
    used: list[list[float]] = []  # every param group's LR when optimizer.step() runs

    def record_lr(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        used.append([float(group["lr"]) for group in optimizer.param_groups])

    handle = register_optimizer_step_pre_hook(record_lr)
    try:
        ref = fit(model_ref, dataset, run, tmp_path / "run", progress=False)
    finally:
        handle.remove()
    assert len(used) == expected_steps
    for step, group_lrs in enumerate(used):
        expected = closed_form_cosine(step, 3e-3, 2, expected_steps, 0.1)
        assert group_lrs == pytest.approx([expected] * len(group_lrs), rel=1e-12), step + 1
    logged = read_metrics(ref.run_dir)
    assert sorted(logged) == list(range(1, expected_steps + 1))  # ceil(2 epochs * 29 blocks / (mb*acc))
    for step, metrics in logged.items():
        assert metrics["train/lr"] == pytest.approx(
            closed_form_cosine(step - 1, 3e-3, 2, expected_steps, 0.1), rel=1e-12
        )
    assert logged[expected_steps]["train/lr"] == pytest.approx(3e-4)


def test_wsd_schedule_and_max_steps() -> None:
    lrs = [
        lr_at(s, lr=1.0, total_steps=20, warmup_steps=5, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
        for s in range(20)
    ]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lrs[5:17] == [1.0] * 12  # stable
    assert lrs[17:] == pytest.approx([2 / 3, 1 / 3, 0.0])  # 3 decay steps (20% of 15) down to min_lr


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
@pytest.mark.parametrize("total", range(1, 7))
def test_the_last_step_reaches_the_end_value_whatever_the_warmup(schedule: str, total: int) -> None:
    for warmup in range(total):  # up to total - 1: one step after the warmup
        last = lr_at(
            total - 1, lr=2.0, total_steps=total, warmup_steps=warmup, min_lr_ratio=0.1, schedule=schedule
        )
        assert last == pytest.approx(0.2), (total, warmup)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_a_short_run_from_a_preset_decays_to_the_end_value_in_every_param_group(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef, schedule: str, optimizer: str
) -> None:
    from flows.pretrain_config import ConfigNote, PretrainConfig

    with pytest.warns(ConfigNote, match="warmup_steps=5 of preset 'tiny' clamped to 2"):
        config = PretrainConfig(
            preset="tiny", max_steps=3, schedule=schedule, optimizer=optimizer, min_lr_ratio=0.1,
            lr=3e-3, embed_lr=2e-2, scalar_lr=4e-3, muon_lr=0.05,
            micro_batch_size=2, accumulate_steps=4, compile=False, dtype="fp32",
        )  # fmt: skip
    used: list[tuple[str, list[float]]] = []  # (optimizer, each param group's LR) when step() runs

    def record_lr(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        used.append((type(opt).__name__, sorted(float(group["lr"]) for group in opt.param_groups)))

    handle = register_optimizer_step_pre_hook(record_lr)
    try:
        ref = fit(model_ref, dataset, config.train_settings(), tmp_path / "run", progress=False)
    finally:
        handle.remove()
    peaks = {"AdamW": [2e-2, 4e-3] + ([3e-3] if optimizer == "adamw" else [])}  # embed, scalar, hidden
    if optimizer == "muon":
        peaks["Muon"] = [0.05]
    factors = [0.5, 1.0, 0.1]  # warmup 1/2, 2/2, then the only post-warmup step: the end value
    expected = [(name, sorted(p * f for p in group)) for f in factors for name, group in peaks.items()]
    assert [name for name, _ in used] == [name for name, _ in expected]
    for (name, got), (_, want) in zip(used, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12), (name, used)
    logged = read_metrics(ref.run_dir)
    assert [logged[s]["train/lr"] for s in (1, 2, 3)] == pytest.approx([1.5e-3, 3e-3, 3e-4], rel=1e-12)


# ---------------------------------------------------------------- health, checkpoints, input checks


def test_nan_stops_with_the_step_named_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, "nan_at_step=3")
    run, run_dir = settings(checkpoint_every=2), tmp_path / "run"
    with pytest.raises(TrainingError, match=r"at step 3\b.*last good checkpoint: .*step_000002"):
        fit(model_ref, dataset, run, run_dir, progress=False)
    kept = checkpoint_dirs(run_dir)
    assert [step for step, _ in kept] == [2]
    assert checkpoint_problem(kept[0][1]) is None
    assert sorted(read_metrics(run_dir)) == [1, 2]  # nothing logged for the failed step


def test_truncated_checkpoint_is_skipped_and_resume_reproduces_the_run(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    run, run_dir = settings(checkpoint_every=2, keep_checkpoints=3), tmp_path / "run"
    first = fit(model_ref, dataset, run, run_dir, progress=False)
    losses = {s: m["train/loss"] for s, m in read_metrics(run_dir).items()}
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [4, 6, 8]

    finished = fit(model_ref, dataset, run, run_dir, progress=False)  # already done: returns without training
    assert finished == first

    weights = Path(first.path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.warns(
        RuntimeWarning, match=r"skipping checkpoint .*step_000008: model.safetensors does not match"
    ):
        resumed = fit(model_ref, dataset, run, run_dir, progress=False)
    assert resumed.step == 8
    again = {s: m["train/loss"] for s, m in read_metrics(run_dir).items()}
    assert again == losses  # steps 7 and 8 retrained from step 6: bit-identical losses
    assert_state_close(final_weights(resumed.path), final_weights(first.path), rtol=0, atol=0)


def test_bad_inputs_fail_before_training(tmp_path: Path, dataset: DatasetRef) -> None:
    small_vocab = build_model_ref(get_preset("tiny", vocab_size=32, max_position_embeddings=SEQ))
    with pytest.raises(TrainingError, match="vocab_size 96 exceeds the model's vocab_size 32"):
        fit(small_vocab, dataset, settings(), tmp_path / "run", progress=False)
    short = build_model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=8))
    with pytest.raises(TrainingError, match="max_position_embeddings"):
        fit(short, dataset, settings(), tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainSettings(micro_batch_size=0)
    assert not (tmp_path / "run").exists()


def test_weights_load_into_a_fresh_model(tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef) -> None:
    ref = fit(model_ref, dataset, settings(max_steps=3), tmp_path / "run", progress=False)
    model = LlamaForPretraining(tiny_config())
    load_weights(model, Path(ref.path) / "model.safetensors")
    assert ref.step == 3 and ref.metrics["train_loss"] > 0
    assert {"tokens_per_s", "compile_time_s", "mfu", "recompiles"} <= ref.metrics.keys()
    shutil.rmtree(ref.run_dir)


def test_time_limit_and_stop_request_end_after_a_checkpoint_and_the_run_resumes(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    from tasks.training import TrainingInterrupted

    run, run_dir = settings(max_time_s=1e-6, log_every=3), tmp_path / "run"
    stopped = fit(model_ref, dataset, run, run_dir, progress=False)
    assert stopped.step == 1 and stopped.metrics["stopped_early"] == 1.0
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [1]

    calls = []
    with pytest.raises(TrainingInterrupted, match=r"after step 3; checkpoint .*step_000003"):
        fit(
            model_ref,
            dataset,
            run.model_copy(update={"max_time_s": None}),
            run_dir,
            progress=False,
            should_stop=lambda: calls.append(1) or len(calls) >= 2,
        )
    done = fit(model_ref, dataset, run.model_copy(update={"max_time_s": None}), run_dir, progress=False)
    assert done.step == 8 and done.metrics["stopped_early"] == 0.0
    # log_every=3 logs the first step of each process, every third step and the last.
    assert sorted(read_metrics(run_dir)) == [1, 2, 3, 4, 6, 8]


def test_metrics_line_cut_by_a_kill_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    from tasks.training.metrics import JsonlMetrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "metrics": {"train/loss": 1.5}}\n{"step": 2, "metr')
    JsonlMetrics(tmp_path).log_metrics({"train/loss": 1.25}, 2)
    assert read_metrics(tmp_path) == {1: {"train/loss": 1.5}, 2: {"train/loss": 1.25}}


def test_run_length_from_epochs_and_max_steps() -> None:
    from tasks.training import total_optimizer_steps

    assert total_optimizer_steps(29, 2, 4, 1, epochs=1.0) == 4  # 8 + 8 + 8 + 5 blocks
    assert total_optimizer_steps(29, 2, 4, 1, epochs=1.5) == 6
    assert total_optimizer_steps(29, 2, 4, 1, epochs=2.0, max_steps=5) == 5  # max_steps alone, when set
    assert total_optimizer_steps(29, 2, 4, 1, epochs=1.0, max_steps=50) == 50
    assert total_optimizer_steps(29, 1, 4, 2, epochs=1.0) == 4  # 2 ranks x 4 x 1 = the same global batch
    # Whole steps only, the leftover carried: 2 epochs of 25 blocks are 50 / 8 = 6.25 steps, so 7 (not 2 x 4).
    assert total_optimizer_steps(25, 2, 4, 1, epochs=2.0) == 7


def test_injected_crash_happens_once_and_the_retry_resumes(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, "crash_at_step=3")
    run, run_dir = settings(checkpoint_every=2), tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected crash before step 3"):
        fit(model_ref, dataset, run, run_dir, progress=False)
    retried = fit(model_ref, dataset, run, run_dir, progress=False)  # what a Prefect retry does
    assert retried.step == 8 and retried.metrics["steps_this_run"] == 6
    monkeypatch.setenv(ENV_VAR, "explode_at_step=1")
    with pytest.raises(ValueError, match="expected comma-separated NAME=STEP"):
        fit(model_ref, dataset, settings(), tmp_path / "other", progress=False)


# ---------------------------------------------------------------- clipping, determinism, run length


def first_moment_norm(checkpoint: str, beta1: float) -> float:
    """Global norm of the gradient the optimizer applied at step 1: AdamW's exp_avg is then (1 - beta1) * g."""
    shards = (Path(checkpoint) / "optimizer").glob("*.safetensors")
    state = {name: tensor for shard in shards for name, tensor in load_file(str(shard)).items()}
    squares = sum(float(t.double().pow(2).sum()) for name, t in state.items() if name.endswith(".exp_avg"))
    return math.sqrt(squares) / (1 - beta1)


def test_the_optimizer_applies_the_clipped_gradient(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    free = fit(model_ref, dataset, settings(max_steps=1, grad_clip=0), tmp_path / "free", progress=False)
    norm = read_metrics(free.run_dir)[1]["train/grad_norm"]
    assert first_moment_norm(free.path, 0.9) == pytest.approx(norm, rel=1e-4)
    clip = norm / 10
    clipped = fit(model_ref, dataset, settings(max_steps=1, grad_clip=clip), tmp_path / "c", progress=False)
    assert read_metrics(clipped.run_dir)[1]["train/grad_norm"] == pytest.approx(norm, rel=1e-6)  # before
    assert first_moment_norm(clipped.path, 0.9) == pytest.approx(clip, rel=1e-4)  # what the step used


def test_deterministic_algorithms_are_on_while_training_and_restored_after(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Observer:
        seen: list[bool] = []

        def log_metrics(self, metrics: object, step: int) -> None:
            self.seen.append(torch.are_deterministic_algorithms_enabled())

    before = torch.are_deterministic_algorithms_enabled()  # the test session turns them on (conftest)
    torch.use_deterministic_algorithms(False)
    try:
        observer = Observer()
        fit(model_ref, dataset, settings(max_steps=2), tmp_path / "run", observer, progress=False)
        assert observer.seen == [True, True]
        assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is back
        monkeypatch.setenv(ENV_VAR, "nan_at_step=1")
        with pytest.raises(TrainingError, match="non-finite"):  # also when training fails
            fit(model_ref, dataset, settings(max_steps=2), tmp_path / "bad", progress=False)
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_checkpoint_says_what_set_the_run_length(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    by_steps = fit(model_ref, dataset, settings(max_steps=3), tmp_path / "steps", progress=False)
    assert by_steps.run_length.startswith("3 optimizer steps, set by max_steps=3"), by_steps.run_length
    by_epochs = fit(model_ref, dataset, settings(epochs=1.0), tmp_path / "epochs", progress=False)
    assert by_epochs.run_length.startswith("4 optimizer steps, set by epochs=1"), by_epochs.run_length
    assert "29 blocks" in by_epochs.run_length and "8 blocks per step" in by_epochs.run_length
    assert "3.625 steps per epoch" in by_epochs.run_length
    # A resumed run that is already finished says the same.
    assert fit(model_ref, dataset, settings(epochs=1.0), tmp_path / "epochs", progress=False) == by_epochs


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_trains_in_bf16_only_where_the_hardware_has_it(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """`auto` becomes a concrete precision at the start of the run: what the checkpoint records and what
    trains (bf16 autocast changes the losses); an explicit bf16 without hardware support warns."""
    import json

    from tasks.training import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device_type: native)
    auto = fit(model_ref, dataset, settings(dtype="auto", max_steps=2), tmp_path / "auto", progress=False)
    saved = json.loads((Path(auto.path) / "train_settings.json").read_text())
    assert saved["dtype"] == ("bf16" if native else "fp32")
    explicit = "bf16" if native else "fp32"
    same = fit(model_ref, dataset, settings(dtype=explicit, max_steps=2), tmp_path / "same", progress=False)
    assert read_metrics(auto.run_dir)[2]["train/loss"] == read_metrics(same.run_dir)[2]["train/loss"]
    if not native:
        with pytest.warns(RuntimeWarning, match="emulated"):
            precision.resolve_dtype(torch.device("cpu"), "bf16")
