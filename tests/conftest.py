"""Test session set-up: offline, isolated Prefect and llamaflow homes, deterministic torch.

The environment is set before Prefect, MLflow or datasets are imported anywhere, because they read
it at import time (prefect_test_harness does not isolate stored results on its own).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="llamaflow-tests-"))

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_CACHE"] = str(_SESSION_DIR / "hf-datasets")
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
# Prefect's analytics and start-up timeout come from pyproject.toml ([tool.prefect]): pytest runs here.
os.environ["LLAMAFLOW_HOME"] = str(_SESSION_DIR / "home")
os.environ["LLAMAFLOW_MLRUNS"] = str(_SESSION_DIR / "mlruns")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("PREFECT_API_URL", None)
# The inductor cache is content-addressed and safe to share between test sessions; it turns
# 30 s compiles into ~3 s on a warm machine.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".llamaflow" / "inductor-cache")
)

import pytest  # noqa: E402
import torch  # noqa: E402

from tasks.home import apply_embedded_defaults  # noqa: E402

apply_embedded_defaults()  # as every entry point does (the test session is one)

torch.use_deterministic_algorithms(True)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with end-to-end tests first, each file's tests in their own order: `make test` hands whole files
    to its workers in this order, and a long file handed out last keeps one worker busy while the other idles."""
    has_e2e = {item.path for item in items if item.get_closest_marker("e2e")}
    items.sort(key=lambda item: item.path not in has_e2e)


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION_DIR


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A LLAMAFLOW_HOME of the test's own (empty caches)."""
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(autouse=True)
def _no_mlflow_default_store_in_the_working_directory():
    """MLflow's own default store is `sqlite:///<cwd>/mlflow.db`: a call that reaches MLflow without our
    store URI (a missing `tracking_uri=`, the process-wide default) creates it there. Fail the test that did."""
    stray = Path.cwd() / "mlflow.db"
    existed = stray.exists()
    yield
    if not existed and stray.exists():
        stray.unlink()
        pytest.fail(f"{stray} was created: something used MLflow's default tracking store instead of ours")


@pytest.fixture(autouse=True)
def _no_stale_mlflow_tracking_uri():
    """`mlflow.set_tracking_uri` is process-wide and writes MLFLOW_TRACKING_URI: undo it after each test."""
    import sys

    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(None)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(autouse=True)
def _no_credentials_left_in_the_environment():
    """The credentials door (tasks/credentials.py) moves a URI's user and password into these variables of
    this process: what a test put there leaves with it, so no later test starts with another's credentials."""
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "PGPASSWORD", "PREFECT_API_AUTH_STRING")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
