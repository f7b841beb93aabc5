"""Where llamaflow keeps things (project-local defaults that need no server), and the embedded defaults
that the entry points apply.

Every path is absolute, because Prefect workers and torchrun ranks may run in other directories. Paths
are read from the environment each time they are asked for, never fixed at import.
"""

from __future__ import annotations

import os
import warnings
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


def apply_embedded_defaults() -> None:
    """Quiet, robust defaults for a run; a value the user exported always wins.

    Called by the entry points (the command line, the flows, the torchrun worker), never on import.
    Prefect's own defaults for the embedded server are in pyproject.toml (`[tool.prefect]`): Prefect
    reads its settings when it is imported, so they cannot be set from here.
    """
    defaults = {
        "TOKENIZERS_PARALLELISM": "false",
        # Per-file download bars of MLflow's local artifact copies say nothing a user needs.
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        # MLflow's async logging merges what was queued within a second into one request (without it, one
        # request per step: benchmarks/tracking_overhead.py measured 5 ms/step more on SQLite).
        "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(home() / "inductor-cache"),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # SQLAlchemy 2.1 deprecates a loader strategy MLflow still uses; nothing for a user to act on.
    warnings.filterwarnings("ignore", message=".*noload.* loader strategy is deprecated")
