"""Tracking and registry through a real `mlflow server` over HTTPS (self-signed certificate, artifact proxy),
addressed with credentials in its URI, as production uses a server: TLS settings apply, artifacts travel as
mlflow-artifacts:, the password shows up nowhere."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from model import load_pretrained
from registry_world import SEQ_LEN, World, build_world, mlmodel_absolute_paths, one_thread, score, tiny_config
from tasks import register
from tasks.lookup import load_model
from tasks.tracking import store as tracking_store
from tasks.tracking.report import training_curves_figure
from tasks.tracking.sink import MlflowSink

SECRET = "pw-s3cr3t"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with one_thread():
        yield build_world(tmp_path_factory.mktemp("server-world"))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(https URI with user:password, the server's certificate)."""
    root = tmp_path_factory.mktemp("mlflow-tls-server")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    port = _free_port()
    mlflow_cli = str(Path(sys.executable).with_name("mlflow"))
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [mlflow_cli, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        + [
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "art"),
        ]
        + ["--uvicorn-opts", f"--ssl-keyfile {key} --ssl-certfile {cert}"],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    context = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(
                    f"https://127.0.0.1:{port}/health", timeout=1, context=context
                ) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not come up: {(root / 'server.log').read_text()[-2000:]}"
                )
            time.sleep(0.25)
        yield f"https://llama:{SECRET}@127.0.0.1:{port}", cert
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:  # uvicorn waits for the clients' keep-alive connections to close: not worth 20 s of a test
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_the_probe_uses_mlflows_tls_settings(
    tls_server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, cert = tls_server
    with pytest.raises(tracking_store.TrackingStoreUnavailable) as excinfo:
        tracking_store.check_tracking_store(uri)  # the self-signed certificate is not trusted yet
    assert SECRET not in str(excinfo.value) and "MLFLOW_TRACKING_SERVER_CERT_PATH" in str(excinfo.value)
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(cert))
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)  # restored (removed) after the test
    # The credentials leave the URI for the environment, where MLflow's client reads them.
    assert tracking_store.check_tracking_store(uri) == uri.replace(f"llama:{SECRET}@", "")
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "llama"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == SECRET


def test_tracking_and_registry_through_the_server(
    world: World, tls_server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    uri, cert = tls_server
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(cert))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    tracking_store.check_tracking_store()  # as every entry point does: the credentials leave the URI
    assert SECRET not in os.environ["MLFLOW_TRACKING_URI"]
    before = mlflow.get_tracking_uri()
    run_id = tracking_store.start_run("server-tests", run_name="over-https")
    tracking_store.log_params(run_id, {"model": tiny_config().to_dict()})
    tracking_store.log_datasets(run_id, world.dataset)
    sink = MlflowSink(run_id)
    history = {step: {"train/loss": 6.0 - 0.1 * step, "train/lr": 1e-3} for step in range(1, 26)}
    for step, metrics in history.items():
        sink.log_metrics(metrics, step)
    sink.close()
    tracking_store.get_client().log_figure(run_id, training_curves_figure(history), "loss_curve.png")
    result = register.register_model(
        run_id=run_id,
        checkpoint=world.trained,
        tokenizer=world.tokenizer,
        dataset=world.dataset,
        eval_result=score(world.trained, world.dataset, world.tokenizer),
        model_name="llamaflow-server",
        eval_device="cpu",
    )
    tracking_store.end_run(run_id)
    assert mlflow.get_tracking_uri() == before

    client = tracking_store.get_client()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), "artifacts travel through the server"
    assert run.data.params["model.hidden_size"] == "64"
    assert len(client.get_metric_history(run_id, "train/loss")) == 25
    assert {i.dataset.digest for i in run.inputs.dataset_inputs} == {world.dataset.fingerprint[:36]}
    assert "loss_curve.png" in [f.path for f in client.list_artifacts(run_id)]
    link = tracking_store.run_link(run_id)
    assert link.startswith("https://127.0.0.1:") and "/#/experiments/" in link and SECRET not in link

    assert result.promoted and result.version == "1"
    version = client.get_model_version("llamaflow-server", "1")
    logged = client.get_logged_model(version.model_id or version.source.removeprefix("models:/"))
    assert logged.artifact_location.startswith("mlflow-artifacts:/")
    local = Path(
        mlflow.artifacts.download_artifacts(
            "models:/llamaflow-server/1", dst_path=str(tmp_path), tracking_uri=uri
        )
    )
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    assert mlmodel_absolute_paths(mlmodel, [str(Path(world.trained.path).parent)]) == []

    stored = [
        str(run.data.params),
        str(run.data.tags),
        str(version.tags),
        str(version.description),
        str(mlmodel),
    ]
    assert not [text for text in stored if SECRET in text]
    model, _ = load_model("models:/llamaflow-server@champion")
    ids = torch.arange(3, 3 + SEQ_LEN).reshape(1, SEQ_LEN)
    with torch.no_grad():
        assert torch.equal(model(ids), load_pretrained(world.trained.path).eval()(ids))
