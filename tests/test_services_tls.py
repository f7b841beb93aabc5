"""`flows.services up --tls` (what `--host` beyond loopback gets): stunnel in front of both servers on
127.0.0.2, a loopback address that MLflow counts neither as localhost (for its CORS checks) nor among its
default hosts, so the public URL is checked as a LAN address would be. The public ports speak TLS only
(plain HTTP gets no HTTP answer; the servers themselves are not on that address), the certificate is
trusted through env.sh's bundle and by nothing else, a tiny run with env.sh sourced completes over it
without its password in anything it printed or the directory stored, and the MLflow UI's POST from the
public origin is accepted while another origin's is refused.
"""

from __future__ import annotations

import base64
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from flows import services as stores
from flows.services.tls import TlsOptions
from prefect_server import TINY_RUN, cli_flags

pytestmark = pytest.mark.e2e
PUBLIC = "127.0.0.2"
PG_OWNER = "daemon"
RUN = {**TINY_RUN, "max_steps": 2, "checkpoint_every": 2, "dtype": "fp32", "num_samples": 0}


@pytest.fixture(scope="module")
def services() -> Iterator[stores.Services]:
    base = Path(tempfile.mkdtemp(prefix="llamaflow-tls-"))
    base.chmod(0o755)  # PostgreSQL runs as an unprivileged user, who must be able to enter it
    root = base / "stores"
    try:
        yield stores.up(
            root, host=PUBLIC, pg_user=PG_OWNER, mlflow_workers=1, tls_options=TlsOptions(tls=True)
        )
    finally:
        stores.down(root)
        shutil.rmtree(base, ignore_errors=True)


def _env(services: stores.Services) -> dict[str, str]:
    lines = (Path(services.root) / "env.sh").read_text().splitlines()
    pairs = [line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export ")]
    return {key: value.strip("'") for key, value in pairs}


def _request(url: str, context: ssl.SSLContext, **kwargs) -> int:  # noqa: ANN003
    try:
        with urllib.request.urlopen(urllib.request.Request(url, **kwargs), timeout=60, context=context) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_public_ports_speak_tls_only_with_the_directorys_ca(services: stores.Services) -> None:
    env = _env(services)
    bundle = env["SSL_CERT_FILE"]
    assert {
        env[k]
        for k in ("REQUESTS_CA_BUNDLE", "PREFECT_API_SSL_CERT_FILE", "MLFLOW_TRACKING_SERVER_CERT_PATH")
    } == {bundle}
    for url in (services.mlflow_tracking_uri, services.prefect_api_url):
        parts = urlsplit(url)
        assert parts.scheme == "https" and parts.hostname == PUBLIC
        plain = http.client.HTTPConnection(PUBLIC, parts.port, timeout=30)
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # no HTTP answer in clear
            plain.request("GET", "/health")
            plain.getresponse()
        plain.close()
    trusted = ssl.create_default_context(cafile=bundle)
    assert _request(f"{services.mlflow_tracking_uri}/health", trusted) == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _request(f"{services.mlflow_tracking_uri}/health", ssl.create_default_context())
    for port in (services.mlflow_port, services.prefect_port):  # the servers: loopback's 127.0.0.1 only
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((PUBLIC, port), timeout=10).close()
    assert (Path(services.root) / "tls" / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    assert (Path(services.root) / "tls" / "server-key.pem").stat().st_mode & 0o777 == 0o600


def test_the_mlflow_ui_posts_from_the_public_origin_only(services: stores.Services) -> None:
    env = _env(services)
    trusted = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    admin = f"{env['MLFLOW_TRACKING_USERNAME']}:{env['MLFLOW_TRACKING_PASSWORD']}"
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Basic {base64.b64encode(admin.encode()).decode()}",
    }
    search = f"{services.mlflow_tracking_uri}/ajax-api/2.0/mlflow/experiments/search"
    for origin, expected in ((services.mlflow_tracking_uri, 200), ("https://evil.example", 403)):
        status = _request(search, trusted, data=b'{"max_results": 1}', headers={**headers, "Origin": origin})
        assert status == expected, origin


def test_a_tiny_run_with_env_sh_completes_over_tls_and_stores_no_password(
    services: stores.Services, tmp_path: Path
) -> None:
    root = Path(services.root)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_")) and k != "PYTHONPATH"
    }
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), PREFECT_HOME=str(tmp_path / "prefect"))
    command = f'. "{root / "env.sh"}" && exec "{sys.executable}" -m flows.pretrain "$@"'
    done = subprocess.run(
        ["bash", "-c", command, "run", *cli_flags(RUN)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "registered: models:/llamaflow-tiny/" in output
    assert f"https://{PUBLIC}:" in output  # the flow reached the servers through the proxy's URLs

    kept = stores.Secrets.load(root)
    secrets = [kept.mlflow_admin_password, kept.prefect_auth_string.partition(":")[2], kept.postgres_password]
    private = {root / "secrets.json", root / "env.sh"}
    stored = [("output", output.encode())]
    for place in (root, tmp_path):
        for path in place.rglob("*"):
            if path.is_file() and path not in private and "postgres" not in path.parts:
                stored.append((str(path), path.read_bytes()))
    assert any(name.endswith("stunnel.log") for name, _ in stored)
    assert [(name, s[:4]) for name, data in stored for s in secrets if s.encode() in data] == []


def test_tls_is_on_beyond_loopback_and_bad_tls_options_are_named_with_the_fix(tmp_path: Path) -> None:
    services, _ = stores.configure(tmp_path / "a", host="0.0.0.0", public_host="stores.example")
    assert services.tls and services.bind_host == "127.0.0.1"
    assert services.mlflow_tracking_uri == f"https://stores.example:{services.proxy_ports['mlflow']}"
    assert "REQUESTS_CA_BUNDLE" in services.client_env()
    own = TlsOptions(
        public_urls={"mlflow": "https://mlflow.example.org/", "prefect": "https://p.example.org"}
    )
    services, _ = stores.configure(tmp_path / "b", host="198.18.0.1", tls_options=own)
    assert not services.tls and services.bind_host == "198.18.0.1"  # the user's proxy reaches them there
    assert services.mlflow_tracking_uri == "https://mlflow.example.org"
    assert services.prefect_api_url == "https://p.example.org/api"
    refused = {
        "go together": TlsOptions(cert=str(tmp_path / "c.pem")),
        "in clear": TlsOptions(public_urls={"mlflow": "http://mlflow.example.org"}),
        "no credentials": TlsOptions(public_urls={"mlflow": "https://u:p@mlflow.example.org"}),
        "expected prefect=URL": TlsOptions(public_urls={"minio": "https://x.example.org"}),
        "drop --tls": TlsOptions(tls=True, public_urls={"mlflow": "https://mlflow.example.org"}),
    }
    for fix, options in refused.items():
        with pytest.raises(stores.ServicesError, match=fix):
            stores.configure(tmp_path / "c", host="0.0.0.0", tls_options=options)
