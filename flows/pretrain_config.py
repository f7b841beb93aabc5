"""PretrainConfig: the one validated parameter of the `pretrain` flow.

It is a `TrainSettings` (every training option, defined once in tasks/training/settings.py) and a
`DataSettings` (every corpus option, tasks/data/settings.py) plus the
options of the other stages. A named run preset fills in defaults; every field given explicitly
overrides it. Validation happens here, before any task runs, so bad input costs nothing.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from flows.demo_shapes import FP32_DEMO_BUDGET, FP32_DEMO_SHAPE, resolve_demo_shape
from model import LlamaConfig
from tasks.data.settings import DataSettings
from tasks.refs import Promotion
from tasks.tokenize import SAMPLE_BYTES
from tasks.training.settings import TrainSettings

RUN_PRESETS: dict[str, dict[str, Any]] = {
    # Tests and smoke runs: about a minute on 2 CPU cores, cold compile included.
    "tiny": {
        "model": "tiny",
        "vocab_size": 2048,
        "seq_len": 128,
        "micro_batch_size": 8,
        "accumulate_steps": 2,
        "max_steps": 30,
        "lr": 3e-3,
        "warmup_steps": 5,
        "checkpoint_every": 10,
        "eval_max_blocks": 64,
        "sample_max_new_tokens": 24,
        "experiment": "llamaflow-tiny",
        "model_name": "llamaflow-tiny",
    },
    # The README's main job: a 4.2M-parameter Llama (the `demo` model, 2 x 320, a 4,096-token vocabulary and
    # a 0.7M value-embedding table) on the stdlib corpus, in 7-10 minutes on 2 CPU cores. Every choice was
    # measured against the alternatives at equal wall time (benchmarks/README.md §6): Muon for the hidden
    # matrices (0.03 at this length: 1.190 bits per byte against 1.1997 at 0.04), AdamW for the (tied)
    # embedding (2e-2 until round 8) and 4e-3 for the norms, warmup-stable-decay to zero over the last 40%, 4,096-token
    # steps of 128-token sequences (micro 16 x accumulation 2), QK-norm, zero-initialised output projections,
    # value embeddings and AdamW beta1 0.8 (round 6). Round 7: vocabulary 4,096 instead of 8,192 halves the
    # tied head, the largest matmul of this model (a step 0.72-0.80x as long), for 9% more tokens per byte;
    # 1,450 of its steps reach 8,192's 1,350-step quality (1.1883 against 1.1875). 2,048 loses (+0.042).
    # Round 8: the embedding at 2.8e-2 (each row of the smaller vocabulary gets more updates) reaches that
    # quality in ~1,300 steps (1.1958 at 1,250, 1.1728 at 1,450); bigram hash embeddings help only within the
    # first epoch (-0.037 at 725 steps, -0.002 at 1,100) and are left off. Round 10: 4 Newton-Schulz
    # iterations instead of 5 (1.19018 against 1.19021; 3 lose: 1.2154) and Muon weight decay 0.05 (1.1782
    # at 1,300 steps; 0.02: 1.1816, 0.1: 1.1842), spent on 100 fewer steps (1.1918 at 1,200, 1.2035 at 1,100).
    "demo": {
        "model": "demo",
        "model_overrides": {"qk_norm": True, "zero_init_output_projections": True, "value_embeds": 1},
        "vocab_size": 4096,
        "seq_len": 128,
        "micro_batch_size": 16,
        "accumulate_steps": 2,
        "max_steps": 1200,
        "betas": (0.8, 0.95),
        "optimizer": "muon",
        "muon_lr": 0.03,
        "muon_ns_steps": 4,
        "muon_weight_decay": 0.05,
        "embed_lr": 2.8e-2,
        "lr": 4e-3,
        "schedule": "wsd",
        "decay_fraction": 0.4,
        "min_lr_ratio": 0.0,
        "warmup_steps": 12,
        "checkpoint_every": 350,
        # Every held-out block (the first ones are easier text: a partial score would flatter the model).
        "eval_max_blocks": None,
        "sample_max_new_tokens": 48,
        "experiment": "llamaflow-demo",
        "model_name": "llamaflow-demo",
    },
    # One GPU: GPT-2-small scale. Not runnable in useful time on a CPU.
    "125m": {
        "model": "125m",
        "vocab_size": 32000,
        "seq_len": 1024,
        "micro_batch_size": 16,
        "accumulate_steps": 8,
        "max_steps": 5000,
        "lr": 6e-4,
        "warmup_steps": 200,
        "checkpoint_every": 500,
        "eval_max_blocks": 512,
        "experiment": "llamaflow-125m",
        "model_name": "llamaflow-125m",
    },
}


class ConfigNote(UserWarning):
    """A value the preset gave was adapted to what the user gave (the command line prints these)."""


def _check_init_from(source: str) -> None:
    """Cheap syntax checks before any task runs (the store and the files are checked when resolving)."""
    from tasks.init_from.hf_source import looks_like_hub_id

    if source.startswith(("models:/", "runs:/")) or Path(source).expanduser().exists():
        return
    if not looks_like_hub_id(source):
        raise ValueError(
            f"init_from={source!r} does not exist: give an existing checkpoint directory, .safetensors file or "
            "Hugging Face directory, models:/NAME@ALIAS, models:/NAME/VERSION, models:/m-ID, runs:/RUN_ID, or a "
            "hub id ORG/NAME"
        )


class PretrainConfig(TrainSettings, DataSettings):
    """Everything a pretraining run needs: the training options of `TrainSettings`, the corpus options of
    `DataSettings` and those of the other stages. `preset` fills defaults; explicit values win.

    Two preset values give way to what the user gave: `epochs` given explicitly (without `max_steps`)
    drops the preset's `max_steps`, so epochs set the run length; and the preset's `warmup_steps` is
    clamped to `max_steps - 1` when the user's `max_steps` is shorter (a ConfigNote says so). A warmup
    the user gave is never changed: one that does not fit is an error.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: Literal["tiny", "demo", "125m"] = Field(
        "demo", description="Named defaults: tiny (tests), demo (main job), 125m (one GPU)"
    )
    demo_shape: Literal["auto", "preset", "2x320-b32", "2x320-b16", "2x256-b16", "2x192-b16"] = Field(
        "auto",
        description="The demo's model and batch shape: auto is the preset's where the CPU or GPU has bf16 in "
        f"hardware, and on a CPU without (fp32) {FP32_DEMO_SHAPE} (unless model or batch fields are given) within "
        f"time_budget {FP32_DEMO_BUDGET} (unless max_steps or epochs are); preset, or a measured shape by name",
    )
    # data (the corpus options are those of DataSettings, tasks/data/settings.py)
    tokenizer: str | None = Field(
        None,
        description="Existing tokenizer.json to use instead of training one (with init_from: one that "
        "extends the parent's, see resize_embeddings)",
    )
    tokenizer_sample_bytes: int | None = Field(
        SAMPLE_BYTES,
        ge=1,
        description="The BPE trains on at most this many bytes of the train split, a deterministic sample spread "
        "over it (default 256 MiB; none: all of it)",
    )
    vocab_size: int = Field(
        8192,
        ge=260,
        le=1 << 20,
        description="BPE vocabulary size (also the model's); with init_from, the parent's",
    )
    seq_len: int = Field(256, ge=2, description="Tokens per training sequence")
    # model
    model: str = Field(
        "demo",
        description="Model preset: tiny, demo, small, 125m, 350m, 1b, 7b; with init_from, the parent's",
    )
    model_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="LlamaConfig fields to override (with init_from: applied to the parent's architecture)",
    )
    init_from: str | None = Field(
        None,
        description="Start a NEW run from these weights, with their tokenizer and architecture: "
        "models:/NAME@ALIAS or models:/NAME/VERSION (resolved once, at the start), models:/m-ID, "
        "runs:/RUN_ID[/NAME], a checkpoint directory or .safetensors file, a Hugging Face Llama directory, "
        "or a hub id (ORG/NAME, from the local HF cache). New optimizer, schedule and data position; "
        "resuming a checkpoint_dir continues a run instead",
    )
    resize_embeddings: bool = Field(
        False,
        description="With init_from and a `tokenizer` that adds tokens to the parent's: grow the embedding "
        "to the tokenizer's size, new rows the mean of the old (otherwise a larger tokenizer is an error)",
    )
    # init_optimizer (issue 42 item 7)
    init_optimizer: bool = Field(
        False,
        description="With init_from: start with the parent's optimizer state (moments and step counts, from "
        "its training checkpoint) instead of a new one; the same optimizer and parameter shapes, or an error",
    )
    # checkpoints
    checkpoint_dir: str | None = Field(
        None, description="Where checkpoints go; reusing one resumes it (default: a new run directory)"
    )
    train_retries: int = Field(1, ge=0, description="Prefect retries of the train task; each retry resumes")
    placement: Literal["local", "deployment"] = Field(
        "local",
        description="local: train in this flow run; deployment: run the train deployment on the GPU pool",
    )
    train_deployment: str = Field(
        "remote-train/gpu", description="Deployment (FLOW/NAME) that trains when placement=deployment"
    )
    # evaluation
    eval_max_blocks: int | None = Field(
        256, ge=1, description="Validation blocks scored (the first N, fixed); none: every held-out block"
    )
    num_samples: int = Field(
        4, ge=0, le=6, description="Text samples generated after training (up to 6 fixed prompts)"
    )
    sample_max_new_tokens: int = Field(48, ge=1)
    # tracking and registry
    experiment: str = Field("llamaflow", description="MLflow experiment")
    run_name: str | None = Field(None, description="MLflow run name (default: the Prefect flow run's name)")
    model_name: str = Field("llamaflow", description="MLflow registered model name")
    register_version: bool = Field(
        True,
        description="Register the trained model as a version of model_name (false: the run and its logged "
        "checkpoints only, as a sweep's trials)",
    )
    alias: str = Field("champion", description="Alias moved to the new version only when it is better")
    promotion: Promotion = Field(
        "if_better",
        description="When the alias moves: if_better (lower bits per byte than the champion); "
        "if_better_or_incomparable (also when the champion cannot be compared: its files are gone, it is not a "
        "llamaflow model, it cannot score this text); always (forced; both numbers are still recorded)",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        preset = values.get("preset", "demo")
        if preset not in RUN_PRESETS:
            raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(RUN_PRESETS)}")
        merged = {**RUN_PRESETS[preset], **values}
        if values.get("init_from") is not None:
            # The architecture and vocabulary are the parent's: the preset's do not apply.
            given = [name for name in ("model", "vocab_size") if name in values]
            if given:
                raise ValueError(
                    f"init_from takes the architecture and vocabulary from {values['init_from']!r}, so "
                    f"{' and '.join(given)} cannot be set with it: drop {', '.join(given)} (added tokens: "
                    "tokenizer + resize_embeddings; other architecture changes: model_overrides)"
                )
            for name in ("model", "vocab_size", "model_overrides"):
                if name not in values:
                    merged.pop(name, None)
        elif isinstance(
            values.get("model_overrides"), dict
        ):  # added to the preset's (demo sets qk_norm there)
            merged["model_overrides"] = {
                **RUN_PRESETS[preset].get("model_overrides", {}),
                **values["model_overrides"],
            }
        if "epochs" in values and "max_steps" not in values:
            merged["max_steps"] = None  # the epochs given set the run length, not the preset's max_steps
        resolve_demo_shape(values, merged)
        if values.get("time_budget") is not None:
            if "max_steps" not in values and "epochs" not in values:
                merged["max_steps"] = None  # the budget sets the run length, not the preset's max_steps
            elif "epochs" in values and "max_steps" not in values:
                merged["time_budget"] = None
                warnings.warn(
                    f"time_budget={values['time_budget']} not used: epochs={values['epochs']} sets the run length",
                    ConfigNote,
                    stacklevel=2,
                )
            elif values.get("max_steps") is not None:
                warnings.warn(
                    f"time_budget={values['time_budget']} not used: max_steps={values['max_steps']} sets the run "
                    "length",
                    ConfigNote,
                    stacklevel=2,
                )
        warmup, max_steps = merged.get("warmup_steps"), merged.get("max_steps")
        preset_warmup_too_long = (
            "warmup_steps" not in values
            and isinstance(warmup, int)
            and isinstance(max_steps, int)
            and 1 <= max_steps <= warmup
        )
        if preset_warmup_too_long:
            merged["warmup_steps"] = max_steps - 1
            warnings.warn(
                f"warmup_steps={warmup} of preset {preset!r} clamped to {max_steps - 1} for max_steps={max_steps}",
                ConfigNote,
                stacklevel=2,
            )
        return merged

    @model_validator(mode="after")
    def _check_consistency(self) -> PretrainConfig:
        from model import get_preset

        if self.init_from is not None:
            _check_init_from(self.init_from)  # the architecture is checked once the parent is resolved
        else:
            if self.resize_embeddings:
                raise ValueError("resize_embeddings grows a parent's embedding: it needs init_from")
            if self.init_optimizer:
                raise ValueError("init_optimizer carries a parent's optimizer state over: it needs init_from")
            try:
                model_cfg = get_preset(self.model, vocab_size=self.vocab_size, **self.model_overrides)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(
                    f"model={self.model!r} with overrides {self.model_overrides}: {err}"
                ) from err
            if self.seq_len > model_cfg.max_position_embeddings:
                raise ValueError(
                    f"seq_len={self.seq_len} is larger than the model's max_position_embeddings="
                    f"{model_cfg.max_position_embeddings}: lower seq_len, or raise it with "
                    f"model_overrides={{'max_position_embeddings': {self.seq_len}}}"
                )
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().exists():
            raise ValueError(
                f"tokenizer={self.tokenizer!r} does not exist: give an existing path, or leave it unset"
            )
        if self.warmup_steps and self.max_steps and self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be smaller than max_steps={self.max_steps}: lower "
                "warmup_steps or raise max_steps"
            )
        return self

    def llama_config(self, parent: LlamaConfig | None = None, vocab_size: int | None = None) -> LlamaConfig:
        """The architecture this run trains: the preset's, or with init_from the parent's (`parent`, with
        model_overrides applied and `vocab_size` rows when the embedding grows for added tokens)."""
        from model import LlamaConfig, get_preset

        if self.init_from is None:
            return get_preset(self.model, vocab_size=self.vocab_size, **self.model_overrides)
        if parent is None:
            raise ValueError("with init_from, the architecture is the parent's: pass its config")
        changes = {**self.model_overrides, **({"vocab_size": vocab_size} if vocab_size else {})}
        return LlamaConfig.from_dict({**parent.to_dict(), **changes})

    def train_settings(self) -> TrainSettings:
        """The training options alone: the object the train task, a train deployment and the engine take."""
        return TrainSettings.model_validate(self.model_dump(include=set(TrainSettings.model_fields)))


def describe_shape(config: PretrainConfig) -> str:
    """Which model and batch shape trains, and why (the run summary's line)."""
    batch = f"{config.micro_batch_size} x {config.accumulate_steps} x {config.seq_len} tokens per step"
    if config.init_from is not None:
        return f"the architecture of {config.init_from}, {batch}"
    model = config.llama_config()
    what = f"{model.num_hidden_layers} x {model.hidden_size}, vocabulary {model.vocab_size}, {batch}"
    if config.demo_shape == "preset":
        return f"{what} (preset {config.preset})"
    return (
        f"{what} (demo_shape {config.demo_shape}: this CPU has no bf16 in hardware, so the demo trains fp32 and "
        "takes this smaller shape with more, cheaper steps within its time budget; benchmarks/README.md)"
    )
