"""The sha256 manifest of a registered version's files: recorded by the promotion decision (a tag only
promoters may write on a `flows.services` server), checked by every loader before it loads anything.

The server already refuses writes into a READY logged model (`flows.services.mlflow_policy`); the manifest is
what a loader can check on its own: files changed anywhere else (the artifact store's disk, an object store's
bucket, a server without that policy) are refused at load, with the files that differ named.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from mlflow.entities.model_registry import ModelVersion

TAG_MANIFEST = "llamaflow.manifest"
MAX_TAG_CHARS = 8000  # MLflow truncates a longer tag value: a truncated manifest would refuse every load


class TamperedModelError(ValueError):
    """A downloaded version's files are not those its promotion decision recorded."""


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def manifest_of(directory: Path) -> dict[str, str]:
    """{path relative to `directory`: sha256} of every file under it (bytecode caches left out: loading
    writes them)."""
    return {
        path.relative_to(directory).as_posix(): file_sha256(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def encode(manifest: Mapping[str, str]) -> str:
    text = json.dumps(dict(sorted(manifest.items())), separators=(",", ":"))
    if len(text) > MAX_TAG_CHARS:
        raise ValueError(
            f"the version's manifest takes {len(text)} characters, more than a tag holds ({MAX_TAG_CHARS}): "
            "a model of fewer files (its code_paths) can be registered"
        )
    return text


def recorded(tags: Mapping[str, str]) -> dict[str, str] | None:
    """The manifest a decision recorded in these tags; None when none did (a version not decided yet, or
    decided before manifests were recorded)."""
    text = tags.get(TAG_MANIFEST)
    return None if text is None else dict(json.loads(text))


def verify(directory: Path, expected: Mapping[str, str], what: str) -> None:
    """Raise TamperedModelError naming every file of `directory` that differs from `expected`."""
    found = manifest_of(directory)
    changed = sorted(p for p in expected.keys() & found.keys() if expected[p] != found[p])
    missing = sorted(expected.keys() - found.keys())
    added = sorted(found.keys() - expected.keys())
    if changed or missing or added:
        parts = [
            f"{label}: {', '.join(paths)}"
            for label, paths in (("changed", changed), ("missing", missing), ("added", added))
            if paths
        ]
        raise TamperedModelError(
            f"{what}: its files are not those its promotion decision recorded ({'; '.join(parts)}); nothing "
            "was loaded. Someone changed them after registration: ask an administrator to check the artifact "
            "store, and register the model again"
        )


def verify_version(directory: Path, version: ModelVersion, what: str | None = None) -> None:
    """Check a downloaded `version` against the manifest its decision recorded (nothing to check without
    one)."""
    expected = recorded(version.tags or {})
    if expected is not None:
        verify(directory, expected, what or f"version {version.version} of {version.name!r}")
