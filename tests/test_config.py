"""PretrainConfig and the CLI: presets, overrides, and clear errors before any work starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.config import RUN_PRESETS, PretrainConfig
from flows.pretrain import config_from_args

ROOT = Path(__file__).resolve().parents[1]


def test_preset_fills_defaults_and_explicit_values_win() -> None:
    cfg = PretrainConfig(preset="tiny", lr=1e-2)
    assert cfg.model == "tiny" and cfg.max_steps == RUN_PRESETS["tiny"]["max_steps"]
    assert cfg.lr == 1e-2
    assert PretrainConfig().preset == "demo" and PretrainConfig().model == "demo"


# A value different from both the default and every preset's, for every training option. A new option of
# TrainSettings fails this test until it is given one here, so it cannot be forgotten on the way.
NON_DEFAULT_FLAGS = {
    "micro_batch_size": ["--micro-batch-size", "3"],
    "accumulate_steps": ["--accumulate-steps", "5"],
    "max_steps": ["--max-steps", "77"],
    "epochs": ["--epochs", "2.5"],
    "optimizer": ["--optimizer", "muon"],
    "lr": ["--lr", "0.0123"],
    "embed_lr": ["--embed-lr", "0.03"],
    "head_lr": ["--head-lr", "0.004"],
    "scalar_lr": ["--scalar-lr", "0.005"],
    "muon_lr": ["--muon-lr", "0.05"],
    "muon_momentum": ["--muon-momentum", "0.9"],
    "muon_ns_steps": ["--muon-ns-steps", "4"],
    "muon_weight_decay": ["--muon-weight-decay", "0.01"],
    "muon_adjust_lr": ["--muon-adjust-lr", "match_rms_adamw"],
    "min_lr_ratio": ["--min-lr-ratio", "0.25"],
    "warmup_steps": ["--warmup-steps", "7"],
    "schedule": ["--schedule", "wsd"],
    "decay_fraction": ["--decay-fraction", "0.3"],
    "weight_decay": ["--weight-decay", "0.05"],
    "betas": ["--betas", "[0.8, 0.9]"],
    "eps": ["--eps", "1e-7"],
    "grad_clip": ["--grad-clip", "0"],
    "seed": ["--seed", "42"],
    "compile": ["--no-compile"],
    "dtype": ["--dtype", "fp32"],
    "device": ["--device", "cpu"],
    "nproc_per_node": ["--nproc-per-node", "2"],
    "checkpoint_every": ["--checkpoint-every", "11"],
    "keep_checkpoints": ["--keep-checkpoints", "4"],
    "log_every": ["--log-every", "3"],
    "max_time_s": ["--max-time-s", "60"],
}


def test_every_training_option_goes_from_the_command_line_to_the_engine_unchanged() -> None:
    from tasks.refs import DatasetRef, ModelRef
    from tasks.training import TrainSettings
    from tasks.training.launch import WorkerSpec

    assert set(NON_DEFAULT_FLAGS) == set(TrainSettings.model_fields), (
        "give every training option a value here"
    )
    config = config_from_args(["--preset", "tiny", *sum(NON_DEFAULT_FLAGS.values(), [])])
    settings = config.train_settings()
    assert type(settings) is TrainSettings
    defaults = TrainSettings()
    for name in TrainSettings.model_fields:
        assert getattr(settings, name) == getattr(config, name) != getattr(defaults, name), name
    # What a train deployment's parameter and a torchrun worker receive: the same object, through JSON.
    spec = WorkerSpec(
        model_ref=ModelRef(path="m", fingerprint="f", n_params=1),
        dataset_ref=DatasetRef(
            path="d",
            fingerprint="f",
            seq_len=2,
            vocab_size=2,
            train_blocks=1,
            val_blocks=1,
            train_tokens=2,
            val_tokens=2,
        ),
        settings=settings,
        run_dir="r",
        progress=False,
    )
    assert WorkerSpec.model_validate_json(spec.model_dump_json()).settings == settings


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"data": "/no/such/corpus"}, "does not exist"),
        ({"accumulate_steps": 0}, "accumulate_steps"),
        ({"seq_len": 100_000}, "max_position_embeddings"),
        ({"seq_len": 1}, "seq_len"),
        ({"preset": "huge"}, "unknown preset"),
        ({"init_checkpoint": "/no/such/ckpt"}, "does not exist"),
        ({"warmup_steps": 50, "max_steps": 10}, "warmup_steps"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"num_samples": 7}, "num_samples"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_config_is_rejected_with_a_message_naming_the_problem(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        PretrainConfig(preset=fields.pop("preset", "tiny"), **fields)
    assert message in str(info.value)


def test_cli_flags_override_yaml_which_overrides_the_preset(tmp_path: Path) -> None:
    config_file = tmp_path / "run.yaml"
    config_file.write_text("preset: tiny\nlr: 0.005\nmax_steps: 7\n")
    cfg = config_from_args(
        ["--config", str(config_file), "--max-steps", "9", "--no-compile", "--seq-len", "64"]
    )
    assert (cfg.preset, cfg.lr, cfg.max_steps, cfg.compile, cfg.seq_len) == ("tiny", 0.005, 9, False, 64)


def test_cli_help_lists_every_config_field() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flows.pretrain", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in PretrainConfig.model_fields:
        assert "--" + name.replace("_", "-") in out
    assert "--no-compile" in out and "--config" in out


def test_cli_rejects_bad_input_before_starting_prefect() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pretrain", "--preset", "tiny", "--accumulate-steps", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "accumulate_steps" in proc.stderr
    assert "Traceback" not in proc.stderr
