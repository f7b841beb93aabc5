"""Where llamaflow keeps things: project-local defaults that need no server.

Every path is absolute, because Prefect workers and torchrun ranks may run in other directories.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def home() -> Path:
    """Root of caches and run directories (`LLAMAFLOW_HOME`, default `<project>/.llamaflow`)."""
    return Path(os.environ.get("LLAMAFLOW_HOME", PROJECT_ROOT / ".llamaflow")).resolve()


def cache_dir() -> Path:
    """Content-addressed caches (tokenizers, packed datasets), shared safely between runs."""
    return home() / "cache"


def runs_dir() -> Path:
    """One directory per run: checkpoints, metrics, samples."""
    return home() / "runs"


def mlruns_dir() -> Path:
    return Path(os.environ.get("LLAMAFLOW_MLRUNS", PROJECT_ROOT / "mlruns")).resolve()


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` when set, else the embedded SQLite store under `mlruns/`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{mlruns_dir() / 'mlflow.db'}"


def artifact_root() -> str:
    """Artifact location for experiments created by llamaflow on the embedded store."""
    return (mlruns_dir() / "artifacts").as_uri()
