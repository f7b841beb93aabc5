"""Atomic, checksummed checkpoints `step_000123/` and finding the newest good one to resume from.

A checkpoint is written by every rank into one private `.step_000123.tmp-*` directory (the main rank makes
it); when every rank has written and fsynced its files, `manifest.json` (sha256 of every other file) is
written last and the directory renamed into place (`model.atomic`). A directory without a valid manifest
is never resumed from, so a `kill -9` of any rank at any moment leaves the old or the new checkpoint usable.

  model.safetensors   the original module's whole state dict, written by the main rank (one process, DDP):
                      what evaluation and registration read, and the weights a resume loads
  model_shards/       instead, under FSDP2 (fsdp, hsdp): every rank's slices of that state dict (DCP's safetensors
                      format; nothing is gathered), which a resume at any world size reads; model.safetensors
                      is consolidated from them where a whole model is needed (`checkpoint_weights`)
  optimizer/          the optimizer state, safetensors shards written by every rank (`optimizer_state`)
  rng_rank_<r>.pt     rank r's generators, written by rank r
  trainer_state.pt, config.json, train_settings.json, manifest.json

Checksums are computed and verified in shares: rank r hashes every world_size-th file, so no rank hashes
the whole checkpoint while the others wait in a collective.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model import save_weights
from model.atomic import atomic_dir, remove_stale
from tasks.training.checkpoint_weights import SHARDS_DIR, save_model_shards
from tasks.training.distributed import DistContext
from tasks.training.optim import TrainOptimizer
from tasks.training.optimizer_state import OPTIMIZER_DIR, save_optimizer_state
from tasks.training.parallelize import Parallel
from tasks.training.rng_state import capture_rng_state, rng_file
from tasks.training.rng_state import load_rng_state as load_rng_state  # the resume's, through this module
from tasks.training.rng_state import restore_rng_state as restore_rng_state

MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"
SETTINGS_FILE = "train_settings.json"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = (STATE_FILE, CONFIG_FILE, SETTINGS_FILE)  # and the weights: MODEL_FILE or SHARDS_DIR/
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_ONE = DistContext()


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(name: str) -> int | None:
    """The step of checkpoint directory name `name` (step_000123), else None."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


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


def write_checkpoint(
    run_dir: Path,
    step: int,
    *,
    parallel: Parallel,
    optimizer: TrainOptimizer,
    trainer_state: dict[str, Any],
    model_config: dict[str, Any],
    settings: dict[str, Any],
    device: torch.device,
    keep: int,
    dist: DistContext = _ONE,
    midway: Callable[[], None] | None = None,
) -> Path:
    """Write `run_dir/step_{step:06d}` atomically, every rank its part, then prune (`prune_checkpoints`).
    A collective: every rank calls it (`trainer_state` is read on the main rank only)."""
    final = run_dir / checkpoint_name(step)

    sharded = parallel.sharded

    def fill(tmp: Path) -> None:
        if sharded:  # every rank its slices of the weights: nothing is gathered
            save_model_shards(tmp / SHARDS_DIR, parallel.plain)
        save_optimizer_state(tmp / OPTIMIZER_DIR, parallel.plain, optimizer)  # every rank its shards
        if midway is not None:
            midway()
        rng = tmp / rng_file(dist.rank)
        torch.save(capture_rng_state(device), rng)
        _fsync(rng)
        if dist.is_main:
            if not sharded:
                save_weights(parallel.plain, tmp / MODEL_FILE)
            torch.save(trainer_state, tmp / STATE_FILE)
            (tmp / CONFIG_FILE).write_text(json.dumps(model_config, indent=2))
            (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))
        dist.barrier()  # every rank's files are written
        write_manifest(tmp, step, dist)

    if dist.is_main:
        # The same step written again (a stop request right after a periodic save) replaces the first one.
        with atomic_dir(final, replace=True, durable=True) as staged:
            dist.broadcast_object(str(staged.path))
            fill(staged.path)
    else:
        fill(Path(str(dist.broadcast_object(None))))
    dist.barrier()  # published
    _remember_valid(final)
    prune_checkpoints(run_dir, keep, final, dist)
    return final


def write_manifest(tmp: Path, step: int, dist: DistContext = _ONE) -> None:
    """`manifest.json` (written last: a directory without a manifest that matches is never resumed from),
    once every rank has written its files. A collective: the work list (files and chunks) is the main
    rank's, sent to all, and each rank hashes its share of it; ranks that list the directory differently
    (NFS clients) would otherwise hash shares of different lists, and the manifest could never validate."""
    seen = dist.gather_object(checkpoint_files(tmp))  # every rank sees at least the files it wrote itself
    pieces = None
    if dist.is_main:
        names = sorted(set().union(*seen))  # type: ignore[arg-type, misc]
        pieces = [(name, i) for name in names for i in range(_chunks(_size_when_visible(tmp / name)))]
    pieces = dist.broadcast_object(pieces)
    shares = dist.gather_object(
        {piece: _chunk_sha256(tmp / piece[0], piece[1]) for piece in _share(pieces, dist)}  # type: ignore[arg-type]
    )
    if not dist.is_main:
        return
    hashed = {piece: digest for share in shares for piece, digest in share.items()}  # type: ignore[union-attr]
    missing = [piece for piece in pieces if piece not in hashed]  # type: ignore[union-attr]
    if missing:
        raise RuntimeError(f"checkpoint {tmp}: no rank hashed {missing[:5]}")
    digests: dict[str, list[str]] = {}
    for (name, _), digest in sorted(hashed.items()):
        digests.setdefault(name, []).append(digest)
    # A file of one chunk has one digest (its sha256), a larger one the list of its chunks' digests.
    checksums = {name: d[0] if len(d) == 1 else d for name, d in digests.items()}
    lacking = [n for n in (*REQUIRED_FILES, *map(rng_file, range(dist.world_size))) if n not in checksums]
    lacking += [] if _has_weights(list(checksums)) else ["the model weights"]
    if lacking or not any(n.startswith(f"{OPTIMIZER_DIR}/") for n in checksums):
        raise RuntimeError(
            f"checkpoint {tmp} is incomplete: {', '.join(lacking) or 'no optimizer state'} not written; the "
            "checkpoint is not published"
        )
    (tmp / MANIFEST_FILE).write_text(json.dumps({"step": step, "sha256": checksums}, indent=2))


def _has_weights(names: list[str]) -> bool:
    """Whether a checkpoint's files hold the model: model.safetensors, or a sharded model's slices."""
    return MODEL_FILE in names or any(n.startswith(f"{SHARDS_DIR}/") for n in names)


def _size_when_visible(path: Path, wait_s: float = 60.0) -> int:
    """The size of a file another rank wrote, waiting (bounded) until this node's view of a shared file
    system shows it (an NFS client caches a missing name for up to a minute; listing asks again)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            os.listdir(path.parent)
            time.sleep(0.5)


def checkpoint_files(root: Path) -> list[str]:
    """Every file under `root` but the manifest, as sorted relative paths."""
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE
    )


# Files are hashed in chunks of this size, so that one large file (model.safetensors) is hashed by all
# ranks together: no rank hashes gigabytes while the others wait in a collective.
HASH_CHUNK = 1 << 30


def _chunks(size: int) -> int:
    return max(1, -(-size // HASH_CHUNK))


def _chunk_sha256(path: Path, index: int) -> str:
    """sha256 of chunk `index` of a file (of the whole file when it is one chunk: `sha256_file`'s)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(index * HASH_CHUNK)
        left = HASH_CHUNK
        while left and (block := f.read(min(1 << 20, left))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _share(items: list, dist: DistContext) -> list:
    """This rank's share of `items` (every world_size-th) to hash."""
    return items[dist.rank :: dist.world_size]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune_checkpoints(run_dir: Path, keep: int, written: Path, dist: DistContext = _ONE) -> None:
    """Keep `written` (just written: the newest valid checkpoint) and the newest `keep - 1` valid ones before
    it; remove every other checkpoint before it, valid or not. A collective (validity is checked in shares).

    Checkpoints of later steps are left alone: this run resumed from an earlier one, so they failed their
    checksums then, and the run replaces each of them when it reaches its step.
    """
    written_step = int(_STEP_DIR.match(written.name).group(1))  # type: ignore[union-attr]
    older = [str(p) for step, p in reversed(checkpoint_dirs(run_dir)) if step < written_step]
    kept = 1
    for path in map(Path, dist.broadcast_object(older)):  # type: ignore[arg-type]
        if kept < keep and is_valid(path, dist):
            kept += 1
            continue
        if dist.is_main:
            shutil.rmtree(path, ignore_errors=True)
        _verified.pop(path, None)
    dist.barrier()


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


def is_valid(path: Path, dist: DistContext = _ONE) -> bool:
    """Whether every file of checkpoint `path` matches its manifest (cached while the manifest is the same).
    A collective with `dist`: every rank gets the same answer."""
    identity = _manifest_identity(path)
    cached = identity is not None and _verified.get(path) == identity
    if all(dist.all_gather_object(cached)):
        return True
    if checkpoint_problem(path, dist) is not None:
        return False
    _remember_valid(path)
    return True


def checkpoint_problem(path: Path, dist: DistContext = _ONE) -> str | None:
    """Why `path` cannot be resumed from, or None when every file matches its manifest checksum. A
    collective with `dist`: each rank hashes its share of the files; every rank gets the same answer."""
    problem, names = _manifest_problem(path)
    if problem is None:
        checksums = json.loads((path / MANIFEST_FILE).read_text())["sha256"]
        expected = {name: [d] if isinstance(d, str) else d for name, d in checksums.items()}
        for name, index in _share([(n, i) for n in names for i in range(len(expected[n]))], dist):
            file = path / name
            if not file.is_file():
                problem = f"{name} is missing"
                break
            if _chunks(file.stat().st_size) != len(expected[name]) or (
                _chunk_sha256(file, index) != expected[name][index]
            ):
                problem = f"{name} does not match its sha256 in manifest.json (truncated or corrupt)"
                break
    problems = dist.all_gather_object(problem)
    return next((p for p in problems if p is not None), None)  # type: ignore[return-value]


def _manifest_problem(path: Path) -> tuple[str | None, list[str]]:
    """What is wrong with `path`'s manifest itself, and the files it lists."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return "no manifest.json (partially written)", []
    try:
        checksums = json.loads(manifest_path.read_text())["sha256"]
    except (ValueError, KeyError) as exc:
        return f"unreadable manifest.json ({exc})", []
    names = sorted(checksums)
    for name in REQUIRED_FILES:
        if name not in checksums:
            return f"manifest.json lists no {name}", names
    if not _has_weights(names):
        return f"manifest.json lists no {MODEL_FILE} and no {SHARDS_DIR}/", names
    if not any(n.startswith(f"{OPTIMIZER_DIR}/") for n in names):
        return "manifest.json lists no optimizer state", names
    return None, names


def newest_valid_checkpoint(
    run_dir: Path, dist: DistContext = _ONE, problems: dict[Path, str] | None = None
) -> Path | None:
    """The newest checkpoint whose files match their checksums; corrupt ones are skipped with a warning
    (and their problem put into `problems`). A collective with `dist` (the main rank lists the candidates;
    every rank gets the same answer)."""
    candidates = [str(path) for _, path in reversed(checkpoint_dirs(run_dir))]
    for path in map(Path, dist.broadcast_object(candidates)):  # type: ignore[arg-type]
        problem = checkpoint_problem(path, dist)
        if problem is None:
            _remember_valid(path)
            return path
        if problems is not None:
            problems[path] = problem
        if dist.is_main:
            warnings.warn(f"skipping checkpoint {path}: {problem}", RuntimeWarning, stacklevel=2)
    return None


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Delete the staging directories of checkpoints whose writer was killed (one writer per run dir)."""
    if run_dir.is_dir():
        remove_stale(run_dir, "step_*")


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
