"""Weights on disk as safetensors: always the plain module's state dict, never a pickle."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from model.atomic import atomic_file
from model.config import LlamaConfig
from model.llama import LlamaForPretraining

WEIGHTS_FILE = "model.safetensors"
SHARDS_DIR = "model_shards"  # a sharded checkpoint's slices instead (tasks/training/checkpoint_weights.py)
CONFIG_FILE = "config.json"
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")
COMPILED_MODEL_ERROR = (
    "load weights into the plain module before torch.compile "
    "(call load_weights(model, ...) then torch.compile(model))"
)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile (`_orig_mod`) and DistributedDataParallel (`.module`) wrappers.

    FSDP2 (`fully_shard`) shards a module in place: it has no wrapper to strip, but its parameters are
    DTensor shards (see `save_weights`).
    """
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        else:
            return model


def is_compiled(model: nn.Module) -> bool:
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or hasattr(model, "_orig_mod")


def has_tied_head(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False)) and hasattr(model, "lm_head")


def weights_metadata(model: nn.Module) -> dict[str, str]:
    """The safetensors metadata our weight files carry: the format, and the model config as JSON."""
    meta = {"format": "pt"}
    config = getattr(unwrap(model), "config", None)
    if config is not None and hasattr(config, "to_dict"):
        meta["config"] = json.dumps(config.to_dict())
    return meta


def save_weights(
    model: nn.Module,
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
    *,
    state: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write the unwrapped module's state dict to `path` as safetensors (atomically).

    A tied output head is stored once (as the embedding). The model config, if any, goes into the file's
    metadata under "config" as JSON. `state` replaces the module's own state dict: the whole state dict
    gathered from a sharded (FSDP2) module, whose own parameters are only this rank's shards.
    """
    plain = unwrap(model)
    state = dict(plain.state_dict() if state is None else state)
    sharded = sorted(name for name, t in state.items() if _is_sharded(t))
    if sharded:
        raise ValueError(
            f"save_weights got sharded tensors ({sharded[:3]}...): the module is sharded (FSDP2). Gather its "
            "whole state dict on one rank first (torch.distributed.checkpoint.state_dict.get_model_state_dict "
            "with StateDictOptions(full_state_dict=True, cpu_offload=True)) and pass it as state="
        )
    if has_tied_head(plain):
        state.pop("lm_head.weight", None)
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    meta = {**weights_metadata(plain), **(metadata or {})}
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return Path(path)


def _is_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor: a distributed tensor, of which each rank holds a part."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def weights_file(path: str | os.PathLike) -> Path:
    """A .safetensors file, or a directory holding `model.safetensors` → that file (no pickles, ever)."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / WEIGHTS_FILE).is_file() and (path / SHARDS_DIR).is_dir():
            raise FileNotFoundError(
                f"{path} is a sharded (FSDP2) checkpoint without {WEIGHTS_FILE}: write it from the shards with "
                f"`python -m tasks.training.consolidate {path}`"
            )
        path = path / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no weights at {path}: give a checkpoint directory holding {WEIGHTS_FILE}, or the file itself"
        )
    if path.suffix != ".safetensors":
        raise ValueError(
            f"{path} is not a .safetensors file; only safetensors weights are loaded (no pickles)"
        )
    return path


def load_weights(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a safetensors state dict into a plain (not yet compiled) module, strictly; returns the module.

    `path` is a .safetensors file or a directory holding `model.safetensors`.
    """
    if is_compiled(model):
        raise TypeError(COMPILED_MODEL_ERROR)
    path = weights_file(path)
    device = next(unwrap(model).parameters()).device
    saved_config = read_metadata(path).get("config")
    hint = f" The file was saved from config {saved_config}." if saved_config else ""
    load_state(model, load_file(str(path), device=str(device)), source=str(path), hint=hint)
    return model


def load_state(model: nn.Module, tensors: Mapping[str, torch.Tensor], *, source: str, hint: str = "") -> None:
    """Load `tensors` (wrapper prefixes stripped, a tied head filled in) into the plain module, strictly,
    with an error that names every mismatch."""
    plain = unwrap(model)
    state = {}
    for name, tensor in tensors.items():
        for prefix in _WRAPPER_PREFIXES:
            while name.startswith(prefix):
                name = name[len(prefix) :]
        state[name] = tensor
    if has_tied_head(plain) and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]

    check_fit(
        {k: t.shape for k, t in plain.state_dict().items()},
        {k: t.shape for k, t in state.items()},
        source=source,
        hint=hint,
    )
    plain.load_state_dict(state, strict=True)


def check_fit(
    expected: Mapping[str, torch.Size], found: Mapping[str, torch.Size], *, source: str, hint: str = ""
) -> None:
    """Raise a ValueError naming every missing, unexpected and wrongly shaped tensor of `found`."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong_shape = [
        f"{k}: file {tuple(found[k])} vs model {tuple(expected[k])}"
        for k in expected
        if k in found and tuple(found[k]) != tuple(expected[k])
    ]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"weights in {source} do not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shapes {wrong_shape[:5]}. Build the model with the config the weights were saved with."
            + hint
        )


def stored_shapes(path: str | os.PathLike) -> dict[str, torch.Size]:
    """Name -> shape of every tensor in a safetensors file, read from its header (no tensor data)."""
    with safe_open(str(path), framework="pt") as f:
        return {name: torch.Size(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (not iterable)


def load_pretrained(
    config: LlamaConfig | Mapping[str, Any] | str | os.PathLike,
    weights: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    *,
    device: str | torch.device = "cpu",
) -> LlamaForPretraining:
    """The plain (uncompiled) model of `config` holding `weights`: the one way every part of llamaflow
    builds a model from saved weights. Compile it afterwards if wanted, never before.

    `config`: a LlamaConfig, its dict, a `config.json` or the directory holding one. `weights`: a
    .safetensors file, a directory holding `model.safetensors`, or a state dict; by default the
    directory of `config`. The parameters are allocated once, on `device`, without a random init.
    """
    if not isinstance(config, LlamaConfig):
        if not isinstance(config, Mapping):
            path = Path(config).expanduser()
            if weights is None:
                weights = path if path.is_dir() else path.parent
            config = json.loads((path / CONFIG_FILE if path.is_dir() else path).read_text())
        config = LlamaConfig.from_dict(dict(config))
    if weights is None:
        raise ValueError("load_pretrained needs weights when the config is not a path")
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    model.to_empty(device=device)
    if isinstance(weights, Mapping):
        load_state(model, weights, source="the given state dict")
    else:
        load_weights(model, weights)
    return model


# Parameters with one row per token id (a tied output head is stored as the embedding).
_ROW_PER_TOKEN = ("model.embed_tokens.weight", "lm_head.weight")
_ROW_PER_TOKEN_PREFIXES = ("model.value_embeds.",)


def grow_rows(state: Mapping[str, torch.Tensor], old: int, new: int) -> dict[str, torch.Tensor]:
    """`state` with every per-token table grown from `old` to `new` rows, each new row the mean of the old."""
    grown = dict(state)
    for name, tensor in state.items():
        per_token = name in _ROW_PER_TOKEN or name.startswith(_ROW_PER_TOKEN_PREFIXES)
        if per_token and tensor.shape[0] == old and new > old:
            mean = tensor.float().mean(dim=0, keepdim=True).to(tensor.dtype)
            grown[name] = torch.cat([tensor, mean.expand(new - old, *tensor.shape[1:])])
    return grown
