"""build_model: the initial weights of a run, written once and passed on as a ModelRef.

Weights from `init_checkpoint` are loaded into the plain module here; compilation happens only in the
processes that train or evaluate, always after loading (`model.load_pretrained`).
"""

from __future__ import annotations

import hashlib
import json

import torch
from prefect import task

from model import LlamaConfig, LlamaForPretraining, count_params, load_weights, save_weights, weights_file
from model.atomic import atomic_dir
from model.weights import CONFIG_FILE, WEIGHTS_FILE
from tasks.home import cache_dir
from tasks.refs import ModelRef
from tasks.training.checkpoint import sha256_file


def build_model(model_config: LlamaConfig, *, seed: int, init_checkpoint: str | None = None) -> ModelRef:
    """Initialise (or load) the model once and store config + weights under the cache."""
    init = weights_file(init_checkpoint) if init_checkpoint else None
    key = json.dumps(
        {"config": model_config.to_dict(), "seed": seed, "init": sha256_file(init) if init else None},
        sort_keys=True,
    )
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_dir() / "models" / fingerprint
    if not (out / WEIGHTS_FILE).is_file():
        torch.manual_seed(seed)
        model = LlamaForPretraining(model_config)
        if init is not None:
            load_weights(model, init)  # a clear error names any shape mismatch
        # Another run may build the same model at once: the first rename wins, both are identical.
        with atomic_dir(out) as staged:
            save_weights(model, staged.path / WEIGHTS_FILE)
            (staged.path / CONFIG_FILE).write_text(json.dumps(model_config.to_dict(), indent=2))
    return ModelRef(path=str(out), fingerprint=fingerprint, n_params=count_params(model_config))


build_model_task = task(build_model, name="build_model")
