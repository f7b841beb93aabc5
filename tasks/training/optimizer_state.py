"""The optimizer's state in a checkpoint: `optimizer/`, safetensors files written by every rank through
torch.distributed.checkpoint (DCP), keyed by parameter name (`<name>.<state key>`). Any world size and any
of none | DDP | FSDP2 loads it: DCP reads the slices each rank needs from whichever files hold them.

Tensors only: no pickle is written or read (DCP's default format pickles its metadata; its safetensors
format keeps each shard's offsets in the file header). The param groups' hyperparameters are not stored:
they come from the run's settings, which a resume must repeat (`tasks.training.resume`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from tasks.training.errors import TrainingInputError
from tasks.training.optim import TrainOptimizer

OPTIMIZER_DIR = "optimizer"


@contextmanager
def _dcp_alone() -> Iterator[bool]:
    """Yields whether DCP must work alone (no process group): then quietly, without its warning."""
    alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield alone


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state tensors of a name-keyed optimizer state dict, flat: `<parameter name>.<state key>`."""
    return {f"{name}.{key}": value for name, entry in state["state"].items() for key, value in entry.items()}


def save_optimizer_state(directory: Path, model: nn.Module, optimizer: TrainOptimizer) -> None:
    """Write `optimizer`'s state (for `model`'s parameters) under `directory`. A collective under a process
    group: every rank writes its own file, replicated tensors (DDP, step counts) once."""
    state = get_optimizer_state_dict(model, optimizer.optimizers)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    with _dcp_alone() as alone:
        dcp.save(_tensors(state), storage_writer=writer, no_dist=alone)


def load_optimizer_state(checkpoint: Path, model: nn.Module, optimizer: TrainOptimizer) -> None:
    """Load checkpoint `checkpoint`'s optimizer state into `optimizer` (built for `model`, whatever its
    wrapping and world size). A collective under a process group."""
    directory = checkpoint / OPTIMIZER_DIR
    # The state's tensors as this run holds them (initialised by a zero-LR step), filled in place.
    state = get_optimizer_state_dict(model, optimizer.optimizers)
    flat = _tensors(state)
    with _dcp_alone() as alone:
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=alone)
    for name, entry in state["state"].items():
        for key in entry:
            entry[key] = flat[f"{name}.{key}"]
    set_optimizer_state_dict(model, optimizer.optimizers, state)


def saved_state_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]] | None:
    """`<parameter name>.<state key>` → shape of each tensor of checkpoint `checkpoint`'s optimizer state
    (the whole tensor's, whatever the sharding it was written with); None when it holds no optimizer state.
    Reads the files' headers only."""
    directory = checkpoint / OPTIMIZER_DIR
    if not directory.is_dir():
        return None
    metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    shapes = {name: tuple(entry.size) for name, entry in metadata.state_dict_metadata.items()}
    return shapes or None


def state_differences(checkpoint: Path, model: nn.Module, optimizer: TrainOptimizer) -> list[str]:
    """What keeps checkpoint `checkpoint`'s optimizer state from loading into `optimizer` (built for
    `model`): a state tensor only one side has (another parameter name, or another optimizer: AdamW keeps
    exp_avg/exp_avg_sq/step, Muon momentum_buffer), or another shape. Initialises `optimizer`'s state (a
    zero-LR step, as loading does), so call it only before loading into it."""
    saved = saved_state_shapes(checkpoint)
    if saved is None:
        return [f"{checkpoint} holds no optimizer state"]
    wanted = {
        name: tuple(t.shape)
        for name, t in _tensors(get_optimizer_state_dict(model, optimizer.optimizers)).items()
    }
    problems = []
    for label, names in (
        ("only in the checkpoint", sorted(saved.keys() - wanted.keys())),
        ("only in this run", sorted(wanted.keys() - saved.keys())),
    ):
        if names:
            problems.append(
                f"{len(names)} state tensor(s) {label} ({', '.join(names[:3])}{', ...' * (len(names) > 3)})"
            )
    shapes = [
        f"{n}: checkpoint {list(saved[n])}, now {list(wanted[n])}"
        for n in sorted(saved.keys() & wanted.keys())
        if saved[n] != wanted[n]
    ]
    if shapes:
        problems.append(
            f"{len(shapes)} shape(s) differ ({'; '.join(shapes[:3])}{'; ...' * (len(shapes) > 3)})"
        )
    return problems


def load_parent_optimizer_state(checkpoint: Path, model: nn.Module, optimizer: TrainOptimizer) -> None:
    """A new run's start with its parent's optimizer state (`init_optimizer`): checkpoint `checkpoint`'s
    moments and step counts, loaded like a resume's, after checking they fit (before any step)."""
    if saved_state_shapes(checkpoint) is None:
        raise TrainingInputError(
            f"init_optimizer: {checkpoint} holds no optimizer state here (the parent's training checkpoint "
            "must be on storage this machine reads): set init_optimizer: false to start with a new optimizer "
            "state, or make the checkpoint readable here"
        )
    problems = state_differences(checkpoint, model, optimizer)
    if problems:
        raise TrainingInputError(
            f"init_optimizer: the optimizer state of {checkpoint} does not fit this run: {'; '.join(problems)}. "
            "It carries over only to the same architecture trained with the same optimizer: set "
            "init_optimizer: false to start with a new optimizer state"
        )
    load_optimizer_state(checkpoint, model, optimizer)
