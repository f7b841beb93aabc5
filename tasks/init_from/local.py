"""`init_from` a local llamaflow checkpoint: a checkpoint directory (config.json + model.safetensors), or a
`.safetensors` file (its config from the file's metadata or a config.json beside it).

A run directory (step_NNNNNN/ checkpoints inside) is refused with both readings spelled out: resuming it
(`checkpoint_dir`) continues that run with its optimizer, schedule and data position; starting from one
of its checkpoints' weights (`init_from=<run dir>/step_NNNNNN`) is a new run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model.weights import CONFIG_FILE, WEIGHTS_FILE, read_metadata
from tasks.data.errors import data_logger
from tasks.init_from.parent_cache import (
    InitFromError,
    link_or_copy,
    materialize,
    tokenizer_in,
    weights_sha256,
)
from tasks.refs import ParentRef
from tasks.tracking.runs import read_run_record
from tasks.training import checkpoint as ckpt
from tasks.training.checkpoint_weights import whole_weights


def describe_run_dir(run_dir: Path) -> str | None:
    """When `run_dir` is a run directory (checkpoints inside), the sentence that says how to use it."""
    found = ckpt.checkpoint_dirs(run_dir)
    if not found:
        return None
    step, newest = found[-1]
    return (
        f"{run_dir} is a run directory (newest checkpoint {newest.name}). To continue that run where it "
        f"stopped (its optimizer, schedule and data position), resume it: checkpoint_dir={run_dir} without "
        f"init_from. To start a new run from its weights (new optimizer, new schedule with warmup, data from "
        f"the start), point init_from at a checkpoint: init_from={newest}"
    )


def _checkpoint_facts(directory: Path) -> dict[str, Any]:
    """Step, run length and tokens seen of a training checkpoint (nothing for a bare weights directory)."""
    if not (directory / ckpt.STATE_FILE).is_file():
        return {}
    state = ckpt.load_trainer_state(directory)
    return {
        "step": int(state.get("step", 0)),
        "total_steps": int(state.get("total_steps", 0)),
        "tokens_seen": int(state.get("tokens_seen", 0)),
    }


def resolve_local(source: str, path: Path) -> ParentRef:
    path = path.expanduser().resolve()
    if path.is_dir():
        whole_weights(path)  # a sharded run's checkpoint (model_shards/): its model.safetensors, once
        if not (path / WEIGHTS_FILE).is_file():
            hint = describe_run_dir(path)
            if hint is not None:
                raise InitFromError(f"init_from={source!r}: {hint}")
            raise InitFromError(
                f"init_from={source!r}: {path} holds no {WEIGHTS_FILE}; give a checkpoint directory "
                f"(config.json + {WEIGHTS_FILE}), a .safetensors file, a Hugging Face Llama directory, "
                "models:/NAME@ALIAS, runs:/RUN_ID or a hub id"
            )
        weights, directory = path / WEIGHTS_FILE, path
    elif path.suffix == ".safetensors":
        weights, directory = path, path.parent
    else:
        raise InitFromError(
            f"init_from={source!r}: {path} is not a .safetensors file; only safetensors weights are loaded "
            "(no pickles)"
        )
    config_file = directory / CONFIG_FILE
    if config_file.is_file():
        config = json.loads(config_file.read_text())
    elif "config" in (metadata := read_metadata(weights)):
        config = json.loads(metadata["config"])
    else:
        raise InitFromError(
            f"init_from={source!r}: no {CONFIG_FILE} beside {weights.name} and none in its metadata; put the "
            "model's config.json next to the weights"
        )
    facts = _checkpoint_facts(directory)
    if facts and facts["step"] < facts["total_steps"]:
        data_logger().warning(
            f"init_from={source!r} is step {facts['step']} of an unfinished run of {facts['total_steps']} "
            "steps: this starts a NEW run from its weights (new optimizer, schedule with warmup, data from the "
            f"start). To continue that run instead, resume it with checkpoint_dir={directory.parent}"
        )
    # The tokenizer travels beside the weights, or in the run directory of a training checkpoint.
    tokenizer = tokenizer_in(directory) or tokenizer_in(directory.parent)
    digest = weights_sha256(weights)

    def write(staging: Path) -> dict[str, Any]:
        link_or_copy(weights, staging / WEIGHTS_FILE)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        return {"source": str(path)}

    slot, _ = materialize(f"local-{digest[:32]}", write)
    return ParentRef(
        source=source,
        kind="local",
        pinned=f"local:{weights.name}@sha256:{digest[:16]}",
        path=str(slot),
        weights_sha256=digest,
        tokenizer_path=None if tokenizer is None else str(tokenizer),
        run_id=read_run_record(directory.parent),
        tokens_seen_total=facts.get("tokens_seen", 0),
        root=f"local:sha256:{digest[:16]}",
    )
