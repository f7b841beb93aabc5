"""`init_from` a Hugging Face Llama checkpoint: a local directory (`save_pretrained` output: config.json,
safetensors, tokenizer.json), or a hub id (`hf:ORG/NAME[@REVISION]`, or a bare `ORG/NAME` that is no local
path) found in the local Hugging Face cache, offline. Online (HF_HUB_OFFLINE unset) a hub id missing from
the cache is downloaded into it first. The weights are imported through `model.hf.import_hf` (safetensors
only) and kept in our layout; the hub id is pinned to the cached snapshot's commit.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from model.hf import import_hf
from model.weights import CONFIG_FILE, WEIGHTS_FILE, save_weights
from tasks.data.errors import blake
from tasks.init_from.parent_cache import TOKENIZER_FILE, InitFromError, link_or_copy, materialize
from tasks.refs import ParentRef
from tasks.training.checkpoint import sha256_file

HUB_ID = re.compile(r"^(?:hf:)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# What a checkpoint needs from a hub repository (no pickled .bin weights, no other formats).
HUB_FILES = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]


def is_hf_dir(path: Path) -> bool:
    config = path / CONFIG_FILE
    return path.is_dir() and config.is_file() and "model_type" in json.loads(config.read_text())


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_token_names(directory: Path) -> dict[str, str]:
    """bos/eos/pad names the checkpoint declares (tokenizer_config.json, special_tokens_map.json)."""
    names: dict[str, str] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = directory / file
        if path.is_file():
            raw = json.loads(path.read_text())
            for role in ("bos", "eos", "pad"):
                if (name := _token_name(raw.get(f"{role}_token"))) is not None:
                    names[role] = name
    return names


def snapshot(repo: str, revision: str | None) -> Path:
    """The cached snapshot directory of `repo` at `revision` (default: main), downloaded when online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError as err:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            raise InitFromError(
                f"{repo} is not (completely) in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set ({err}). Download it once where there is "
                "network: "
                f"`hf download {repo} --include {' '.join(repr(p) for p in HUB_FILES)}` (same HF_HOME), or "
                "give the checkpoint's directory"
            ) from err
    return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES))


def resolve_hf(source: str, directory: Path, *, hub: tuple[str, str] | None = None) -> ParentRef:
    """A Hugging Face Llama directory; `hub` = (repo id, commit) when it is a hub cache snapshot."""
    directory = directory.resolve()
    tokenizer = directory / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise InitFromError(
            f"init_from={source!r}: {directory} has no tokenizer.json, and the tokenizer comes with the "
            "weights. Save the fast tokenizer beside them: "
            f"AutoTokenizer.from_pretrained({str(directory)!r}).save_pretrained({str(directory)!r})"
        )
    if hub is not None:
        repo, commit = hub
        key, pinned = blake("hf", repo, commit), f"hf:{repo}@{commit}"
    else:
        files = sorted(p for p in directory.iterdir() if p.suffix in (".json", ".safetensors"))
        content = blake("hf-dir", *(f"{p.name}:{sha256_file(p)}" for p in files))
        key, pinned = content, f"hf-dir:{directory.name}@{content[:16]}"

    def write(staging: Path) -> dict[str, Any]:
        try:
            model = import_hf(directory)
        except (FileNotFoundError, ValueError) as err:
            raise InitFromError(f"init_from={source!r}: {err}") from err
        save_weights(model, staging / WEIGHTS_FILE)
        (staging / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2))
        link_or_copy(tokenizer, staging / TOKENIZER_FILE)
        return {"source": pinned}

    slot, meta = materialize(f"hf-{key[:32]}", write)
    return ParentRef(
        source=source,
        kind="hf",
        pinned=pinned,
        path=str(slot),
        weights_sha256=meta["weights_sha256"],
        tokenizer_path=str(slot / TOKENIZER_FILE),
        special_tokens=special_token_names(directory),
        root=pinned,
    )


def resolve_hub_id(source: str) -> ParentRef:
    match = HUB_ID.match(source)
    if match is None:
        raise InitFromError(f"init_from={source!r} is not a hub id (ORG/NAME or hf:ORG/NAME[@REVISION])")
    repo, revision = match["repo"], match["revision"]
    try:
        directory = snapshot(repo, revision)
    except InitFromError as err:
        where = "" if source.startswith("hf:") else " is no existing path, and as a Hugging Face hub id"
        raise InitFromError(f"init_from={source!r}{where}: {err}") from err
    if not is_hf_dir(directory):
        raise InitFromError(
            f"init_from={source!r}: the cached snapshot {directory} has no Hugging Face config.json with a "
            "model_type; only Llama checkpoints are imported"
        )
    return resolve_hf(source, directory, hub=(repo, directory.name))


def looks_like_hub_id(source: str) -> bool:
    return source.startswith("hf:") or (
        HUB_ID.match(source) is not None and not os.path.exists(os.path.expanduser(source))
    )
