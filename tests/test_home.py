"""Where llamaflow keeps things (tasks/home.py), and refs that name places in the home portably."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import home
from tasks.refs import CheckpointRef, DatasetRef

REPO = Path(__file__).resolve().parents[1]


def _dataset(path: Path | str) -> DatasetRef:
    return DatasetRef(
        path=str(path),
        fingerprint="f",
        seq_len=8,
        vocab_size=300,
        train_blocks=1,
        val_blocks=1,
        train_tokens=8,
        val_tokens=8,
    )


def test_defaults_are_in_the_working_directory_not_beside_the_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LLAMAFLOW_HOME", "LLAMAFLOW_MLRUNS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    assert home.home() == tmp_path / ".llamaflow"
    assert home.tracking_uri() == f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"


def test_entry_points_pin_the_defaults_so_a_chdir_or_a_child_sees_the_same_place(tmp_path: Path) -> None:
    """An installed package (site-packages) started from a working directory: nothing lands beside the code."""
    script = (
        "import os, subprocess, sys\n"
        "from tasks import home\n"
        "home.apply_embedded_defaults()\n"
        "os.chdir('/')\n"
        "print(home.home(), home.mlruns_dir())\n"
        "print(home.describe_locations())\n"
        "print(subprocess.run([sys.executable, '-c', 'from tasks import home; print(home.home())'],"
        " capture_output=True, text=True, check=True).stdout.strip())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMAFLOW_HOME", "LLAMAFLOW_MLRUNS")}
    env["PYTHONPATH"] = str(REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == f"{tmp_path / '.llamaflow'} {tmp_path / 'mlruns'}"
    assert out[1] == (
        f"caches and checkpoints in {tmp_path / '.llamaflow'} (the working directory; set LLAMAFLOW_HOME "
        f"to move it); MLflow store in {tmp_path / 'mlruns'} (the working directory; set LLAMAFLOW_MLRUNS "
        "to move it)"
    )
    assert out[2] == str(tmp_path / ".llamaflow")


def test_refs_name_home_paths_relative_to_the_home_of_whoever_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "here"))
    ref = _dataset(tmp_path / "here" / "cache" / "datasets" / "abc")
    outside = _dataset(tmp_path / "elsewhere" / "data")
    stored = ref.model_dump_json()
    assert '"$LLAMAFLOW_HOME/cache/datasets/abc"' in stored
    assert str(tmp_path) not in stored  # nothing of this machine's layout leaves the process
    assert str(tmp_path / "elsewhere" / "data") in outside.model_dump_json()  # not under the home: kept

    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "worker"))
    assert DatasetRef.model_validate_json(stored).path == str(
        tmp_path / "worker" / "cache" / "datasets" / "abc"
    )
    checkpoint = CheckpointRef.model_validate(
        {
            "path": "$LLAMAFLOW_HOME/runs/r/step_000002",
            "run_dir": "$LLAMAFLOW_HOME/runs/r",
            "step": 2,
            "tokens_seen": 1,
        }
    )
    assert checkpoint.run_dir == str(tmp_path / "worker" / "runs" / "r")
    assert checkpoint.path == str(tmp_path / "worker" / "runs" / "r" / "step_000002")


def test_a_worker_flow_run_without_a_home_is_warned_that_its_caches_die_with_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("LLAMAFLOW_HOME", "LLAMAFLOW_MLRUNS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(home, "_DEFAULTED", set())
    monkeypatch.chdir(tmp_path)  # a process worker's throwaway directory
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "00000000-0000-0000-0000-000000000000")
    with caplog.at_level("WARNING", logger="llamaflow"):
        home.apply_embedded_defaults()
    assert os.environ["LLAMAFLOW_HOME"] == str(tmp_path / ".llamaflow")
    assert "LLAMAFLOW_HOME is not set on this worker" in caplog.text
    assert "lost when the run ends" in caplog.text


@pytest.mark.e2e
def test_a_run_outside_the_checkout_starts_its_temporary_prefect_server_with_analytics_off(
    tmp_path: Path,
) -> None:
    """pyproject.toml turns Prefect's analytics off and gives the temporary server 120 s to start only where
    it is read (the checkout); elsewhere the telemetry logged an ERROR offline and the 20 s default failed
    runs on a loaded host. The server reports its own settings."""
    script = (
        "from tasks.home import apply_embedded_defaults\n"
        "apply_embedded_defaults()\n"
        "import httpx\n"
        "from prefect import flow, get_client\n"
        "@flow\n"
        "def check():\n"
        "    api = str(get_client(sync_client=True).api_url).rstrip('/')\n"
        "    return httpx.get(f'{api}/admin/settings').json()['server']['analytics_enabled']\n"
        "print('analytics', check())\n"
        "from prefect.settings import get_current_settings\n"
        "print('startup timeout', get_current_settings().server.ephemeral.startup_timeout_seconds)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LLAMAFLOW_"))}
    env.update(
        PYTHONPATH=str(REPO),
        PREFECT_HOME=str(tmp_path / "prefect"),
        LLAMAFLOW_HOME=str(tmp_path / "home"),
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "analytics False" in run.stdout.splitlines()
    assert "startup timeout 120" in run.stdout.splitlines()
