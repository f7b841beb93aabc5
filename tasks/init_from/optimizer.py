"""`init_optimizer`: a new run from a parent that starts with the parent's optimizer state (its moments and
step counts) instead of a new one. The state is the one saved in the parent's training checkpoint, the
checkpoint whose weights the parent is:

  a local checkpoint directory (or its .safetensors)   that directory;
  a registry version or a logged model                 the checkpoint of the run that trained it whose
                                                       weights are the parent's (the run's checkpoint
                                                       logged models name their directories);
  a Hugging Face checkpoint                            none: refused.

Found and checked here, when the flow starts (before any data work): the checkpoint is intact, holds an
optimizer state, and was trained with this run's optimizer and architecture. The engine checks again,
tensor by tensor, before its first step (`tasks.training.optimizer_state.load_parent_optimizer_state`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from mlflow.exceptions import MlflowException
from prefect import task

from model import LlamaConfig, LlamaForPretraining
from tasks import home
from tasks.build import parent_config
from tasks.init_from.parent_cache import InitFromError, weights_sha256
from tasks.refs import ParentRef
from tasks.tracking import checkpoints as logged_checkpoints
from tasks.tracking import store
from tasks.training import checkpoint as ckpt
from tasks.training.optimizer_state import saved_state_shapes

FIX = "set init_optimizer: false to start with a new optimizer state"


def _local_checkpoint(parent: ParentRef) -> Path:
    path = Path(parent.source).expanduser().resolve()
    return path if path.is_dir() else path.parent


def _run_checkpoints(parent: ParentRef, uri: str) -> list[Path]:
    """The checkpoint directories the parent's MLflow run logged (newest step first), as on this machine."""
    client = store.get_client(uri)
    if parent.model_id is not None:
        try:
            logged = client.get_logged_model(parent.model_id)
        except MlflowException as err:
            raise InitFromError(f"init_optimizer: no logged model {parent.model_id} ({err.message})") from err
        if logged_checkpoints.TAG_CHECKPOINT in logged.tags:  # the parent is a checkpoint logged model
            return [Path(home.local(logged.tags[logged_checkpoints.TAG_CHECKPOINT]))]
    if parent.run_id is None:
        return []
    run = client.get_run(parent.run_id)
    found = client.search_logged_models(
        [run.info.experiment_id],
        filter_string=f"source_run_id = '{parent.run_id}' AND model_type = '{logged_checkpoints.MODEL_TYPE}'",
    )
    tagged = [m for m in found if logged_checkpoints.TAG_CHECKPOINT in m.tags]
    tagged.sort(key=lambda m: int(m.params.get("step", 0)), reverse=True)
    return [Path(home.local(m.tags[logged_checkpoints.TAG_CHECKPOINT])) for m in tagged]


def _mlflow_checkpoint(parent: ParentRef, uri: str) -> Path:
    """The parent's run's checkpoint whose weights are the parent's (a version is its run's final one)."""
    candidates = _run_checkpoints(parent, uri)
    here = [path for path in candidates if (path / ckpt.MODEL_FILE).is_file()]
    for path in here:
        if weights_sha256(path / ckpt.MODEL_FILE) == parent.weights_sha256:
            return path
    where = f"run {parent.run_id}" if parent.run_id else "no run (it was logged without one)"
    if not candidates:
        seen = "logged no checkpoint"
    elif not here:
        seen = f"logged checkpoints that are not on this machine ({', '.join(map(str, candidates[:3]))})"
    else:
        seen = (
            "kept no checkpoint with its weights (they came from elsewhere, or that checkpoint was removed)"
        )
    raise InitFromError(
        f"init_optimizer: {parent.pinned} came from {where}, which {seen}, so its optimizer state cannot be "
        f"found. Its optimizer state stays in the training checkpoint on the machine that trained it: {FIX}"
    )


def parent_checkpoint(parent: ParentRef, tracking_uri: str | None = None) -> Path:
    """The parent's training checkpoint (whose optimizer state `init_optimizer` carries over)."""
    if parent.kind == "hf":
        raise InitFromError(
            f"init_optimizer: {parent.pinned} is a Hugging Face checkpoint, which carries no optimizer state: "
            f"{FIX}"
        )
    if parent.kind == "local":
        return _local_checkpoint(parent)
    return _mlflow_checkpoint(parent, store.check_tracking_store(tracking_uri))


def _parameter_differences(before: LlamaConfig, now: LlamaConfig) -> list[str]:
    """Parameters (names and shapes) of the parent's architecture that this run's lacks or shapes otherwise
    (built on the meta device: no memory); config changes that keep every parameter are no obstacle."""
    with torch.device("meta"):
        shapes = [
            {n: list(p.shape) for n, p in LlamaForPretraining(c).named_parameters()} for c in (before, now)
        ]
    names = sorted(shapes[0].keys() | shapes[1].keys())
    return [
        f"parameter {n}: parent {shapes[0].get(n, 'none')}, now {shapes[1].get(n, 'none')}"
        for n in names
        if shapes[0].get(n) != shapes[1].get(n)
    ][:4]


def check_parent_optimizer(
    parent: ParentRef | None,
    model_config: LlamaConfig,
    optimizer: str,
    run_dir: str | Path,
    tracking_uri: str | None = None,
) -> str | None:
    """The checkpoint whose optimizer state the run starts with, after checking it fits: refused (naming
    the fix) when the parent has none, or was trained with another optimizer or architecture. None for a
    run directory that holds checkpoints: that run resumes, with its own optimizer state."""
    if parent is None:
        raise InitFromError("init_optimizer carries a parent's optimizer state over: it needs init_from")
    if ckpt.checkpoint_dirs(Path(run_dir)):
        return None
    checkpoint = parent_checkpoint(parent, tracking_uri)
    problem = ckpt.checkpoint_problem(checkpoint)
    if problem is None and saved_state_shapes(checkpoint) is None:
        problem = "it holds no optimizer state"
    if problem is not None:
        raise InitFromError(
            f"init_optimizer: {parent.pinned} has no usable optimizer state in {checkpoint} ({problem}): give "
            f"init_from a training checkpoint (step_NNNNNN of a run directory), or {FIX}"
        )
    saved = ckpt.read_json(checkpoint / ckpt.SETTINGS_FILE).get("optimizer", "adamw")
    problems = [f"optimizer: parent {saved!r}, now {optimizer!r}"] if saved != optimizer else []
    problems += _parameter_differences(parent_config(parent), model_config)
    if problems:
        raise InitFromError(
            f"init_optimizer: the optimizer state of {parent.pinned} does not fit this run: "
            f"{'; '.join(problems)}. It carries over only to the same architecture trained with the same "
            f"optimizer: {FIX}, or train with the parent's optimizer and architecture"
        )
    return str(checkpoint)


check_parent_optimizer_task = task(check_parent_optimizer, name="check_parent_optimizer")
