"""Credentials given inside a URI are taken out at the door and never shown: the door itself (what every
entry point calls), the command line refusing conflicting credentials, log records, and the deployment's
build step refusing an origin that carries a token. What a whole run stores is searched in
tests/test_services.py, against authenticated servers.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
from pathlib import Path

import pytest
import yaml

from tasks import credentials

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cr@t/pa:ss"  # '@', '/' and ':' inside: the hard cases for a URI parser
QUOTED = "s3cr%40t%2Fpa%3Ass"


@pytest.fixture()
def environ() -> dict[str, str]:
    return {}


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        (f"http://alice:{SECRET}@127.0.0.1:5000/", "http://alice:***@127.0.0.1:5000/"),
        ("https://alice:p@ss@mlflow.example.com/x", "https://alice:***@mlflow.example.com/x"),
        ("postgresql://llama:a/b@db.internal/mlflow", "postgresql://llama:***@db.internal/mlflow"),
        (
            "postgresql+psycopg2://llama:p@ss@db/mlflow?sslmode=require",
            "postgresql+psycopg2://llama:***@db/mlflow?sslmode=require",
        ),
        ("https://ghp_TOKEN@github.com/org/repo.git", "https://***@github.com/org/repo.git"),
        ("https://github.com/org/repo@v1", "https://github.com/org/repo@v1"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ],
)
def test_redact_uri_hides_all_of_a_password_that_holds_separators(uri: str, shown: str) -> None:
    assert credentials.redact_uri(uri) == shown


def test_the_door_moves_mlflow_and_prefect_credentials_into_their_clients_variables(
    environ: dict[str, str],
) -> None:
    environ.update(
        MLFLOW_TRACKING_URI=f"http://alice:{QUOTED}@127.0.0.1:5000",
        PREFECT_API_URL=f"https://admin:{QUOTED}@prefect.internal/api",
        PREFECT_UI_URL=f"https://admin:{QUOTED}@prefect.internal",
    )
    credentials.guard_credentials(environ)
    assert environ == {
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000",
        "MLFLOW_TRACKING_USERNAME": "alice",
        "MLFLOW_TRACKING_PASSWORD": SECRET,  # decoded, as requests decoded it from the URL
        "PREFECT_API_URL": "https://prefect.internal/api",
        "PREFECT_API_AUTH_STRING": f"admin:{SECRET}",
        "PREFECT_UI_URL": "https://prefect.internal",
    }
    credentials.guard_credentials(environ)  # idempotent
    assert environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
    assert credentials.redact(f"the password is {SECRET} or {QUOTED}") == "the password is *** or ***"


def test_a_database_store_keeps_its_user_and_gives_the_password_to_libpq(environ: dict[str, str]) -> None:
    environ["MLFLOW_TRACKING_URI"] = f"postgresql+psycopg://llama:{QUOTED}@db.internal:5432/mlflow"
    credentials.guard_credentials(environ)
    assert environ == {
        "MLFLOW_TRACKING_URI": "postgresql+psycopg://llama@db.internal:5432/mlflow",
        "PGPASSWORD": SECRET,
    }


def test_conflicting_or_password_less_credentials_are_refused_without_being_shown(
    environ: dict[str, str],
) -> None:
    environ.update(MLFLOW_TRACKING_URI=f"http://alice:{SECRET}@h:5000", MLFLOW_TRACKING_PASSWORD="other-one")
    with pytest.raises(
        credentials.CredentialsError, match="MLFLOW_TRACKING_PASSWORD is set to other ones"
    ) as err:
        credentials.guard_credentials(environ)
    assert SECRET not in str(err.value) and "other-one" not in str(err.value)
    with pytest.raises(credentials.CredentialsError, match="MLFLOW_TRACKING_TOKEN") as err:
        credentials.guard_credentials({"MLFLOW_TRACKING_URI": "https://ghp_TOKEN123@mlflow.example.com"})
    assert "ghp_TOKEN123" not in str(err.value)


def test_the_command_line_refuses_conflicting_credentials_before_any_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from flows.pretrain import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{QUOTED}@127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    assert main(["--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: MLFLOW_TRACKING_URI carries credentials and MLFLOW_TRACKING_USERNAME")
    assert SECRET not in err and QUOTED not in err


def test_log_records_lose_every_remembered_secret_and_uri_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{QUOTED}@127.0.0.1:9")
    credentials.guard_credentials()
    logger = logging.getLogger("llamaflow.test")
    with caplog.at_level(logging.INFO, logger="llamaflow.test"):
        logger.info("a library echoes %s and http://bob:hunter2-xyz@host/x", SECRET)
        try:
            raise RuntimeError(f"request to http://127.0.0.1:9 with password {SECRET} failed")
        except RuntimeError:
            logger.exception("failed")
    text = caplog.text
    assert "a library echoes *** and http://bob:***@host/x" in text
    assert SECRET not in text and "hunter2-xyz" not in text
    assert "with password *** failed" in text  # the traceback too


def _remote_step() -> tuple[str, dict]:
    """prefect.yaml's `remote` build step: the step function's name and its inputs."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for step in spec["build"]:
        ((name, inputs),) = step.items()
        if inputs.get("id") == "remote":
            return name, {k: v for k, v in inputs.items() if k != "id"}
    raise AssertionError("prefect.yaml has no build step with id 'remote'")


@pytest.mark.parametrize(
    ("origin", "refused"),
    [
        ("https://ghp_TOKEN123@github.com/org/llamaflow.git", True),
        ("https://x-access-token:ghp_TOKEN123@github.com/org/llamaflow.git", True),
        ("ssh://git:ghp_TOKEN123@git.example.com/llamaflow.git", True),
        ("https://github.com/org/llamaflow.git", False),
        ("git@github.com:org/llamaflow.git", False),
    ],
)
def test_the_deployment_refuses_an_origin_that_carries_credentials(
    origin: str,
    refused: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """prefect.yaml's own `remote` build step, run by the step function `prefect deploy` runs (Prefect's
    step runner around it only fills in templates, which this step has none of)."""
    import importlib

    name, inputs = _remote_step()
    module, _, function = name.rpartition(".")
    step = getattr(importlib.import_module(module), function)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "remote", "add", "origin", origin], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    if refused:
        with pytest.raises(RuntimeError):
            asyncio.run(step(**inputs))
        shown = capfd.readouterr()
        assert "carries credentials" in shown.err and "credential helper" in shown.err
        assert "ghp_TOKEN123" not in shown.out + shown.err
    else:
        assert asyncio.run(step(**inputs))["stdout"] == origin
