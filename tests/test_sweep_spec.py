"""Sweep specs: every problem named on its own line before any trial runs; a trial's configuration and the
printed command line are the same configuration."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import optuna
import pytest
import yaml
from pydantic import ValidationError

from flows.cli import config_from_args, describe_validation_error
from flows.pretrain_config import PretrainConfig
from flows.sweep import main
from flows.sweep.command import pretrain_command
from flows.sweep.gpus import GpuPool, trials_at_once
from flows.sweep.report import (
    SIGNIFICANCE,
    compare,
    confirmation_lines,
    corrected,
    holm,
    paired_p_value,
    recommend,
)
from flows.sweep.spec import Pruner, check_spec, tokens_per_step, trial_values
from flows.sweep.study import STORAGE_ENV, home_free, sampler_of, search_fingerprint, spec_record, storage_url

GOOD = {
    "name": "wd",
    "base": {"preset": "tiny", "eval_every": 10},
    "space": {
        "muon_weight_decay": {"choices": [0.02, 0.05, 0.1]},
        "model_overrides.qk_norm": {"choices": [True, False]},
    },
    "sampler": "grid",
    "pruner": "asha",
}


def problems(data: dict) -> list[str]:
    with pytest.raises(ValidationError) as err:
        check_spec(data)
    return describe_validation_error(err.value).splitlines()


def test_a_good_spec_takes_its_defaults_from_the_base_and_the_grid() -> None:
    spec = check_spec(GOOD)
    assert spec.n_trials == 6  # the grid's size
    assert spec.pruner.name == "asha" and spec.first_rung() == 10  # the base's eval_every
    assert spec.sweep_model_name() == "llamaflow-tiny-sweep-wd"  # never the base's own model name
    assert sampler_of(spec).__class__.__name__ == "_Grid"


def test_every_problem_of_a_bad_spec_is_one_line_naming_where_it_is() -> None:
    bad = {
        "name": "x",
        "base": {"preset": "tiny", "run_name": "mine"},
        "space": {
            "lr": {"low": 0.01, "high": 0.001},
            "muon_lr": {"choices": [0.02, -1.0]},
            "no_such_field": {"choices": [1]},
            "model_overrides.hidden_sizes": {"choices": [64]},
            "micro_batch_size": {"low": 2, "high": 8.5},
            "warmup_steps": {"low": 1, "high": 4},
        },
        "sampler": "grid",
        "pruner": "asha",
    }
    # Structure first (pydantic): the inverted range.
    assert problems(bad) == ["  space.lr: low=0.01 must be below high=0.001"]
    bad["space"]["lr"] = {"low": 0.001, "high": 0.01, "log": True}
    lines = problems(bad)
    assert lines == [
        "  base.run_name: a sweep sets run_name for each trial: leave it out of base",
        "  space.muon_lr.choices.1: -1.0: Input should be greater than 0",
        "  space.no_such_field: 'no_such_field' is not a PretrainConfig field a trial can vary (see python -m flows.pretrain --help)",
        lines[3],
        "  space.micro_batch_size: micro_batch_size is an integer: give integer low, high and step",
        "  space.lr: sampler grid needs choices (or low, high and step) for every dimension",
        "  space.micro_batch_size: sampler grid needs choices (or low, high and step) for every dimension",
        "  space.warmup_steps: sampler grid needs choices (or low, high and step) for every dimension",
        "  pruner: asha prunes on the validation score taken during training: set base.eval_every (e.g. 100), or pruner: none",
    ]
    assert lines[3].startswith("  space.model_overrides.hidden_sizes: 'hidden_sizes' is not a model field")
    # A base PretrainConfig refuses is reported as the CLI reports it, under `base`.
    assert problems({**GOOD, "base": {"preset": "tiny", "lr": -1, "nope": 1}}) == [
        "  base.lr: Input should be greater than 0",
        "  base.nope: Extra inputs are not permitted",
    ]
    assert problems({**GOOD, "sampler": "tpe"}) == ["  trials: sampler tpe needs a number of trials"]
    assert problems({**GOOD, "trials": 7}) == ["  trials: 7 trials but the grid holds 6 points"]
    assert problems({**GOOD, "seeds": [1]}) == [
        "  seeds: one seed cannot show a difference: give at least 2 (5 or more for p < 0.01)"
    ]


def test_the_command_line_exits_2_with_the_problems_before_any_trial(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump({**GOOD, "base": {"preset": "tiny"}, "budget": {"steps": 5, "tokens": 9}}))
    assert main([str(spec)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"invalid sweep spec {spec}:", "  budget: give one of steps or tokens"]
    spec.write_text(yaml.safe_dump({**GOOD, "base": {"preset": "tiny"}}))
    assert main([str(spec)]) == 2
    assert (
        capsys.readouterr().err.splitlines()[-1].startswith("  pruner: asha prunes on the validation score")
    )
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_printed_command_gives_the_trials_configuration() -> None:
    spec = check_spec(
        {
            **GOOD,
            "base": {
                "preset": "tiny",
                "eval_every": 10,
                "compile": False,
                "model_overrides": {"value_embeds": 1},
            },
            "budget": {"tokens": 40_000},
        }
    )
    params = {"muon_weight_decay": 0.05, "model_overrides.qk_norm": True}
    values = trial_values(spec, params)
    config = PretrainConfig(**values)
    assert config.model_overrides == {"value_embeds": 1, "qk_norm": True} and config.muon_weight_decay == 0.05
    assert config.max_steps == 40_000 // tokens_per_step(config)  # the token budget, in whole steps
    command = pretrain_command(values)
    assert command.startswith("python -m flows.pretrain --preset tiny ")
    assert config_from_args(shlex.split(command)[3:]) == config
    # The study is tied to everything its results depend on; parallelism and where trials run may change.
    assert search_fingerprint(spec) == search_fingerprint(
        spec.model_copy(update={"parallel": 3, "launch": "deployment"})
    )
    for changed in (
        {"trials": 2},
        {"seeds": [1, 2]},
        {"confirm_top": 2},
        {"pruner": Pruner(name="none")},
        {"gpus_per_trial": 1},  # a trial's ranks: its global batch
        {"base": {**spec.base, "nnodes": 2}},
    ):
        assert search_fingerprint(spec) != search_fingerprint(spec.model_copy(update=changed)), changed


def test_rungs_count_the_same_tokens_for_every_trial_whatever_its_batch() -> None:
    spec = check_spec(
        {
            "name": "rungs",
            "base": {
                "preset": "tiny",
                "eval_every": 8,
                "micro_batch_size": 4,
                "accumulate_steps": 1,
                "seq_len": 64,
            },
            "space": {"micro_batch_size": {"choices": [2, 4, 16]}, "nnodes": {"choices": [1, 2]}},
            "sampler": "grid",
            "pruner": "asha",
            "budget": {"tokens": 200_000},
        }
    )
    first_rung = 8 * 4 * 64  # the base's eval_every, in tokens
    assert spec.first_rung() == first_rung
    for batch in (2, 4, 16):
        for nodes in (1, 2):
            config = PretrainConfig(**trial_values(spec, {"micro_batch_size": batch, "nnodes": nodes}))
            assert tokens_per_step(config) == batch * 64 * nodes  # every node's batch counts
            assert config.eval_every * tokens_per_step(config) == first_rung  # scored at the same tokens
            assert config.max_steps == 200_000 // tokens_per_step(config)
    # A step budget counts steps for every trial: eval_every stays the base's.
    steps = check_spec({**GOOD, "budget": {"steps": 40}, "space": {"micro_batch_size": {"choices": [2, 16]}}})
    assert PretrainConfig(**trial_values(steps, {"micro_batch_size": 16})).eval_every == 10


def test_a_token_budget_whose_rungs_some_trial_cannot_meet_is_refused_naming_a_first_rung_all_meet() -> None:
    """Steps of 320 tokens (micro_batch_size 5) cannot score at the 2,048-token first rung (the base's 8
    steps of 256): judged at 3,840, 88% late. A first rung of 2,560 (both divide it) is met exactly."""
    spec = {
        "name": "late",
        "base": {
            "preset": "tiny",
            "eval_every": 8,
            "micro_batch_size": 4,
            "accumulate_steps": 1,
            "seq_len": 64,
        },
        "space": {"micro_batch_size": {"choices": [4, 5]}},
        "sampler": "grid",
        "pruner": "asha",
        "budget": {"tokens": 100_000},
    }
    assert problems(spec) == [
        "  pruner.min_resource: the rung at 2,048 tokens is met at 3,840 by a trial with micro_batch_size=5 (+88%, "
        "more than 5%): its steps of 320 tokens do not divide the rungs. Give pruner.min_resource a multiple of "
        "1,280 tokens (every trial's tokens per step divides it), e.g. 2,560"
    ]
    fixed = check_spec({**spec, "pruner": {"name": "asha", "min_resource": 2560}})
    for batch in (4, 5):
        config = PretrainConfig(**trial_values(fixed, {"micro_batch_size": batch}))
        assert config.eval_every * tokens_per_step(config) == 2560


def test_a_storage_that_is_neither_a_journal_nor_a_database_url_is_refused_naming_both(monkeypatch) -> None:
    assert problems({**GOOD, "storage": "/tmp/sweeps.db"}) == [
        "  storage: storage='/tmp/sweeps.db' is neither journal:PATH (an Optuna journal file, "
        "e.g. journal:/tmp/sweeps.db) nor a database URL (postgresql+psycopg://USER@HOST/DB, sqlite:///PATH)"
    ]
    for good in ("journal:/tmp/x.journal", "sqlite:///x.db", "postgresql+psycopg://u@h/db"):
        assert check_spec({**GOOD, "storage": good}).storage == good
    monkeypatch.setenv(STORAGE_ENV, "sweeps.journal")
    with pytest.raises(ValueError, match=f"{STORAGE_ENV}='sweeps.journal' is neither journal:PATH"):
        storage_url(check_spec(GOOD))


def test_the_paired_test_of_the_confirmation() -> None:
    base = {1: 1.20, 2: 1.21, 3: 1.19, 4: 1.20, 5: 1.22}
    better = {s: v - 0.01 + 0.001 * (s % 2) for s, v in base.items()}  # 0.009-0.010 lower on every seed
    verdict = compare("trial-3", {"lr": 0.01}, better, base, [1, 2, 3, 4, 5])
    assert verdict.real and verdict.p_value < 1e-4
    noisy = {1: 1.19, 2: 1.22, 3: 1.18, 4: 1.21, 5: 1.22}  # lower on average, not on every seed
    assert not compare("trial-4", {}, noisy, base, [1, 2, 3, 4, 5]).real
    worse = {1: 1.3, 2: 1.25, 3: 1.27, 4: 1.24, 5: 1.26}
    assert paired_p_value(list(worse.values()), list(base.values())) > 0.99
    # Only the seeds both completed pair up.
    assert compare("trial-5", {}, {1: 1.0, 3: 1.1}, base, [1, 2, 3]).candidate.values == [1.0, 1.1]


def test_degenerate_confirmations_are_reported_untested_never_real() -> None:
    base = {1: 1.25, 2: 1.5, 3: 1.75}
    # The same difference on every seed: no spread, so no t statistic (not p = 0, "real").
    same = {s: v - 0.25 for s, v in base.items()}  # exact in binary: every difference is -0.25
    verdict = compare("trial-1", {"lr": 0.1}, same, base, [1, 2, 3])
    assert math.isnan(verdict.p_value) and not verdict.real
    assert verdict.why_untested == "the same difference on every seed: no spread to test"
    # No seed completed for the candidate (or for the base): no crash, no verdict.
    empty = compare("trial-2", {"lr": 0.2}, {}, base, [1, 2, 3])
    assert math.isnan(empty.candidate.mean) and not empty.real
    assert empty.why_untested == "0 seed(s) completed for both: no test"
    nothing = compare("trial-3", {"lr": 0.3}, {1: 1.0}, {}, [1, 2, 3])
    lines = confirmation_lines(corrected([verdict, empty, nothing]), [1, 2, 3], "bits_per_byte")
    assert "no spread to test" in lines[2] and "0 seed(s) completed" in lines[3] and len(lines) == 5
    found = corrected([verdict, empty, nothing])
    assert recommend(check_spec(GOOD), _best(), found).params == {}  # keep the base


def _best() -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(
        params={"muon_weight_decay": 0.05},
        distributions={"muon_weight_decay": optuna.distributions.CategoricalDistribution([0.02, 0.05, 0.1])},
        value=1.0,
    )


def test_holm_corrects_the_p_values_across_the_candidates() -> None:
    # Holm's step-down: sorted p times (K - rank), kept non-decreasing; nan (untested) stays nan, counts in K.
    assert holm([0.004, 0.03, 0.006]) == pytest.approx([0.012, 0.03, 0.012])
    assert holm([0.001, float("nan")])[0] == pytest.approx(0.002) and math.isnan(
        holm([0.001, float("nan")])[1]
    )
    base = {s: 1.2 + 0.01 * (s % 3) for s in range(1, 7)}
    # Lower on every seed, by an amount that varies: p ≈ 0.007 alone, not below 0.01 among three candidates.
    shifts = {1: 0.004, 2: 0.001, 3: 0.006, 4: 0.0045, 5: 0.0005, 6: 0.003}
    close = {s: v - shifts[s] for s, v in base.items()}
    alone = compare("trial-1", {"lr": 1}, close, base, list(base))
    assert SIGNIFICANCE / 3 < alone.p_value < SIGNIFICANCE and alone.real
    family = corrected([alone, compare("trial-2", {"lr": 2}, base, base, list(base)), alone])
    assert family[0].p_holm == family[2].p_holm == pytest.approx(3 * alone.p_value)
    assert 3 * alone.p_value > SIGNIFICANCE
    assert not family[0].real and family[0].p_value == alone.p_value


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "benchmarks" / "sweeps").glob("*.yaml")))
def test_the_benchmark_specs_are_valid(path: Path) -> None:
    from flows.sweep.spec import load_spec

    assert load_spec(path).n_trials >= 2  # every value of every dimension checked against PretrainConfig


def test_trials_at_once_are_as_many_as_the_gpus_hold(tmp_path: Path) -> None:
    spec = check_spec({**GOOD, "gpus_per_trial": 2})
    assert trials_at_once(spec, ["0", "1", "2", "3", "4"]) == 2
    assert trials_at_once(spec.model_copy(update={"parallel": 1}), ["0", "1", "2", "3"]) == 1
    assert trials_at_once(check_spec(GOOD), ["0", "1"]) == 1  # without gpus_per_trial: parallel's default
    with pytest.raises(ValueError, match="gpus_per_trial=2 but this host has 1 GPU"):
        trials_at_once(spec, ["0"])
    pool = GpuPool(["2", "3", "5", "7"], 2, locks=tmp_path)
    first, second = pool.take(), pool.take()
    assert first == ["2", "3"] and second == ["5", "7"]
    pool.give_back(first)
    assert pool.take() == ["2", "3"]


def test_the_study_keeps_its_storage_without_the_password() -> None:
    spec = check_spec({**GOOD, "storage": "postgresql+psycopg://me:s3cret@db.example/sweeps"})
    assert spec_record(spec)["storage"] == "postgresql+psycopg://me:***@db.example/sweeps"
    assert home_free(storage_url(spec)) == "postgresql+psycopg://me:***@db.example/sweeps"


def test_each_trial_runs_a_rank_on_each_of_its_gpus_on_the_pool_too() -> None:
    """gpus_per_trial is a trial's nproc_per_node (its flow run's parameter on the pool, the printed
    command's flag) unless base or space sets it; a local trial's ranks cannot outnumber its GPUs."""
    pool = {**GOOD, "launch": "deployment", "deployment": "pretrain/adhoc", "gpus_per_trial": 2}
    spec = check_spec(pool)
    values = trial_values(spec, {"muon_weight_decay": 0.05})
    assert values["nproc_per_node"] == 2 and "--nproc-per-node 2" in pretrain_command(values)
    assert tokens_per_step(PretrainConfig(**values)) == 2 * tokens_per_step(spec.base_config())
    varied = check_spec({**pool, "space": {"nproc_per_node": {"choices": [1, 4]}}})
    assert [trial_values(varied, {"nproc_per_node": n})["nproc_per_node"] for n in (1, 4)] == [1, 4]
    assert "nproc_per_node" not in trial_values(check_spec(GOOD), {})  # without gpus_per_trial: its own
    local = {**GOOD, "gpus_per_trial": 1, "space": {"nproc_per_node": {"choices": [1, 2]}}}
    assert problems(local) == [
        "  gpus_per_trial: a trial runs 2 ranks (nproc_per_node) but gets 1 GPU(s): raise gpus_per_trial to 2 "
        "or lower nproc_per_node"
    ]
    assert problems({**GOOD, "gpus_per_trial": 1, "base": {**GOOD["base"], "nproc_per_node": 3}}) == [
        "  gpus_per_trial: a trial runs 3 ranks (nproc_per_node) but gets 1 GPU(s): raise gpus_per_trial to 3 "
        "or lower nproc_per_node"
    ]
