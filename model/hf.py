"""Hugging Face interchange: a directory that `transformers.LlamaForCausalLM.from_pretrained` loads, and back.

Our modules differ from Hugging Face's only in two fused matmuls: `qkv_proj` is q_proj, k_proj and v_proj
stacked along the output dimension (in that order), and `gate_up_proj` is gate_proj then up_proj. RoPE is
the rotate-half form Hugging Face uses, so q/k weights need no permutation between the two. (Meta's original
checkpoints use interleaved pairs; converting those is the job of transformers' conversion script.)

transformers itself is not needed here: config.json and tokenizer_config.json are written by hand.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from model.atomic import atomic_file
from model.config import LlamaConfig
from model.llama import LlamaForPretraining
from model.weights import load_pretrained, unwrap

_BOS_NAMES = ("<|bos|>", "<s>", "<|begin_of_text|>", "<bos>")
_EOS_NAMES = ("<|eos|>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
_UNSUPPORTED = {"attention_bias": True, "mlp_bias": True}


def _to_hf_state(model: LlamaForPretraining) -> dict[str, torch.Tensor]:
    config = model.config
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
            out[prefix + "q_proj.weight"], out[prefix + "k_proj.weight"], out[prefix + "v_proj.weight"] = (
                q,
                k,
                v,
            )
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = tensor.chunk(2, dim=0)
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        else:
            out[name] = tensor
    return {k: v.detach().contiguous() for k, v in out.items()}


def _from_hf_state(hf: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        state[attn + "qkv_proj.weight"] = torch.cat(
            [hf.pop(attn + "q_proj.weight"), hf.pop(attn + "k_proj.weight"), hf.pop(attn + "v_proj.weight")]
        )
        state[mlp + "gate_up_proj.weight"] = torch.cat(
            [hf.pop(mlp + "gate_proj.weight"), hf.pop(mlp + "up_proj.weight")]
        )
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    state.update(hf)
    return state


# LlamaConfig fields Hugging Face's Llama does not have (export_hf refuses a model that needs them).
_LLAMAFLOW_ONLY = (
    "qk_norm",
    "zero_init_output_projections",
    "value_embeds",
)
# Of those, the ones that change the function (export_hf refuses a model that sets them), with what they do.
_NOT_IN_HF_LLAMA = {
    "qk_norm": "normalises queries and keys (qk_norm=True)",
    "value_embeds": "mixes value-embedding tables into its attention values (value_embeds > 0)",
}


def hf_config_dict(config: LlamaConfig, torch_dtype: torch.dtype, special_ids: dict[str, int | None]) -> dict:
    data: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        **{k: v for k, v in config.to_dict().items() if k not in ("rope_scaling", *_LLAMAFLOW_ONLY)},
        # transformers < 5 reads rope_scaling + rope_theta; 5.x reads rope_parameters (and converts the former).
        "rope_scaling": config.rope_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_scaling is None
        else {**config.rope_scaling, "rope_theta": config.rope_theta},
        "torch_dtype": str(torch_dtype).removeprefix("torch."),  # the name before transformers 4.56
        "dtype": str(torch_dtype).removeprefix("torch."),
        "bos_token_id": special_ids.get("bos"),
        "eos_token_id": special_ids.get("eos"),
        "pad_token_id": special_ids.get("pad"),
    }
    return data


def _find_special(tokenizer: Tokenizer, names: tuple[str, ...]) -> str | None:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return next((name for name in names if name in vocab), None)


def export_hf(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    dtype: torch.dtype | None = None,
    base_model: str | None = None,
    card_text: str = "",
) -> Path:
    """Write a Hugging Face Llama checkpoint: config.json, model.safetensors, a model card (README.md, its
    metadata naming `base_model` when the model was trained on from another) and, given a tokenizer
    (a `tokenizers.Tokenizer` or a path to tokenizer.json), tokenizer.json + tokenizer_config.json +
    special_tokens_map.json for `AutoTokenizer`. Special tokens are found by their usual names unless given.
    `dtype` casts the floating-point weights (default: keep the model's dtype). `card_text` is the card's body.
    """
    plain = unwrap(model)
    if not isinstance(plain, LlamaForPretraining):
        raise TypeError(
            f"export_hf expects a LlamaForPretraining (possibly compiled), got {type(plain).__name__}"
        )
    config = plain.config
    for name, what in _NOT_IN_HF_LLAMA.items():
        if getattr(config, name):
            off = "False" if name == "qk_norm" else "0"
            raise ValueError(
                f"this model {what}, which Hugging Face's Llama does not: export_hf would write a different "
                f"model; train with {name}={off} to export"
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    special_tokens: dict[str, str | None] = {"bos": bos_token, "eos": eos_token, "pad": pad_token}
    special_ids: dict[str, int | None] = {}
    if tokenizer is not None:
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = Tokenizer.from_file(str(tokenizer))
        if tokenizer.get_vocab_size(with_added_tokens=True) > config.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but the model's "
                f"vocab_size is {config.vocab_size}; export with the tokenizer the model was trained with"
            )
        for role, names in (("bos", _BOS_NAMES), ("eos", _EOS_NAMES), ("pad", _PAD_NAMES)):
            special_tokens[role] = special_tokens[role] or _find_special(tokenizer, names)
            token = special_tokens[role]
            if token is not None:
                token_id = tokenizer.token_to_id(token)
                if token_id is None:
                    raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
                special_ids[role] = token_id
        _write_tokenizer(tokenizer, out, special_tokens, config.max_position_embeddings)

    tensors = _to_hf_state(plain)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    weights_dtype = next(iter(tensors.values())).dtype
    with atomic_file(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    config_json = hf_config_dict(config, weights_dtype, special_ids)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    generation = {
        k: config_json[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config_json[k] is not None
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "README.md").write_text(model_card(base_model, card_text))
    return out


def model_card(base_model: str | None, body: str = "") -> str:
    """A Hugging Face model card: YAML metadata (the hub reads `base_model` for a model's family tree; a
    model trained further from another is its `finetune`), then the text."""
    meta = ["library_name: transformers", "pipeline_tag: text-generation", "tags:", "- llamaflow"]
    if base_model is not None:
        meta += [f"base_model: {json.dumps(base_model)}", "base_model_relation: finetune"]
    text = body or "A Llama model trained with llamaflow."
    return "---\n" + "\n".join(meta) + "\n---\n\n" + text.rstrip() + "\n"


def _write_tokenizer(tokenizer: Tokenizer, out: Path, special: dict[str, str | None], max_len: int) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    tokens = {f"{role}_token": token for role, token in special.items() if token is not None}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        # Our pipeline adds BOS/EOS itself when it packs documents; the tokenizer does not add them.
        "add_bos_token": False,
        "add_eos_token": False,
        **tokens,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2) + "\n")


def _read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        found = sorted(p.name for p in directory.iterdir())
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {directory} (found {found}); only "
            "safetensors checkpoints are imported (pickled .bin files are refused): re-save with "
            "save_pretrained(..., safe_serialization=True)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[key] = f.get_tensor(key)
    return tensors


def import_hf(directory: str | os.PathLike, dtype: torch.dtype = torch.float32) -> LlamaForPretraining:
    """Load a local Hugging Face Llama checkpoint (config.json + safetensors) as a plain LlamaForPretraining."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} not found; give the directory of a Hugging Face Llama checkpoint"
        )
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") != "llama":
        raise ValueError(f"{directory} holds model_type {raw.get('model_type')!r}; only 'llama' is supported")
    for key, bad in _UNSUPPORTED.items():
        if raw.get(key) == bad:
            raise ValueError(f"{directory}: {key}={bad} is not supported by this Llama implementation")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{directory}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    config = LlamaConfig.from_dict(raw)

    model = load_pretrained(config, _from_hf_state(_read_hf_tensors(directory), config))
    return model.to(dtype) if dtype != torch.float32 else model
