"""Where resolved parents are kept: one directory per parent under `<home>/cache/parents/`, in our layout
(config.json + model.safetensors, and the tokenizer.json that came with the weights), written once,
atomically, under the slot's lock, so two runs resolving the same parent download or convert it once."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model.atomic import atomic_dir
from model.weights import CONFIG_FILE, WEIGHTS_FILE
from tasks import home
from tasks.data.cache import build_lock
from tasks.data.slot import is_complete

META_FILE = "meta.json"  # the completion marker of a slot (tasks.data.cache.is_complete)
TOKENIZER_FILE = "tokenizer.json"


class InitFromError(ValueError):
    """`init_from` cannot be used as given; the message names the problem and the fix."""


def weights_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a safetensors file's tensors (names, dtypes, shapes, bytes, in name order): the same for
    the same weights, whatever the file's header order (safetensors writes its metadata in hash order)."""
    import hashlib

    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(f.keys()):  # noqa: SIM118 - safe_open is not a dict
            tensor = f.get_tensor(name).contiguous()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parents_dir() -> Path:
    return home.cache_dir() / "parents"


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows it (weights are large), else a copy; a symlink (the HF
    cache's snapshots are made of them) is followed."""
    source = source.resolve()
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def materialize(key: str, write: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """The slot `key`, filled by `write(staging_dir)` unless it is there already; returns (dir, meta).

    `write` puts config.json, model.safetensors and maybe tokenizer.json into the staging directory and
    returns facts to keep (the meta); the weights' sha256 is added here."""
    final = parents_dir() / key
    if not is_complete(final):
        with build_lock(final):
            if not is_complete(final):
                with atomic_dir(final) as staged:
                    meta = write(staged.path)
                    for name in (CONFIG_FILE, WEIGHTS_FILE):
                        if not (staged.path / name).is_file():
                            raise InitFromError(f"the parent {key} has no {name} after download")
                    meta["weights_sha256"] = weights_sha256(staged.path / WEIGHTS_FILE)
                    (staged.path / META_FILE).write_text(json.dumps(meta, indent=2))
    return final, json.loads((final / META_FILE).read_text())


def tokenizer_in(directory: Path) -> Path | None:
    path = directory / TOKENIZER_FILE
    return path if path.is_file() else None
