"""Llama model configuration with Hugging Face field names, size presets and cost arithmetic."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class LlamaConfig:
    """Architecture of a Llama decoder; field names and meanings follow `transformers.LlamaConfig`.

    `rope_scaling` is None (plain RoPE) or the Llama 3 form
    `{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}`.
    """

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    # Not in Hugging Face's Llama: QK-norm (parameter-free RMS normalisation of each query and key head
    # before RoPE) and value embeddings change the function, so export_hf refuses them; zero-initialised
    # output projections (o_proj, down_proj) only change the initial weights.
    qk_norm: bool = False
    zero_init_output_projections: bool = False
    # Value embeddings (as in modded-nanogpt): `value_embeds` extra token tables of width
    # num_key_value_heads * head_dim; table i is mixed into the attention values of layer i and of layer
    # L - value_embeds + i through a learned 2-element gate per layer. 0 = off.
    value_embeds: int = 0
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; choose divisible sizes or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate()

    def validate(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads} (grouped-query attention shares each key/value head among a "
                "whole group of query heads)"
            )
        if (
            not isinstance(self.value_embeds, int)
            or isinstance(self.value_embeds, bool)
            or not 0 <= 2 * self.value_embeds <= self.num_hidden_layers
        ):
            raise ValueError(
                f"LlamaConfig.value_embeds must be an integer from 0 to num_hidden_layers // 2 "
                f"({self.num_hidden_layers // 2}): each table feeds one of the first and one of the last layers; "
                f"got {self.value_embeds!r}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0 or self.initializer_range <= 0:
            raise ValueError("rope_theta, rms_norm_eps and initializer_range must be positive")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type in (None, "default"):
                self.rope_scaling = None
            elif rope_type != "llama3":
                raise ValueError(
                    f"rope_scaling type {rope_type!r} is not supported; use None (plain RoPE) or 'llama3'"
                )
            else:
                missing = [k for k in _LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
                if missing:
                    raise ValueError(f"llama3 rope_scaling lacks {missing}; give all of {_LLAMA3_ROPE_KEYS}")
                self.rope_scaling = {
                    "rope_type": "llama3",
                    **{k: self.rope_scaling[k] for k in _LLAMA3_ROPE_KEYS},
                }

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def value_embed_index(self, layer_idx: int) -> int | None:
        """The value-embedding table that feeds layer `layer_idx`, or None."""
        first_of_last = self.num_hidden_layers - self.value_embeds
        if layer_idx < self.value_embeds:
            return layer_idx
        if layer_idx >= first_of_last:
            return layer_idx - first_of_last
        return None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if data["rope_scaling"] is not None:
            data["rope_scaling"] = dict(data["rope_scaling"])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        """Build from our own `to_dict()` or a Hugging Face Llama `config.json` (unknown keys are kept in `extra`)."""
        data = dict(data)
        rope_parameters = data.pop("rope_parameters", None)
        if rope_parameters and "rope_scaling" not in data:
            rope_parameters = dict(rope_parameters)
            data.setdefault("rope_theta", rope_parameters.pop("rope_theta", 10000.0))
            data["rope_scaling"] = rope_parameters
        if data.get("bigram_embeds"):  # written before the option left the model: its weights would not fit
            raise ValueError(
                f"this model has bigram hash embeddings (bigram_embeds={data['bigram_embeds']}), which this "
                "llamaflow's model does not: load it with the llamaflow version that trained it"
            )
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)

    def replace(self, **overrides: Any) -> LlamaConfig:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown LlamaConfig fields {sorted(unknown)}")
        data = self.to_dict()
        data.update(overrides)
        # head_dim was derived from the old sizes: derive it again unless given.
        if ("num_attention_heads" in overrides or "hidden_size" in overrides) and "head_dim" not in overrides:
            data["head_dim"] = None
        return LlamaConfig(**data)


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # For tests: runs in milliseconds.
    "tiny": dict(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    # ~4.8M parameters with vocab 8192 (3.5M at the main job's 4096): readable text on 2 CPU cores in
    # minutes. Wide and shallow because at a main job's budget (~3-4M tokens) 2 x 320 learned more per
    # second than 3 or 4 x 320, 4 x 384 and 6 x 256 (benchmarks/README.md §6).
    "demo": dict(
        vocab_size=8192,
        hidden_size=320,
        intermediate_size=816,
        num_hidden_layers=2,
        num_attention_heads=10,
        num_key_value_heads=5,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    # ~34M parameters: large enough that CPU time goes to matmuls rather than overhead.
    "small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "125m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    "350m": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    # Llama 3.2 1B shape with a 32k vocabulary.
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING,
        tie_word_embeddings=True,
    ),
    # Llama 2 7B shape (6.74B parameters): for GPUs only, with data_parallel="fsdp" (docs/scaling.md).
    "7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}


def get_preset(name: str, **overrides: Any) -> LlamaConfig:
    """The named preset (`tiny, demo, small, 125m, 350m, 1b, 7b`) with any fields overridden, e.g. `vocab_size`."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return (
        LlamaConfig(**MODEL_PRESETS[name]).replace(**overrides)
        if overrides
        else LlamaConfig(**MODEL_PRESETS[name])
    )


def _config_param_counts(config: LlamaConfig) -> tuple[int, int]:
    """(total, non-embedding) parameter counts computed from the shapes alone."""
    h, hd = config.hidden_size, config.head_dim
    attn = (
        h * hd * (config.num_attention_heads + 2 * config.num_key_value_heads)
        + config.num_attention_heads * hd * h
    )
    mlp = 3 * h * config.intermediate_size
    per_layer = attn + mlp + 2 * h
    gates = 2 * sum(config.value_embed_index(i) is not None for i in range(config.num_hidden_layers))
    non_embedding = config.num_hidden_layers * per_layer + h + gates
    embedding = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    embedding += config.value_embeds * config.vocab_size * config.num_key_value_heads * hd
    return non_embedding + embedding, non_embedding


def count_params(config_or_model: LlamaConfig | nn.Module, non_embedding: bool = False) -> int:
    """Number of parameters; `non_embedding=True` leaves out the token embeddings (value embeddings
    included) and the output head.

    A model's shared (tied) tensors are counted once.
    """
    if isinstance(config_or_model, LlamaConfig):
        total, non_emb = _config_param_counts(config_or_model)
        return non_emb if non_embedding else total
    model = getattr(config_or_model, "_orig_mod", config_or_model)
    seen: set[int] = set()
    count = 0
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if non_embedding and (
            name.endswith(("embed_tokens.weight", "lm_head.weight")) or ".value_embeds." in name
        ):
            continue
        count += param.numel()
    return count


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B style.

    6·N + 12·L·H·d·T, where N counts every weight used in a matmul: the non-embedding parameters plus the
    output head (vocab × hidden, whether tied or not, since the matmul is done either way), and the second
    term is attention over a context of T = seq_len (H heads of size d, L layers).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    n_matmul = count_params(config, non_embedding=True) + config.vocab_size * config.hidden_size
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return float(6 * n_matmul + attention)


def describe_presets(
    seq_len: int = 1024, vocab_size: int | None = None, print_table: bool = False
) -> list[dict]:
    """One row per preset: name, total and non-embedding parameters, training FLOPs/token at `seq_len`."""
    rows = []
    for name in MODEL_PRESETS:
        config = get_preset(name) if vocab_size is None else get_preset(name, vocab_size=vocab_size)
        rows.append(
            {
                "name": name,
                "params": count_params(config),
                "non_embedding_params": count_params(config, non_embedding=True),
                "flops_per_token": flops_per_token(config, seq_len),
                "vocab_size": config.vocab_size,
            }
        )
    if print_table:
        print(f"{'preset':<8}{'vocab':>8}{'params':>16}{'non-emb':>16}{f'GFLOP/token@{seq_len}':>22}")
        for row in rows:
            print(
                f"{row['name']:<8}{row['vocab_size']:>8}{row['params']:>16,}{row['non_embedding_params']:>16,}"
                f"{row['flops_per_token'] / 1e9:>22.3f}"
            )
    return rows


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """Float32 inverse frequencies of RoPE, with Llama 3 frequency scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
