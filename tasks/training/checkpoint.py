"""Atomic, checksummed checkpoints `step_000123/` and finding the newest good one to resume from.

A checkpoint is written into a private `.step_000123.tmp-*` directory, `manifest.json` (sha256 of every
other file) written last, every file fsynced, then the directory is renamed into place (`model.atomic`).
A directory without a valid manifest is never resumed from, so a `kill -9` at any moment leaves either the old or the new checkpoint usable.
Each rank's RNG state is a file of its own (`rng_rank_<rank>.pt`), listed in the manifest like the others.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from model import save_weights, unwrap
from model.atomic import atomic_dir, remove_stale

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"
SETTINGS_FILE = "train_settings.json"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, CONFIG_FILE, SETTINGS_FILE)
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Renamed-into-place checkpoint directories, oldest first."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank}.pt"


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generators; on a GPU only its own device's (a host with other GPUs can restore it)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore `capture_rng_state`'s generators; a CUDA state goes to `device` (skipped on a CPU)."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def load_rng_state(path: Path, rank: int) -> dict[str, Any] | None:
    """Rank `rank`'s RNG state in checkpoint `path`, or None when the checkpoint was written by fewer ranks."""
    file = path / rng_file(rank)
    return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else None


def write_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    model_config: dict[str, Any],
    settings: dict[str, Any],
    rng_states: list[dict[str, Any]],
    keep: int,
    midway: Callable[[], None] | None = None,
) -> Path:
    """Write `run_dir/step_{step:06d}` atomically (`rng_states[r]` is rank r's), then prune (`prune_checkpoints`)."""
    final = run_dir / checkpoint_name(step)
    # The same step written again (a stop request right after a periodic save) replaces the first one.
    with atomic_dir(final, replace=True, durable=True) as staged:
        tmp = staged.path
        save_weights(unwrap(model), tmp / MODEL_FILE)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if midway is not None:
            midway()
        torch.save(trainer_state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(model_config, indent=2))
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))
        for rank, rng_state in enumerate(rng_states):
            torch.save(rng_state, tmp / rng_file(rank))
        checksums = {file.name: sha256_file(file) for file in sorted(tmp.iterdir())}
        # Written last: a directory without a manifest that matches is never resumed from.
        (tmp / MANIFEST_FILE).write_text(json.dumps({"step": step, "sha256": checksums}, indent=2))
    _remember_valid(final)
    prune_checkpoints(run_dir, keep, final)
    return final


def prune_checkpoints(run_dir: Path, keep: int, written: Path) -> None:
    """Keep `written` (just written: the newest valid checkpoint) and the newest `keep - 1` valid ones before
    it; remove every other checkpoint before it, valid or not.

    Checkpoints of later steps are left alone: this run resumed from an earlier one, so they failed their
    checksums then, and the run replaces each of them when it reaches its step.
    """
    written_step = int(_STEP_DIR.match(written.name).group(1))  # type: ignore[union-attr]
    kept = 1
    for step, path in reversed(checkpoint_dirs(run_dir)):
        if step >= written_step:
            continue
        if kept < keep and is_valid(path):
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)
        _verified.pop(path, None)


# Checkpoints whose checksums this process verified (or wrote), by the identity of their manifest file:
# pruning checks validity at every save without hashing gigabytes each time.
_verified: dict[Path, tuple[int, int]] = {}


def _manifest_identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = (path / MANIFEST_FILE).stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _remember_valid(path: Path) -> None:
    identity = _manifest_identity(path)
    if identity is not None:
        _verified[path] = identity


def is_valid(path: Path) -> bool:
    """Whether every file of checkpoint `path` matches its manifest (cached while the manifest is the same)."""
    identity = _manifest_identity(path)
    if identity is not None and _verified.get(path) == identity:
        return True
    if checkpoint_problem(path) is not None:
        return False
    _remember_valid(path)
    return True


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from, or None when every file matches its manifest checksum."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return "no manifest.json (partially written)"
    try:
        manifest = json.loads(manifest_path.read_text())
        checksums = manifest["sha256"]
    except (ValueError, KeyError) as exc:
        return f"unreadable manifest.json ({exc})"
    for name in REQUIRED_FILES:
        if name not in checksums:
            return f"manifest.json lists no {name}"
    for name in checksums:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if sha256_file(file) != checksums[name]:
            return f"{name} does not match its sha256 in manifest.json (truncated or corrupt)"
    return None


def newest_valid_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose files match their checksums; corrupt ones are skipped with a warning."""
    for _, path in reversed(checkpoint_dirs(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            _remember_valid(path)
            return path
        warnings.warn(f"skipping checkpoint {path}: {problem}", RuntimeWarning, stacklevel=2)
    return None


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Delete the staging directories of checkpoints whose writer was killed (one writer per run dir)."""
    if run_dir.is_dir():
        remove_stale(run_dir, "step_*")


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)


def load_optimizer_state(path: Path) -> dict[str, Any]:
    # Optimizer.load_state_dict moves each state tensor to its parameter's device itself.
    return torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
