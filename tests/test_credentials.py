"""Credentials given inside a URI are taken out at the door and never shown: the door itself (what every
entry point calls), the command line refusing conflicting credentials, log records, and the deployment's
build step refusing an origin that carries a token. What a whole run stores is searched in
tests/test_services.py, against authenticated servers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import string
import subprocess
import urllib.parse
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


# ------------------------------------------------------------------ generated passwords and URI forms
# Every printable class (letters, digits, punctuation, the space), as typed into a URI (raw) or encoded:
# what `redact` shows of it must hold none of it. A password holding "://" would start another URI in text:
# not generated. Seeded: a failure names its sample and reproduces.
CLASSES = (string.ascii_letters, string.digits, string.punctuation, " ")
URI_FORMS = (
    "http://{user}:{pw}@127.0.0.1:5000/api/2.0/mlflow/runs/get",
    "https://{user}:{pw}@mlflow.example.com",
    "http://{user}:{pw}@mlflow:5000/x",
    "postgresql://{user}:{pw}@db.internal:5432/mlflow",
    "postgresql+psycopg://{user}:{pw}@db/mlflow?sslmode=require",
    "postgresql://{user}@db/mlflow?sslmode=require&password={pw_encoded}",
    "postgresql://db/mlflow?password={pw_encoded}",
    "http://{user}:{pw_encoded}@127.0.0.1:5000",
)
CONTEXTS = (
    "{uri}",
    "View run at: {uri}",
    "'{uri}'",
    '"{uri}" failed',
    "<{uri}>",
    "`{uri}`",
    "({uri}) and http://127.0.0.1:9/other",
    "error: {uri}\nnext line",
)


def _password(rng: random.Random) -> str:
    chosen = [rng.choice(cls) for cls in CLASSES]  # one of each class, then any printable
    chosen += [rng.choice("".join(CLASSES)) for _ in range(rng.randint(4, 16))]
    rng.shuffle(chosen)
    password = "".join(chosen).strip()  # as a password field takes it
    return password if "://" not in password and len(password) >= 8 else _password(rng)


def test_redact_hides_every_generated_password_in_every_uri_form_and_context() -> None:
    rng = random.Random(41)
    shown = []
    for sample in range(600):
        password = _password(rng)
        uri = rng.choice(URI_FORMS).format(
            user=rng.choice(("alice", "llama", "worker")),
            pw=password,
            pw_encoded=urllib.parse.quote(password, safe=""),
        )
        text = rng.choice(CONTEXTS).format(uri=uri)
        redacted = credentials.redact(text)
        pieces = {password, urllib.parse.quote(password, safe="")}
        # A piece of at least 4 characters that is not in the text around the URI may not survive.
        leaked = [p for p in pieces if p in redacted]
        if leaked:
            shown.append((sample, text, redacted))
    assert shown == [], shown[:3]


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("http://alice:2024/x@host", "http://alice:***@host"),  # user:digits is no host:port here
        ("http://alice:pa ss@host/x", "http://alice:***@host/x"),
        ("http://alice:pa'ss\"<w>`@host/x", "http://alice:***@host/x"),
        (
            "postgresql://llama@db/mlflow?password=s3cr3t&sslmode=require",
            "postgresql://***@db/mlflow?password=***&sslmode=require",  # a lone user reads as a token
        ),
        ("http://127.0.0.1:5000/models/x@champion", "http://127.0.0.1:5000/models/x@champion"),
    ],
)
def test_redact_closes_the_reported_gaps(uri: str, shown: str) -> None:
    assert credentials.redact(f"at {uri} now") == f"at {shown} now"


def test_the_door_takes_a_libpq_query_password_out(environ: dict[str, str]) -> None:
    environ["MLFLOW_TRACKING_URI"] = "postgresql://llama@db/mlflow?sslmode=require&password=p%40ss+w"
    credentials.guard_credentials(environ)
    assert environ == {
        "MLFLOW_TRACKING_URI": "postgresql://llama@db/mlflow?sslmode=require",
        "PGPASSWORD": "p@ss w",
    }


def test_a_sweep_storage_url_goes_through_the_same_door(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sweep code calls on its Optuna storage URL before it is stored or shown anywhere."""
    monkeypatch.delenv("PGPASSWORD", raising=False)
    clean = credentials.clean_uri("postgresql+psycopg2://optuna:pa ss@db/optuna", "LLAMAFLOW_SWEEP_STORAGE")
    assert clean == "postgresql+psycopg2://optuna@db/optuna"
    assert os.environ["PGPASSWORD"] == "pa ss"
    assert credentials.redact("mysql://optuna:pa ss@db/optuna") == "mysql://optuna:***@db/optuna"
