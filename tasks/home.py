"""Where llamaflow keeps things (defaults that need no server), and the embedded defaults that the entry
points apply.

Two locations, each from the environment or else from the working directory of the entry point:
  LLAMAFLOW_HOME     caches and run directories       default `./.llamaflow`
  LLAMAFLOW_MLRUNS   the embedded MLflow store         default `./mlruns` (unless MLFLOW_TRACKING_URI is set)
Never relative to the installed package: with `pip install .` that would be inside site-packages, and on a
Prefect worker inside a throwaway clone. `apply_embedded_defaults()` pins both to absolute paths in the
environment, so a later `chdir` and child processes (torchrun ranks) keep the same ones.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

# Where the code is (the directory holding the `tasks` package; site-packages after `pip install .`):
# for the imports of child processes only, never for data.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
HOME_ENV = "LLAMAFLOW_HOME"
MLRUNS_ENV = "LLAMAFLOW_MLRUNS"
# How a path under the home is written into refs that leave the process (Prefect cache records,
# deployment parameters, result files): resolved again against the reader's own home.
HOME_MARK = "$LLAMAFLOW_HOME"
_DEFAULTED: set[str] = set()  # locations this process took from the working directory


def child_pythonpath(env: Mapping[str, str]) -> str:
    """PYTHONPATH for a child process of ours: the project's code, then every entry `env` already had (the
    user's, e.g. the GPU image's unpacked wheels), made absolute for a child in another working directory."""
    given = [str(Path(entry).resolve()) for entry in (env.get("PYTHONPATH") or "").split(os.pathsep) if entry]
    return os.pathsep.join(dict.fromkeys([str(PROJECT_ROOT), *given]))


def home() -> Path:
    """Root of caches and run directories (`LLAMAFLOW_HOME`, default `./.llamaflow`)."""
    return Path(os.environ.get(HOME_ENV) or ".llamaflow").expanduser().resolve()


def cache_dir() -> Path:
    """Content-addressed caches (tokenizers, packed datasets, initial weights), shared safely between runs."""
    return home() / "cache"


def runs_dir() -> Path:
    """One directory per run: checkpoints, metrics, samples."""
    return home() / "runs"


def mlruns_dir() -> Path:
    return Path(os.environ.get(MLRUNS_ENV) or "mlruns").expanduser().resolve()


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` when set, else the embedded SQLite store under `mlruns/`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{mlruns_dir() / 'mlflow.db'}"


def artifact_root() -> str:
    """Artifact location for experiments created by llamaflow on the embedded store."""
    return (mlruns_dir() / "artifacts").as_uri()


def portable(path: str | os.PathLike[str]) -> str:
    """`path` as stored in a ref that leaves this process: `$LLAMAFLOW_HOME/...` when it is under the home."""
    text = os.fspath(path)
    if text.startswith(HOME_MARK):
        return text
    root = home()
    candidate = Path(text)
    if candidate.is_absolute() and candidate.is_relative_to(root):
        relative = candidate.relative_to(root).as_posix()
        return HOME_MARK if relative == "." else f"{HOME_MARK}/{relative}"
    return text


def local(path: str | os.PathLike[str]) -> str:
    """A stored path made absolute on this machine: `$LLAMAFLOW_HOME/...` resolves against this home."""
    text = os.fspath(path)
    if text == HOME_MARK:
        return str(home())
    if text.startswith(HOME_MARK + "/"):
        return str(home() / text[len(HOME_MARK) + 1 :])
    return text


def describe_locations() -> str:
    """One sentence for the run summary: where this run's caches, checkpoints and MLflow store are, and why."""
    parts = [f"caches and checkpoints in {home()} ({_origin(HOME_ENV)})"]
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        parts.append(f"MLflow store in {mlruns_dir()} ({_origin(MLRUNS_ENV)})")
    return "; ".join(parts)


def _origin(env: str) -> str:
    return f"the working directory; set {env} to move it" if env in _DEFAULTED else f"{env}"


def apply_embedded_defaults() -> None:
    """Quiet, robust defaults for a run; a value the user exported always wins.

    Called by the entry points (the command line, the flows, the torchrun worker), never on import.
    Prefect's own defaults for the embedded server are in pyproject.toml (`[tool.prefect]`): Prefect
    reads its settings when it is imported, so they cannot be set from here for this process. The
    temporary server is another process, started later with this environment: its analytics are turned
    off here too, for runs outside the checkout (a worker's directory), where pyproject.toml is not read.
    First of all, credentials inside store URIs are taken out (`tasks.credentials.guard_credentials`).
    """
    from tasks.credentials import guard_credentials

    guard_credentials()
    for env, path in ((HOME_ENV, home()), (MLRUNS_ENV, mlruns_dir())):
        if not os.environ.get(env):
            os.environ[env] = str(path)  # pinned: a later chdir or a child process sees the same place
            _DEFAULTED.add(env)
    if HOME_ENV in _DEFAULTED and os.environ.get("PREFECT__FLOW_RUN_ID"):
        # A Prefect worker starts each flow run in a temporary directory that it deletes afterwards.
        logging.getLogger("llamaflow").warning(
            f"{HOME_ENV} is not set on this worker: caches and checkpoints go to {home()}, inside the "
            f"flow run's working directory, and are lost when the run ends; set {HOME_ENV} (and "
            "MLFLOW_TRACKING_URI) in the worker's environment or the pool's `env` job variable"
        )
    defaults = {
        "TOKENIZERS_PARALLELISM": "false",
        # Per-file download bars of MLflow's local artifact copies say nothing a user needs.
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        # MLflow's async logging merges what was queued within a second into one request (without it, one
        # request per step: benchmarks/tracking_overhead.py measured 5 ms/step more on SQLite).
        "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(home() / "inductor-cache"),
        # Offline, a new temporary server's telemetry logged a "database is locked" ERROR at start-up.
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Outside the checkout pyproject.toml's 120 s is not read, and the 20 s default failed a run on a
        # loaded host before its temporary server answered.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # SQLAlchemy 2.1 deprecates a loader strategy MLflow still uses; nothing for a user to act on.
    warnings.filterwarnings("ignore", message=".*noload.* loader strategy is deprecated")
