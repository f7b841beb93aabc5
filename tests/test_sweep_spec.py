"""Sweep specs: every problem named on its own line before any trial runs; a trial's configuration and the
printed command line are the same configuration."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from flows.cli import config_from_args, describe_validation_error
from flows.pretrain_config import PretrainConfig
from flows.sweep import main
from flows.sweep.report import compare, paired_p_value
from flows.sweep.spec import check_spec, pretrain_command, tokens_per_step, trial_values
from flows.sweep.study import sampler_of, search_fingerprint

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
    # The study is tied to what its trials were drawn from; the trial count and parallelism may change.
    assert search_fingerprint(spec) == search_fingerprint(
        spec.model_copy(update={"trials": 2, "parallel": 3})
    )
    assert search_fingerprint(spec) != search_fingerprint(
        check_spec({**GOOD, "sampler": "random", "trials": 3})
    )


def test_the_paired_test_of_the_confirmation() -> None:
    base = {1: 1.20, 2: 1.21, 3: 1.19, 4: 1.20, 5: 1.22}
    better = {s: v - 0.01 + 0.001 * (s % 2) for s, v in base.items()}  # 0.009-0.010 lower on every seed
    verdict = compare("trial-3", {"lr": 0.01}, better, base, [1, 2, 3, 4, 5])
    assert verdict.real and verdict.p_value < 1e-4
    noisy = {1: 1.19, 2: 1.22, 3: 1.18, 4: 1.21, 5: 1.22}  # lower on average, not on every seed
    assert not compare("trial-4", {}, noisy, base, [1, 2, 3, 4, 5]).real
    worse = {s: v + 0.01 for s, v in base.items()}
    assert paired_p_value(list(worse.values()), list(base.values())) == 1.0
    # Only the seeds both completed pair up.
    assert compare("trial-5", {}, {1: 1.0, 3: 1.1}, base, [1, 2, 3]).candidate.values == [1.0, 1.1]


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "benchmarks" / "sweeps").glob("*.yaml")))
def test_the_benchmark_specs_are_valid(path: Path) -> None:
    from flows.sweep.spec import load_spec

    assert load_spec(path).n_trials >= 2  # every value of every dimension checked against PretrainConfig
