"""Resuming a run: what may change and what is refused, which checkpoints pruning keeps, and the RNG
state of each rank. In-process and eager: the tiny model on 29 synthetic blocks, 8 optimizer steps."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from model import get_preset
from synthetic import eager_settings, pattern_blocks, write_packed_dataset
from synthetic import model_ref as build_model_ref
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainingError, TrainingInterrupted, TrainSettings, fit, precision, read_metrics
from tasks.training import checkpoint as ckpt
from tasks.training.checkpoint import checkpoint_dirs, checkpoint_problem, sha256_file
from tasks.training.resume import precision_differences, settings_differences
from tasks.training.settings import OnResume, resume_rules

VOCAB = 96
SEQ = 16
PAD = 0


def blocks_with_padding(seed: int) -> np.ndarray:
    blocks = pattern_blocks(29, SEQ, VOCAB, seed)
    rng = np.random.default_rng(seed + 100)
    for row in range(0, 29, 3):
        blocks[row, rng.integers(2, SEQ) :] = PAD
    return blocks


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_packed_dataset(
        tmp_path_factory.mktemp("packed"),
        blocks_with_padding(0),
        pattern_blocks(4, SEQ, VOCAB, 1),
        vocab_size=VOCAB,
    )


@pytest.fixture(scope="module")
def model_ref() -> ModelRef:
    return build_model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ), seed=0)


# 2 epochs of 29 blocks, global batch 8: 8 optimizer steps of 8 blocks, the 4th and 8th across an epoch's end.
settings = partial(eager_settings, epochs=2.0, warmup_steps=2, checkpoint_every=2)


def stop_after(steps: int):
    calls: list[int] = []
    return lambda: calls.append(1) or len(calls) >= steps


def losses(run_dir: str | Path) -> dict[int, float]:
    return {step: m["train/loss"] for step, m in read_metrics(run_dir).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, dataset: DatasetRef, model_ref: ModelRef) -> Path:
    """The uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    fit(model_ref, dataset, settings(), run_dir, progress=False)
    return run_dir


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory, dataset: DatasetRef, model_ref: ModelRef) -> Path:
    """The same run stopped after its step-4 checkpoint; each test resumes a copy."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.raises(TrainingInterrupted, match="after step 4"):
        fit(model_ref, dataset, settings(), run_dir, progress=False, should_stop=stop_after(4))
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


# ---------------------------------------------------------------- what a resume may change (issue 12, item 10)


# What each training setting does to a resume, written here apart from settings.py's annotations, so a
# setting dropped from the compared ones (or a new one classified wrongly) fails below.
# Settings that change what the run computes, each with a value other than settings()'s:
CHANGES_THE_RUN: dict[str, object] = {
    "seed": 1,
    "optimizer": "muon",
    "lr": 1e-3,
    "embed_lr": 1e-2,
    "head_lr": 1e-2,
    "scalar_lr": 1e-2,
    "muon_lr": 0.02,
    "muon_momentum": 0.9,
    "muon_ns_steps": 4,
    "muon_weight_decay": 0.05,
    "muon_adjust_lr": "match_rms_adamw",
    "min_lr_ratio": 0.0,
    "warmup_steps": 1,
    "schedule": "wsd",
    "decay_fraction": 0.5,
    "weight_decay": 0.05,
    "betas": (0.8, 0.9),
    "eps": 1e-6,
    "grad_clip": 0.5,
    "document_mask": True,
}
# Settings that decide the global batch or the run length, which a resume compares instead (below):
SHAPES_THE_RUN = {"micro_batch_size", "accumulate_steps", "max_steps", "epochs", "nproc_per_node", "nnodes"}
# Settings a resume may change (how the run is carried out), each with a value other than settings()'s:
CARRIES_OUT_THE_RUN: dict[str, object] = {
    "compile": True,
    "dtype": "bf16",
    "device": "cpu",
    "checkpoint_every": 3,
    "keep_checkpoints": 5,
    "log_every": 2,
    "max_time_s": 3600.0,
    "time_budget": 3600.0,  # a resume keeps the run length its checkpoint has: a budget never re-plans it
    "data_parallel": "fsdp",
    "hsdp_shard_size": 2,
    "activation_checkpointing": "full",
    "fsdp_gradient_sync": "last_micro_batch",
    "max_restarts": 2,
    "rdzv_endpoint": "127.0.0.1:29400",
    "rdzv_id": "another-job",
    "node_rank": 1,
    "rdzv_timeout_s": 60,
    "process_group_timeout_min": 5.0,
    "stop_grace_s": 30,
    "eval_every": 2,
    "eval_bytes": 4096,
}


def test_every_training_setting_is_classified_for_resume_here_and_in_settings() -> None:
    here = [*CHANGES_THE_RUN, *SHAPES_THE_RUN, *CARRIES_OUT_THE_RUN]
    assert len(here) == len(set(here))
    assert set(here) == set(TrainSettings.model_fields), (
        "a TrainSettings field was added or removed: say here whether it changes the run"
    )
    rules = resume_rules(TrainSettings)  # raises for a field that declares no rule
    assert {n for n, r in rules.items() if r is OnResume.MUST_MATCH} == set(CHANGES_THE_RUN)
    assert {n for n, r in rules.items() if r is OnResume.IN_RUN_SHAPE} == SHAPES_THE_RUN

    class Unclassified(TrainSettings):
        eval_every: int = 0

    with pytest.raises(TypeError, match=r"\['eval_every'\] must each declare how they bear on a resume"):
        resume_rules(Unclassified)


@pytest.mark.parametrize(("name", "value"), CHANGES_THE_RUN.items(), ids=list(CHANGES_THE_RUN))
def test_a_resume_that_changes_any_setting_of_the_run_is_refused_naming_it(
    tmp_path: Path, stopped: Path, dataset: DatasetRef, model_ref: ModelRef, name: str, value: object
) -> None:
    run_dir = copy_of(stopped, tmp_path)
    before = settings().model_dump(mode="json")[name]
    now = settings(**{name: value}).model_dump(mode="json")[name]
    with pytest.raises(TrainingError, match=r"cannot resume .*step_000004") as info:
        fit(model_ref, dataset, settings(**{name: value}), run_dir, progress=False)
    assert f"{name}: checkpoint {before!r}, now {now!r}" in str(info.value)
    assert max(read_metrics(run_dir)) == 4  # refused before any step


@pytest.mark.parametrize(("name", "value"), CARRIES_OUT_THE_RUN.items(), ids=list(CARRIES_OUT_THE_RUN))
def test_a_resume_may_change_how_the_run_is_carried_out(stopped: Path, name: str, value: object) -> None:
    saved = json.loads((stopped / "step_000004" / "train_settings.json").read_text())
    assert settings_differences(saved, settings(**{name: value})) == []


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"max_steps": 6}, "total_steps: checkpoint 8, now 6"),
        ({"epochs": 3.0}, "total_steps: checkpoint 8, now 11"),  # ceil(3 x 29 / 8)
        (
            {"micro_batch_size": 4},
            "global batch (micro_batch_size x accumulate_steps x ranks): checkpoint 2 x 4 x 1",
        ),
    ],
)
def test_a_resume_that_changes_the_batch_or_the_run_length_is_refused(
    tmp_path: Path, stopped: Path, dataset: DatasetRef, model_ref: ModelRef, changed: dict, named: str
) -> None:
    run_dir = copy_of(stopped, tmp_path)
    with pytest.raises(TrainingError, match=r"cannot resume .*step_000004") as info:
        fit(model_ref, dataset, settings(**changed), run_dir, progress=False)
    assert named in str(info.value)
    assert max(read_metrics(run_dir)) == 4


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"qk_norm": True}, ["model config qk_norm: checkpoint False, now True"]),
        ({"rope_theta": 500000.0}, ["model config rope_theta: checkpoint 10000.0, now 500000.0"]),
        (
            {"intermediate_size": 128, "value_embeds": 1},
            ["model config intermediate_size: checkpoint 176, now 128", "value_embeds: checkpoint 0, now 1"],
        ),
    ],
)
def test_a_resume_with_another_architecture_is_refused_naming_the_fields(
    tmp_path: Path, stopped: Path, dataset: DatasetRef, overrides: dict, named: list[str]
) -> None:
    other = build_model_ref(
        get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ, **overrides), seed=0
    )
    run_dir = copy_of(stopped, tmp_path)
    with pytest.raises(TrainingError, match=r"cannot resume .*step_000004") as info:
        fit(other, dataset, settings(), run_dir, progress=False)
    for text in named:
        assert text in str(info.value)
    assert max(read_metrics(run_dir)) == 4


def forget(checkpoint: Path, file: str, *names: str) -> None:
    """Rewrite `file` of `checkpoint` without `names`, as a checkpoint written before they existed."""
    path = checkpoint / file
    data = json.loads(path.read_text())
    for name in names:
        del data[name]
    path.write_text(json.dumps(data))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["sha256"][file] = sha256_file(path)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_older_than_a_setting_resumes_when_the_setting_is_at_its_default(
    tmp_path: Path, stopped: Path, reference: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    run_dir = copy_of(stopped, tmp_path)
    forget(run_dir / "step_000004", "train_settings.json", "document_mask", "muon_weight_decay")
    forget(run_dir / "step_000004", "config.json", "value_embeds")
    with pytest.raises(TrainingError) as info:
        fit(model_ref, dataset, settings(document_mask=True), run_dir, progress=False)
    assert (
        "document_mask: checkpoint written before this setting existed (as its default False), now True"
        in str(info.value)
    )
    assert "muon_weight_decay" not in str(info.value) and "model config" not in str(info.value)

    done = fit(model_ref, dataset, settings(), run_dir, progress=False)
    assert done.step == 8 and losses(run_dir) == losses(reference)


def test_a_rebuilt_dataset_with_the_same_block_count_is_refused(
    tmp_path: Path, stopped: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    rebuilt = write_packed_dataset(
        tmp_path / "rebuilt", blocks_with_padding(7), pattern_blocks(4, SEQ, VOCAB, 1), vocab_size=VOCAB
    )
    assert rebuilt.train_blocks == dataset.train_blocks and rebuilt.fingerprint != dataset.fingerprint
    with pytest.raises(TrainingError, match=f"dataset fingerprint: checkpoint {dataset.fingerprint}"):
        fit(model_ref, rebuilt, settings(), copy_of(stopped, tmp_path), progress=False)


@pytest.mark.parametrize(
    "changed",
    [
        {"micro_batch_size": 4, "accumulate_steps": 2},  # the same global batch, split differently
        {"micro_batch_size": 8, "accumulate_steps": 1, "keep_checkpoints": 3, "log_every": 2},
        {"max_steps": 8},  # the same 8 steps, now from max_steps
    ],
)
def test_a_resume_that_keeps_the_run_is_allowed_and_continues_it(
    tmp_path: Path, stopped: Path, reference: Path, dataset: DatasetRef, model_ref: ModelRef, changed: dict
) -> None:
    run_dir = copy_of(stopped, tmp_path)
    done = fit(model_ref, dataset, settings(**changed), run_dir, progress=False)
    assert done.step == 8
    expected, got = losses(reference), losses(run_dir)
    assert {1, 2, 3, 4, 8} <= got.keys() <= expected.keys()  # log_every=2 skips step 7
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=1e-5)
    a = load_file(str(Path(done.path) / "model.safetensors"))
    b = load_file(str(reference / "step_000008" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_a_resume_between_the_two_bf16_recipes_is_refused_naming_the_fix(
    tmp_path: Path, stopped: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    """A checkpoint of FSDP2 under bf16 on CUDA (bf16 parameters and residual stream) resumed by DDP or
    one process (autocast over fp32 weights) would switch numerical recipe mid-run: refused before any
    step, naming the ways out. The checkpoint is the CPU run's with the recipe a CUDA FSDP2 run records."""
    assert ckpt.load_trainer_state(stopped / "step_000004")["run"]["precision"] == precision.FP32
    run_dir = copy_of(stopped, tmp_path)
    step4 = run_dir / "step_000004"
    state = ckpt.load_trainer_state(step4)
    state["run"]["precision"] = precision.precision_recipe("fsdp", "cuda", "bf16")
    torch.save(state, step4 / ckpt.STATE_FILE)
    (step4 / ckpt.MANIFEST_FILE).unlink()
    ckpt.write_manifest(step4, 4)
    with pytest.raises(TrainingError, match=r"cannot resume .*step_000004") as info:
        fit(model_ref, dataset, settings(dtype="bf16"), run_dir, progress=False)
    message = str(info.value)
    assert f"checkpoint trained with {precision.BF16_FSDP_PARAMS}" in message
    assert f"this run would train with {precision.BF16_AUTOCAST}" in message
    assert "data_parallel" in message and "dtype fp32" in message and "init_from" in message
    assert max(read_metrics(run_dir)) == 4
    # fp32 <-> bf16 is a change of dtype, free as before; on CPU FSDP2 and DDP share autocast's recipe.
    assert precision_differences(precision.BF16_FSDP_PARAMS, precision.FP32) == []
    cpu = {precision.precision_recipe(mode, "cpu", "bf16") for mode in ("none", "ddp", "fsdp")}
    assert cpu == {precision.BF16_AUTOCAST}


# ---------------------------------------------------------------- pruning (issue 12, item 11)


def corrupt(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def test_pruning_keeps_the_checkpoint_just_written_when_corrupt_newer_ones_are_on_disk(
    tmp_path: Path, reference: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    run_dir = tmp_path / "run"
    fit(model_ref, dataset, settings(keep_checkpoints=3), run_dir, progress=False)
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [4, 6, 8]
    corrupt(run_dir / "step_000006")
    corrupt(run_dir / "step_000008")

    # Resumes from step 4 (6 and 8 are corrupt) and stops after step 5, keeping one checkpoint.
    keep_one = settings(keep_checkpoints=1)
    with pytest.warns(RuntimeWarning, match="skipping checkpoint"), pytest.raises(TrainingInterrupted):
        fit(model_ref, dataset, keep_one, run_dir, progress=False, should_stop=stop_after(1))
    on_disk = dict(checkpoint_dirs(run_dir))
    assert 5 in on_disk and checkpoint_problem(on_disk[5]) is None, sorted(on_disk)
    assert 4 not in on_disk  # older than the newest valid one, beyond keep_checkpoints=1
    assert checkpoint_problem(on_disk[8]) is not None  # corrupt, left for step 8 to replace

    with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
        done = fit(model_ref, dataset, keep_one, run_dir, progress=False)
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [8] and checkpoint_problem(Path(done.path)) is None
    assert losses(run_dir) == losses(reference)  # bit for bit, through both resumes


# ---------------------------------------------------------------- per-rank RNG state (issue 12, item 12)


class DrawingSink:
    """Draws from every global generator after each step, as dropout or sampling in training would."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        torch.rand(1)
        np.random.rand()
        random.random()


def rng_state(checkpoint: Path, rank: int = 0) -> dict:
    return torch.load(checkpoint / f"rng_rank_{rank}.pt", weights_only=True)


def assert_same_rng(a: dict, b: dict) -> None:
    assert torch.equal(a["torch"], b["torch"])
    assert torch.equal(a["numpy"]["keys"], b["numpy"]["keys"]) and a["numpy"]["pos"] == b["numpy"]["pos"]
    assert a["python"] == b["python"]


def test_rng_state_is_saved_per_rank_in_the_manifest_and_restored_on_resume(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    whole = fit(model_ref, dataset, settings(), tmp_path / "whole", DrawingSink(), progress=False)
    manifest = json.loads((Path(whole.path) / "manifest.json").read_text())
    assert "rng_rank_0.pt" in manifest["sha256"]

    run_dir = tmp_path / "resumed"
    with pytest.raises(TrainingInterrupted):
        fit(model_ref, dataset, settings(), run_dir, DrawingSink(), progress=False, should_stop=stop_after(2))
    resumed = fit(model_ref, dataset, settings(), run_dir, DrawingSink(), progress=False)
    # 8 steps of draws either way: restored at step 2, not seeded afresh.
    assert_same_rng(rng_state(Path(resumed.path)), rng_state(Path(whole.path)))

    (Path(resumed.path) / "rng_rank_0.pt").write_bytes(b"not a torch file")
    assert "rng_rank_0.pt does not match its sha256" in (checkpoint_problem(Path(resumed.path)) or "")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_rank_saves_and_restores_only_its_own_gpus_rng_state() -> None:
    from tasks.training.checkpoint import capture_rng_state, restore_rng_state

    device = torch.device("cuda", 0)
    state = capture_rng_state(device)
    assert isinstance(state["cuda"], torch.Tensor)  # this rank's generator, not one per visible GPU
    expected = torch.rand(4, device=device)
    restore_rng_state(state, device)
    assert torch.equal(torch.rand(4, device=device), expected)
    restore_rng_state(state, torch.device("cpu"))  # resumed without a GPU: the CUDA part is skipped
