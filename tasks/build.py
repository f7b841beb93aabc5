"""build_model: the initial weights of a run, written once and passed on as a ModelRef.

From scratch: the architecture's random initialisation from the seed. From a parent (`init_from`, resolved
by `tasks.init_from` to a ParentRef): the parent's weights, loaded strictly into the plain module of
`model_config` (the parent's architecture, maybe with more embedding rows for added tokens: those rows
start as the mean of the parent's, `model.weights.grow_rows`). Compilation happens only in the
processes that train or evaluate, always after loading (`model.load_pretrained`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from model import LlamaConfig, LlamaForPretraining, count_params, save_weights
from model.atomic import atomic_dir
from model.weights import CONFIG_FILE, WEIGHTS_FILE, grow_rows, load_state
from tasks.home import cache_dir
from tasks.refs import ModelRef, ParentRef


def parent_config(parent: ParentRef) -> LlamaConfig:
    return LlamaConfig.from_dict(json.loads((Path(parent.path) / CONFIG_FILE).read_text()))


def build_model(model_config: LlamaConfig, *, seed: int, parent: ParentRef | None = None) -> ModelRef:
    """Initialise the model (or load the parent's weights into it) once and store config + weights under
    the cache, keyed by the config, the seed and the parent's weights."""
    key = json.dumps(
        {"config": model_config.to_dict(), "seed": seed, "init": parent.weights_sha256 if parent else None},
        sort_keys=True,
    )
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_dir() / "models" / fingerprint
    if not (out / WEIGHTS_FILE).is_file():
        torch.manual_seed(seed)
        model = LlamaForPretraining(model_config)
        if parent is not None:
            weights = Path(parent.path) / WEIGHTS_FILE
            state = load_file(str(weights))
            rows = parent_config(parent).vocab_size
            hint = f" The parent's config is {parent_config(parent).to_dict()}."
            load_state(
                model, grow_rows(state, rows, model_config.vocab_size), source=parent.pinned, hint=hint
            )
        # Another run may build the same model at once: the first rename wins, both are identical.
        with atomic_dir(out) as staged:
            save_weights(model, staged.path / WEIGHTS_FILE)
            (staged.path / CONFIG_FILE).write_text(json.dumps(model_config.to_dict(), indent=2))
    return ModelRef(
        path=str(out), fingerprint=fingerprint, n_params=count_params(model_config), parent=parent
    )
