"""build_model: the initial weights of a run, written once and passed on as a ModelRef.

Weights from `init_checkpoint` are loaded into the plain module here; compilation happens only in the
processes that train or evaluate, always after loading (see `load_plain_model`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from prefect import task

from model import LlamaConfig, LlamaForPretraining, count_params, load_weights, save_weights
from tasks.refs import ModelRef
from tasks.settings import cache_dir
from tasks.training.checkpoint import sha256_file

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def resolve_weights(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory or a .safetensors file → the .safetensors file."""
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        p = p / WEIGHTS
    if not p.is_file():
        raise FileNotFoundError(
            f"no weights at {p}: give a checkpoint directory holding {WEIGHTS}, or the file itself"
        )
    if p.suffix != ".safetensors":
        raise ValueError(f"{p} is not a .safetensors file: llamaflow never unpickles weights")
    return p


def load_plain_model(
    model_dir: str | os.PathLike[str], weights: str | os.PathLike[str] | None = None
) -> LlamaForPretraining:
    """The uncompiled model described by `model_dir/config.json`, with weights loaded.

    Callers compile the returned module afterwards if they want to; never the other way round.
    """
    config = LlamaConfig.from_dict(json.loads((Path(model_dir) / CONFIG).read_text()))
    model = LlamaForPretraining(config)
    load_weights(model, resolve_weights(weights if weights is not None else model_dir))
    return model


def build_model(model_config: dict[str, Any], *, seed: int, init_checkpoint: str | None = None) -> ModelRef:
    """Initialise (or load) the model once and store config + weights under the cache."""
    config = LlamaConfig.from_dict(model_config)
    init = resolve_weights(init_checkpoint) if init_checkpoint else None
    key = json.dumps(
        {"config": config.to_dict(), "seed": seed, "init": sha256_file(init) if init else None},
        sort_keys=True,
    )
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_dir() / "models" / fingerprint
    if not (out / WEIGHTS).is_file():
        torch.manual_seed(seed)
        model = LlamaForPretraining(config)
        if init is not None:
            load_weights(model, init)  # a clear error names any shape mismatch
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{fingerprint}-", dir=out.parent))
        save_weights(model, tmp / WEIGHTS)
        (tmp / CONFIG).write_text(json.dumps(config.to_dict(), indent=2))
        try:
            os.rename(tmp, out)
        except OSError:  # another run built the same model first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    n_params = count_params(config)
    return ModelRef(path=str(out), fingerprint=fingerprint, n_params=n_params)


build_model_task = task(build_model, name="build_model")
