"""PretrainConfig and the CLI: presets, overrides, and clear errors before any work starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.config import PRESETS, PretrainConfig
from flows.pretrain import config_from_args

ROOT = Path(__file__).resolve().parents[1]


def test_preset_fills_defaults_and_explicit_values_win() -> None:
    cfg = PretrainConfig(preset="tiny", lr=1e-2)
    assert cfg.model == "tiny" and cfg.max_steps == PRESETS["tiny"]["max_steps"]
    assert cfg.lr == 1e-2
    assert PretrainConfig().preset == "demo" and PretrainConfig().model == "demo"


def test_train_settings_carry_the_optimisation_fields() -> None:
    cfg = PretrainConfig(preset="tiny", accumulate_steps=3, compile=False)
    settings = cfg.train_settings("/tmp/x")
    assert settings["accumulate_steps"] == 3 and settings["compile"] is False
    assert settings["checkpoint_dir"] == "/tmp/x"
    assert settings["epochs"] is None  # max_steps is set, so it alone decides the run length
    assert PretrainConfig(preset="tiny", max_steps=None).train_settings("/tmp/x")["epochs"] == 1.0


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
