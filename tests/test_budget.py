"""Run budget (issue 52 item 1): the planner as a pure function of measured times, and a budgeted engine run:
calibration leaves no trace, the schedule ends decayed at the planned step, the plan is recorded and a
resume keeps it."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import get_preset
from synthetic import eager_settings, pattern_blocks, write_packed_dataset
from synthetic import model_ref as build_model_ref
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainSettings, fit, read_metrics
from tasks.training.budget import (
    BudgetPlan,
    BudgetTerms,
    Measured,
    format_duration,
    parse_duration,
    plan_steps,
    training_seconds,
)
from tasks.training.checkpoint import checkpoint_dirs, load_trainer_state

# ---------------------------------------------------------------- the planner


def test_durations_read_as_people_write_them() -> None:
    assert parse_duration("10m") == 600
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90s") == parse_duration("90") == parse_duration(90) == 90
    assert parse_duration("1.5h") == 5400
    for bad in ("ten minutes", "", "0", "-5", "5 d"):
        with pytest.raises(ValueError, match="time_budget"):
            parse_duration(bad)
    assert [format_duration(s) for s in (45, 600, 570, 3900)] == ["45s", "10m", "9m30s", "1h05m"]
    assert TrainSettings(time_budget="12m").time_budget == 720


MEASURED = Measured(first_step_s=60.0, step_s=2.0, forward_token_s=1e-4, checkpoint_s=1.0)


def test_the_plan_fills_the_budget_left_after_what_came_before_and_what_follows() -> None:
    # 600 s budget, 100 s spent (data, compilation), evaluation 50k tokens at 0.1 ms + 15 s = 20 s after.
    terms = BudgetTerms(total_s=600, started_at=1000.0, after_tokens=50_000, after_fixed_s=15.0)
    plan = plan_steps(terms, MEASURED, now=1100.0, margin=0.0)
    # 480 s for training: 239 steps of 2 s and the last checkpoint (1 s) fit, 240 do not.
    assert plan.steps == 239
    assert plan.after_s == pytest.approx(20.0)
    assert plan.end_at == pytest.approx(1100.0 + 239 * 2.0 + 1.0 + 20.0)
    assert plan.end_at <= terms.started_at + terms.total_s
    assert "a step takes 2 s here" in plan.reason and "100 s spent before training" in plan.reason
    # The margin is taken from the training time, and a later plan (more spent) gets fewer steps.
    assert plan_steps(terms, MEASURED, now=1100.0, margin=0.1).steps == 215
    assert plan_steps(terms, MEASURED, now=1300.0, margin=0.0).steps == 139


def test_periodic_scores_and_checkpoints_are_counted_in_the_steps_time() -> None:
    measured = Measured(first_step_s=5, step_s=1.0, forward_token_s=0, periodic_eval_s=10.0, checkpoint_s=5.0)
    terms = BudgetTerms(total_s=1000, started_at=0.0)
    plan = plan_steps(terms, measured, now=0.0, eval_every=10, checkpoint_every=100, margin=0.0)
    # 489 steps: 489 s, 48 scores (480 s), 4 periodic checkpoints and the last (25 s) = 994 s; 490 steps
    # would add a step and a score (1,005 s).
    assert plan.steps == 489
    used = training_seconds(plan.steps, measured, eval_every=10, checkpoint_every=100)
    assert used <= 1000 < training_seconds(plan.steps + 1, measured, eval_every=10, checkpoint_every=100)
    # The last step's checkpoint is the periodic one when they coincide: counted once.
    assert training_seconds(100, measured, checkpoint_every=100) == 100 + 5
    assert training_seconds(101, measured, checkpoint_every=100) == 101 + 10


def test_a_budget_too_short_takes_the_minimum_and_says_so() -> None:
    terms = BudgetTerms(total_s=60, started_at=0.0)
    plan = plan_steps(terms, MEASURED, now=70.0, min_steps=13)
    assert plan.steps == 13
    assert "too little for 13 step(s)" in plan.reason and "ends after the budget" in plan.reason
    assert BudgetPlan.from_dict(plan.to_dict()) == plan
    assert plan.describe().startswith("13 optimizer steps, set by time_budget=1m: ")


# ---------------------------------------------------------------- a budgeted run of the engine

VOCAB, SEQ = 96, 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    directory = tmp_path_factory.mktemp("packed")
    return write_packed_dataset(
        directory, pattern_blocks(29, SEQ, VOCAB, 0), pattern_blocks(4, SEQ, VOCAB, 1), vocab_size=VOCAB
    )


@pytest.fixture(scope="module")
def model_ref() -> ModelRef:
    return build_model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ), seed=0)


settings = partial(
    eager_settings, warmup_steps=2, schedule="wsd", decay_fraction=0.5, min_lr_ratio=0.0, checkpoint_every=1
)


def test_a_budgeted_run_plans_its_steps_ends_decayed_and_a_resume_keeps_the_plan(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    budgeted = fit(model_ref, dataset, settings(time_budget=4), tmp_path / "budget", progress=False)
    state = load_trainer_state(Path(budgeted.path))
    plan = BudgetPlan.from_dict(state["run"]["budget"])
    steps = plan.steps
    assert steps >= 3 and budgeted.step == steps == state["total_steps"]
    assert budgeted.run_length.startswith(f"{steps} optimizer steps, set by time_budget=4s: a step takes ")
    metrics = read_metrics(budgeted.run_dir)
    assert metrics[1]["budget/planned_steps"] == steps  # the plan, recorded with the first step
    assert metrics[1]["budget/time_budget_s"] == 4
    assert metrics[steps]["train/lr"] == 0.0  # the schedule was laid over the planned steps: decayed
    assert metrics[steps - 1]["train/lr"] > 0.0

    # The calibration left no trace: a run of the same length without a budget trains the same weights.
    fixed = fit(model_ref, dataset, settings(max_steps=steps), tmp_path / "fixed", progress=False)
    weights = load_file(str(Path(budgeted.path) / "model.safetensors"))
    for name, tensor in load_file(str(Path(fixed.path) / "model.safetensors")).items():
        assert torch.equal(weights[name], tensor), name

    # A resume keeps the plan, whatever budget it is given now, and finishes the same run.
    kept = checkpoint_dirs(Path(budgeted.run_dir))
    assert [step for step, _ in kept] == [steps - 1, steps]
    shutil.rmtree(kept[-1][1])
    resumed = fit(model_ref, dataset, settings(time_budget="1h"), tmp_path / "budget", progress=False)
    assert resumed.step == steps and resumed.run_length == budgeted.run_length
    assert BudgetPlan.from_dict(load_trainer_state(Path(resumed.path))["run"]["budget"]) == plan
    for name, tensor in load_file(str(Path(resumed.path) / "model.safetensors")).items():
        assert torch.equal(weights[name], tensor), name


# ---------------------------------------------------------------- the flow's configuration


def test_the_budget_gives_way_to_an_explicit_run_length() -> None:
    from flows.pretrain_config import ConfigNote, PretrainConfig

    budgeted = PretrainConfig(preset="tiny", time_budget="10m")
    assert budgeted.max_steps is None and budgeted.budget_seconds == 600  # not the preset's max_steps
    with pytest.warns(ConfigNote, match="time_budget=10m not used: max_steps=50 sets the run length"):
        by_steps = PretrainConfig(preset="tiny", time_budget="10m", max_steps=50)
    assert by_steps.max_steps == 50 and by_steps.budget_seconds is None
    with pytest.warns(ConfigNote, match="time_budget=10m not used: epochs=2"):
        by_epochs = PretrainConfig(preset="tiny", time_budget="10m", epochs=2)
    assert by_epochs.max_steps is None and by_epochs.time_budget is None
    with pytest.raises(ValueError, match="time_budget='soon' is not a duration"):
        PretrainConfig(preset="tiny", time_budget="soon")


def test_the_demo_shape_follows_the_hardware_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    from flows import demo_shapes
    from flows.pretrain_config import PretrainConfig, describe_shape
    from tasks.training import precision

    monkeypatch.setattr(demo_shapes, "_fp32_cpu_host", lambda values: True)
    fp32 = PretrainConfig()
    assert fp32.demo_shape == demo_shapes.FP32_DEMO_SHAPE and fp32.max_steps is None
    assert fp32.budget_seconds == parse_duration(demo_shapes.FP32_DEMO_BUDGET)
    chosen = demo_shapes.DEMO_SHAPES[demo_shapes.FP32_DEMO_SHAPE]
    assert fp32.llama_config().hidden_size == chosen["model_overrides"]["hidden_size"]
    assert "this CPU has no bf16 in hardware" in describe_shape(fp32)
    assert PretrainConfig(**fp32.model_dump()) == fp32  # a validated config validates to itself
    # The user's choices stay: a batch given keeps the preset's model; a run length given drops the budget.
    assert PretrainConfig(micro_batch_size=8).demo_shape == "preset"
    assert PretrainConfig(max_steps=50).budget_seconds is None
    monkeypatch.setattr(demo_shapes, "_fp32_cpu_host", lambda values: False)
    native = PretrainConfig()  # where bf16 is native: today's demo exactly
    assert native.demo_shape == "preset" and native.max_steps == 1200 and native.time_budget is None
    assert native.llama_config().hidden_size == 320 and native.accumulate_steps == 2
    monkeypatch.undo()
    # The probe honours an AVX2 emulation (torch dispatching below AVX-512): no native bf16 there.
    monkeypatch.setattr(precision.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    precision.native_bf16.cache_clear()
    try:
        assert not precision.native_bf16("cpu")
        assert demo_shapes._fp32_cpu_host({"device": "cpu"})
    finally:
        monkeypatch.undo()
        precision.native_bf16.cache_clear()
