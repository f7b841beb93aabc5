"""PretrainConfig and the CLI: presets, overrides, and clear errors before any work starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.cli import config_from_args
from flows.pretrain_config import RUN_PRESETS, PretrainConfig
from model import get_preset

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
    "muon_ns_steps": ["--muon-ns-steps", "3"],
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
    "document_mask": ["--document-mask"],
    "device": ["--device", "cpu"],
    "nproc_per_node": ["--nproc-per-node", "2"],
    "data_parallel": ["--data-parallel", "fsdp"],
    "fsdp_gradient_sync": ["--fsdp-gradient-sync", "last_micro_batch"],
    "hsdp_shard_size": ["--hsdp-shard-size", "2"],
    "activation_checkpointing": ["--activation-checkpointing", "full"],
    "nnodes": ["--nnodes", "2"],
    "max_restarts": ["--max-restarts", "3"],
    "rdzv_endpoint": ["--rdzv-endpoint", "127.0.0.1:29400"],
    "node_rank": ["--node-rank", "1"],
    "rdzv_id": ["--rdzv-id", "job-1"],
    "rdzv_timeout_s": ["--rdzv-timeout-s", "60"],
    "process_group_timeout_min": ["--process-group-timeout-min", "5"],
    "stop_grace_s": ["--stop-grace-s", "30"],
    "checkpoint_every": ["--checkpoint-every", "11"],
    "keep_checkpoints": ["--keep-checkpoints", "4"],
    "log_every": ["--log-every", "3"],
    "eval_every": ["--eval-every", "6"],
    "eval_bytes": ["--eval-bytes", "16000"],
    "max_time_s": ["--max-time-s", "60"],
    "time_budget": ["--time-budget", "10m"],
}


def test_every_training_option_goes_from_the_command_line_to_the_engine_unchanged() -> None:
    from tasks.refs import DatasetRef, ModelRef
    from tasks.training import TrainSettings
    from tasks.training.launch import WorkerSpec

    assert set(NON_DEFAULT_FLAGS) == set(TrainSettings.model_fields), (
        "give every training option a value here"
    )
    defaults = TrainSettings()
    # max_steps and epochs are two ways to give the run length: the command line takes one at a time.
    for left_out in ("epochs", "max_steps"):
        flags = sum((flag for name, flag in NON_DEFAULT_FLAGS.items() if name != left_out), [])
        config = config_from_args(["--preset", "tiny", *flags])
        settings = config.train_settings()
        assert type(settings) is TrainSettings
        # epochs given explicitly win over a time budget, which is then dropped (tests/test_budget.py).
        dropped = {"time_budget"} if left_out == "max_steps" else set()
        for name in set(TrainSettings.model_fields) - {left_out} - dropped:
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
        ({"init_from": "/no/such/ckpt"}, "does not exist"),
        ({"init_from": "models:/x@champion", "model": "tiny"}, "init_from takes the architecture"),
        ({"init_from": "models:/x@champion", "vocab_size": 4096}, "drop vocab_size"),
        ({"resize_embeddings": True}, "it needs init_from"),
        ({"warmup_steps": 50, "max_steps": 10}, "warmup_steps"),
        ({"warmup_steps": 40}, "warmup_steps=40 must be smaller than max_steps=30"),  # the preset's max_steps
        ({"data": "/no/such/dir/*.txt"}, "matches no files"),
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
    assert proc.stderr.strip().splitlines()[-2:] == [
        "invalid configuration:",
        "  accumulate_steps: Input should be greater than or equal to 1",
    ]
    assert "Traceback" not in proc.stderr and "errors.pydantic.dev" not in proc.stderr


# ---------------------------------------------------------------- run length and warmup (issue 12, items 8 and 9)


def revalidated(config: PretrainConfig) -> PretrainConfig:
    """What a deployment's flow run gets: the config through JSON, every field now given explicitly."""
    return PretrainConfig.model_validate_json(config.model_dump_json())


def test_epochs_given_explicitly_set_the_run_length_instead_of_the_presets_max_steps(tmp_path: Path) -> None:
    assert RUN_PRESETS["tiny"]["max_steps"] is not None
    by_epochs = config_from_args(["--preset", "tiny", "--epochs", "2"])
    assert (by_epochs.max_steps, by_epochs.epochs) == (None, 2.0)
    none = config_from_args(["--preset", "tiny", "--max-steps", "none", "--epochs", "3"])
    assert (none.max_steps, none.epochs) == (None, 3.0)
    assert config_from_args(["--preset", "tiny", "--max-steps", "none"]).max_steps is None
    api = PretrainConfig(preset="demo", epochs=0.5)
    assert (api.max_steps, api.epochs) == (None, 0.5)
    # A run length on the command line replaces the one in the YAML file.
    config_file = tmp_path / "run.yaml"
    config_file.write_text("preset: tiny\nmax_steps: 7\n")
    assert config_from_args(["--config", str(config_file), "--epochs", "2"]).max_steps is None
    assert config_from_args(["--config", str(config_file)]).max_steps == 7
    for config in (by_epochs, none, api):
        assert revalidated(config) == config
    # The preset's max_steps stays when no epochs are given; a revalidated config keeps what it had.
    tiny = PretrainConfig(preset="tiny")
    assert tiny.max_steps == RUN_PRESETS["tiny"]["max_steps"] and revalidated(tiny) == tiny


def test_both_run_lengths_on_the_command_line_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--preset", "tiny", "--max-steps", "50", "--epochs", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-steps" in err and "--epochs" in err and "--max-steps none" in err


@pytest.mark.parametrize("preset", ["tiny", "demo"])
@pytest.mark.parametrize("max_steps", [1, 2, 3, 4, 5])
def test_a_presets_warmup_is_clamped_to_a_short_run(preset: str, max_steps: int) -> None:
    from flows.pretrain_config import ConfigNote

    with pytest.warns(ConfigNote, match=rf"warmup_steps={RUN_PRESETS[preset]['warmup_steps']} of preset"):
        config = PretrainConfig(preset=preset, max_steps=max_steps)
    assert config.warmup_steps == max_steps - 1
    assert revalidated(config) == config
    with pytest.warns(ConfigNote):
        cli = config_from_args(["--preset", preset, "--max-steps", str(max_steps)])
    assert (cli.max_steps, cli.warmup_steps) == (max_steps, max_steps - 1)


def test_a_warmup_the_user_gave_is_never_changed() -> None:
    with pytest.raises(ValidationError, match="warmup_steps=3 must be smaller than max_steps=3"):
        PretrainConfig(preset="tiny", max_steps=3, warmup_steps=3)
    with pytest.raises(ValidationError, match="warmup_steps"):
        config_from_args(["--preset", "tiny", "--max-steps", "3", "--warmup-steps", "3"])
    assert PretrainConfig(preset="tiny", max_steps=3, warmup_steps=2).warmup_steps == 2
    # A preset warmup that fits the run is kept as it is.
    assert PretrainConfig(preset="tiny", max_steps=6).warmup_steps == RUN_PRESETS["tiny"]["warmup_steps"]


def test_a_user_error_inside_a_task_ends_the_output_alone_with_exit_code_2(tmp_path: Path) -> None:
    """A bad input found by a task (here a data directory without text files): Prefect logs its traceback,
    and the command line ends with the one line that matters, without Python's traceback after it."""
    import re

    empty = tmp_path / "corpus"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pretrain", "--preset", "tiny", "--data", str(empty)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1] == (
        f"error: Directory {empty} holds no files with a known extension ('.txt', '.md', '.py', '.jsonl', "
        "'.json', '.parquet', '.jsonl.gz', '.jsonl.zst'); point data at text files."
    ), proc.stderr[-3000:]
    log_line = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| ")
    last_log = max(i for i, line in enumerate(lines) if log_line.match(line))
    assert lines[last_log + 1 :] == lines[-1:], "only the message may follow Prefect's logs"
    assert "Traceback" in proc.stderr  # still in Prefect's logs


def test_model_overrides_given_add_to_the_presets() -> None:
    config = PretrainConfig(preset="demo", model_overrides={"num_hidden_layers": 4, "qk_norm": False})
    model = config.llama_config()
    assert model.num_hidden_layers == 4 and not model.qk_norm and model.zero_init_output_projections
    assert PretrainConfig(preset="demo").llama_config().qk_norm


def test_init_from_takes_the_parents_architecture(tmp_path: Path) -> None:
    corpus = tmp_path / "new_docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text("text")
    cfg = config_from_args(
        ["--preset", "demo", "--init-from", "models:/llamaflow-demo@champion", "--data", str(corpus)]
    )
    assert (cfg.init_from, cfg.data, cfg.model_overrides) == (
        "models:/llamaflow-demo@champion",
        str(corpus),
        {},
    )
    parent = get_preset("tiny", vocab_size=300)
    own = cfg.model_copy(update={"model_overrides": {"max_position_embeddings": 4096}})
    assert own.llama_config(parent, vocab_size=320).to_dict() == {
        **parent.to_dict(),
        "vocab_size": 320,
        "max_position_embeddings": 4096,
    }
