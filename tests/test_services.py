"""`flows.services` as an `up` without flags but `--tls` leaves it (one set of stores for the module, started
over the unauthenticated PostgreSQL cluster an older `up` left: that `up` migrates it), with stunnel on
127.0.0.2 in front of the servers on 127.0.0.1 as `--host` beyond loopback gets it (127.0.0.2 is neither
localhost nor a default host to MLflow, so its checks of the public URL are those of a LAN address): the
public ports speak TLS only, trusted through the directory's CA, and the MLflow UI's POST from the public
origin is accepted (another origin's refused); each server refuses a
request without credentials and accepts the clients'; another local user (`nobody`) gets into none of them
and reads none of their files; each MLflow role can do what it says and nothing more (a test per refusal);
the servers' environment holds nothing of the operator's; a whole tiny flow given its credentials inside
the URIs completes, registers as a least-privilege worker and is promoted by the promoter, and nothing it
printed or stored holds a password; a worker with wrong credentials stops at its start with one line;
Prefect's logs and state messages, the flow-run URL tag and placement errors never show one. Then the
lifecycle: a failed `up` leaves what ran, PostgreSQL moved to another port takes both servers along, an
`up` killed while waiting is stopped by `down`, strangers holding saved pids are neither trusted nor
signalled, and ports in TIME_WAIT count as free.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import certifi
import psutil
import pytest

from flows import services as stores
from flows.services import postgres, servers, tls
from flows.services.processes import (
    ProcessIdentity,
    free_port,
    port_is_free,
    start_detached,
    start_mark,
    stop_tree,
)
from flows.services.state import CA_VARIABLES
from flows.services.tls import TlsOptions
from prefect_server import TINY_RUN, cli_flags
from tasks.registry.decision import TAG_PROMOTED

pytestmark = pytest.mark.e2e
MLFLOW_WORKERS = 1  # one uvicorn process: the smallest server that is still the real one
STRANGER = "nobody"  # another local user; the clusters of this module belong to PG_OWNER
PG_OWNER = "daemon"
LOOPBACK_HOST = "127.0.0.1"
PUBLIC = "127.0.0.2"  # where stunnel listens (the TLS of `--host` beyond loopback)
CANARY = "LLAMAFLOW_TEST_OPERATOR_SECRET"  # in the operator's environment when `up` runs
# fp32: CPUs without AVX-512 BF16 run bf16 matmuls at a fraction of fp32's speed; precision is not under test.
RUN = {**TINY_RUN, "max_steps": 4, "dtype": "fp32"}


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    # Not pytest's tmp_path: PostgreSQL runs as an unprivileged user, who must be able to enter it.
    path = Path(tempfile.mkdtemp(prefix="llamaflow-services-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def services(base: Path) -> Iterator[stores.Services]:
    from flows.services.state import save

    root = base / "stores"
    try:
        # What an older `up` without authentication left: a cluster that trusts every local connection.
        older, _ = stores.configure(root, no_auth=True, pg_user=PG_OWNER)
        postgres.start(older, None)
        with postgres.connect(older, None, autocommit=True) as conn:  # its databases, the superuser's
            for name in postgres.DATABASES:
                conn.execute(f'CREATE DATABASE "{name}"')
        older.pg_launch = postgres.launch(older)
        save(older)
        os.environ[CANARY] = "operator-secret-canary"
        try:
            up = stores.up(
                root,
                host=PUBLIC,
                pg_user=PG_OWNER,
                mlflow_workers=MLFLOW_WORKERS,
                tls_options=TlsOptions(tls=True),
            )
            # This process's clients (urllib, MLflow's, Prefect's) trust the CA as env.sh tells them to.
            trust = {k: v for k, v in up.client_env().items() if k in CA_VARIABLES}
            assert sorted(trust) == sorted(CA_VARIABLES)
            with pytest.MonkeyPatch.context() as patch:
                for key, value in trust.items():
                    patch.setenv(key, value)
                yield up
        finally:
            del os.environ[CANARY]
    finally:
        stores.down(root)


def _read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


@pytest.fixture(scope="module")
def worker_env(services: stores.Services) -> dict[str, str]:
    return _read_env(stores.add_user(services, "worker"))


@pytest.fixture(scope="module")
def promoter_env(services: stores.Services) -> dict[str, str]:
    return _read_env(stores.add_user(services, "promoter", promoter=True))


@pytest.fixture(scope="module")
def reader_env(services: stores.Services) -> dict[str, str]:
    stores.add_user(services, "reader")  # first a worker: becoming a reader takes its grants away
    return _read_env(stores.add_user(services, "reader", read_only=True))


def _status(url: str, body: object, auth: str | None = None, origin: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Origin": origin} if origin else {})}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_each_server_refuses_a_request_without_credentials_and_accepts_the_clients(
    services: stores.Services,
) -> None:
    import psycopg

    env = services.client_env()
    flows_url = f"{services.prefect_api_url}/flows/filter"
    assert _status(flows_url, {}) == 401
    assert _status(flows_url, {}, "admin:wrong") == 401
    assert _status(flows_url, {}, env["PREFECT_API_AUTH_STRING"]) == 200

    search = f"{services.mlflow_tracking_uri}/api/2.0/mlflow/experiments/search"
    admin = f"{env['MLFLOW_TRACKING_USERNAME']}:{env['MLFLOW_TRACKING_PASSWORD']}"
    assert _status(search, {"max_results": 1}) == 401
    assert _status(search, {"max_results": 1}, "admin:wrong") == 401
    assert _status(search, {"max_results": 1}, admin) == 200

    for password, refusal in ((None, "no password supplied"), ("wrong", "password authentication failed")):
        with pytest.raises(psycopg.OperationalError, match=refusal):
            psycopg.connect(services.database_url("mlflow"), password=password, connect_timeout=30).close()
    kept = stores.Secrets.load(Path(services.root))
    with psycopg.connect(services.database_url("mlflow"), password=kept.postgres_password) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None, reason="another local user needs root and runuser"
)


def _as_stranger(*args: str) -> subprocess.CompletedProcess[str]:
    command = ["runuser", "-u", STRANGER, "--", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/")


def _stranger_status(url: str) -> str:
    # -k: the CA bundle is the operator's file; what is tested is authentication, not trust
    args = ["curl", "-k", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", url, "-d", "{}"]
    return _as_stranger(*args).stdout


@needs_root
def test_another_local_user_gets_into_no_store_after_a_plain_up(services: stores.Services) -> None:
    """The issue's reproduction, from the `nobody` account: no password to PostgreSQL, no credentials to
    the two APIs; all refused."""
    psql = shutil.which("psql") or postgres.pg_bin("psql")
    for host in (LOOPBACK_HOST, str(Path(services.root) / "postgres")):  # TCP, and the Unix socket
        login = ["-w", "-h", host, "-p", str(services.pg_port), "-U", "llamaflow", "-d", "postgres"]
        done = _as_stranger(psql, *login, "-c", "SELECT 1")
        assert done.returncode != 0 and "(1 row)" not in done.stdout, done.stdout
        assert "no password supplied" in done.stderr or "Permission denied" in done.stderr, done.stderr
    for prefect, mlflow in (
        (services.prefect_ui_url, services.mlflow_tracking_uri),  # through stunnel
        (f"http://{LOOPBACK_HOST}:{services.prefect_port}", f"http://{LOOPBACK_HOST}:{services.mlflow_port}"),
    ):
        assert _stranger_status(f"{prefect}/api/flows/filter") == "401"
        assert _stranger_status(f"{mlflow}/api/2.0/mlflow/experiments/search") == "401"


def test_prefect_answers_cross_origin_requests_from_its_own_ui_only(services: stores.Services) -> None:
    def preflight(origin: str) -> str | None:
        request = urllib.request.Request(
            f"{services.prefect_api_url}/flows/filter",
            method="OPTIONS",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.headers.get("access-control-allow-origin")
        except urllib.error.HTTPError as err:
            return err.headers.get("access-control-allow-origin")

    assert preflight("http://evil.example") is None
    assert preflight(services.prefect_ui_url) == services.prefect_ui_url


def test_the_public_ports_speak_tls_only_with_the_directorys_ca(services: stores.Services) -> None:
    bundle = os.environ["SSL_CERT_FILE"]  # env.sh's, which the fixture set
    for url in (services.mlflow_tracking_uri, services.prefect_api_url):
        parts = urlsplit(url)
        assert parts.scheme == "https" and parts.hostname == PUBLIC
        plain = http.client.HTTPConnection(PUBLIC, parts.port, timeout=30)
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # no HTTP answer in clear
            plain.request("GET", "/health")
            plain.getresponse()
        plain.close()
    health = f"{services.mlflow_tracking_uri}/health"
    with urllib.request.urlopen(health, timeout=60, context=ssl.create_default_context(cafile=bundle)) as ok:
        assert ok.status == 200
    public_cas = ssl.create_default_context(cafile=certifi.where())
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(health, timeout=60, context=public_cas)
    for port in (services.mlflow_port, services.prefect_port):  # the servers: on 127.0.0.1 only
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((PUBLIC, port), timeout=10).close()
    for key in ("ca-key.pem", "server-key.pem"):
        assert (Path(services.root) / "tls" / key).stat().st_mode & 0o777 == 0o600


def test_the_mlflow_ui_posts_from_the_public_origin_only(services: stores.Services) -> None:
    env = services.client_env()
    admin = f"{env['MLFLOW_TRACKING_USERNAME']}:{env['MLFLOW_TRACKING_PASSWORD']}"
    search = f"{services.mlflow_tracking_uri}/ajax-api/2.0/mlflow/experiments/search"
    for origin, expected in ((services.mlflow_tracking_uri, 200), ("https://evil.example", 403)):
        status = _status(search, {"max_results": 1}, admin, origin=origin)  # a failure shows no password
        assert status == expected, origin


def test_the_mlflow_ui_offers_logout_to_each_user(
    services: stores.Services, worker_env: dict[str, str]
) -> None:
    """The UI shows its logout (and change-password) entries only when `users/current` says basic auth."""
    env = services.client_env()
    url = f"{services.mlflow_tracking_uri}/ajax-api/2.0/mlflow/users/current"
    for user, password, admin in (
        (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"], True),
        ("worker", worker_env["MLFLOW_TRACKING_PASSWORD"], False),
    ):
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            current = json.loads(answer.read())
        assert current["is_basic_auth"] is True
        assert (current["user"]["username"], current["user"]["is_admin"]) == (user, admin)


def test_the_servers_environment_holds_nothing_of_the_operators(services: stores.Services) -> None:
    postmaster = postgres.postmaster(services)
    assert postmaster is not None
    pids = {"postgres": postmaster.pid, **{name: r.pid for name, r in services.servers.items()}}
    for name, pid in pids.items():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
        assert CANARY not in names, name
        clients = {"PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_API_KEY"}  # the operator's
        assert not {n for n in names if n.startswith("MLFLOW_TRACKING") or n in clients}, (name, names)
    postgres_environ = Path(f"/proc/{pids['postgres']}/environ").read_bytes()
    assert b"PGPASSWORD" not in postgres_environ and b"MLFLOW" not in postgres_environ


def test_each_server_connects_as_its_own_role_which_is_no_superuser(services: stores.Services) -> None:
    import psycopg

    kept = stores.Secrets.load(Path(services.root))
    with postgres.connect(services, kept, autocommit=True) as conn:
        roles = dict(
            conn.execute("SELECT rolname, rolsuper FROM pg_roles WHERE rolname IN ('prefect', 'mlflow')")
        )
        seen = set(conn.execute("SELECT usename, datname FROM pg_stat_activity WHERE datname <> 'postgres'"))
        # The handed-over path: what the superuser created in a server's database before the roles.
        with postgres.connect(services, kept, "prefect", autocommit=True) as prefect_db:
            prefect_db.execute("CREATE TABLE legacy_probe (id serial PRIMARY KEY)")
        try:
            postgres.create_databases(services, kept)  # what every `up` runs
            with postgres.connect(services, kept, "prefect") as prefect_db:
                owner = prefect_db.execute(
                    "SELECT tableowner FROM pg_tables WHERE tablename = 'legacy_probe'"
                ).fetchone()
        finally:
            with postgres.connect(services, kept, "prefect", autocommit=True) as prefect_db:
                prefect_db.execute("DROP TABLE legacy_probe")
    assert roles == {"prefect": False, "mlflow": False}
    assert {("prefect", "prefect"), ("mlflow", "mlflow")} <= seen
    assert not [who for who in seen if who[0] == "llamaflow"], seen  # the servers do not use the superuser
    assert owner == ("prefect",)
    url = services.database_url("mlflow", user="prefect")  # the other server's database: refused
    with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
        psycopg.connect(url, password=kept.database_passwords["prefect"], connect_timeout=30).close()


def test_status_says_authentication_is_on_and_secrets_stay_in_private_files(
    services: stores.Services, capsys: pytest.CaptureFixture[str]
) -> None:
    from flows.services.__main__ import main

    root = Path(services.root)
    assert main(["status", "--dir", str(root)]) == 0
    shown = capsys.readouterr().out
    assert "auth      on" in shown and "mlflow    running" in shown
    assert stores.load(root).auth  # the plain `up` migrated the unauthenticated directory
    kept = stores.Secrets.load(root)
    secrets = [kept.postgres_password, kept.prefect_auth_string, kept.mlflow_admin_password]
    assert not [s for s in secrets if s in shown]
    for name in ("secrets.json", "env.sh"):
        assert (root / name).stat().st_mode & 0o777 == 0o600, name
    exports = (root / "env.sh").read_text()
    assert f"export PREFECT_API_AUTH_STRING={kept.prefect_auth_string}" in exports
    assert f"export MLFLOW_TRACKING_URI={services.mlflow_tracking_uri}\n" in exports  # no user-info in URLs
    assert "@" not in services.prefect_api_url + services.mlflow_tracking_uri
    for launch in (servers.prefect_launch(services, kept), servers.mlflow_launch(services, kept, 1)):
        assert not [s for s in secrets if s in " ".join(launch.fingerprint)]  # argument lists are public


def _mlflow_as(services: stores.Services, env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    from mlflow.tracking import MlflowClient

    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, env[key])
    return MlflowClient(services.mlflow_tracking_uri, services.mlflow_tracking_uri)


def _admin_env(services: stores.Services) -> dict[str, str]:
    return services.client_env()


def _refusals(attempts: dict[str, Callable[[], object]]) -> dict[str, Exception]:
    """Each attempt's MLflow error, every one a 403; an attempt that succeeds is left out (and fails the caller)."""
    from mlflow.exceptions import MlflowException

    errors: dict[str, Exception] = {}
    for what, attempt in attempts.items():
        try:
            attempt()
        except MlflowException as err:
            assert "403" in str(err), (what, err)
            errors[what] = err
    return errors


def _forgeries(client, version: str) -> dict[str, Callable[[], object]]:  # noqa: ANN001
    """Writes of the promotion decision's tags, which later decisions trust (`DECISION_TAGS`)."""
    from tasks.registry.decision import TAG_PROMOTER_SCORE

    record = '{"bits_per_byte": "0.001", "validation_text": "x", "dtype": "fp32"}'
    tag = client.set_model_version_tag
    return {
        "forge the decision's score": lambda: tag("llamaflow-tiny", version, TAG_PROMOTER_SCORE, record),
        "mark its version promoted": lambda: tag("llamaflow-tiny", version, TAG_PROMOTED, "true"),
        "remove the decision's mark": lambda: client.delete_model_version_tag(
            "llamaflow-tiny", version, TAG_PROMOTED
        ),
    }


def test_the_worker_user_writes_runs_and_versions_but_cannot_delete_promote_or_manage_users(
    services: stores.Services, worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:

    from tasks.registry.promoter import refused

    admin = _mlflow_as(services, _admin_env(services), monkeypatch)
    elsewhere = admin.create_experiment("not-the-workers")
    client = _mlflow_as(services, worker_env, monkeypatch)
    experiment = client.get_experiment_by_name("llamaflow-tiny")
    run = client.create_run(experiment.experiment_id)
    client.log_metric(run.info.run_id, "probe", 1.0)
    client.set_terminated(run.info.run_id)
    version = client.create_model_version(
        "llamaflow-tiny", source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    ).version
    client.set_model_version_tag("llamaflow-tiny", version, "note", "its own tags are the worker's")
    forbidden = {
        **_forgeries(client, version),
        "create a version with a decision tag": lambda: client.create_model_version(
            "llamaflow-tiny",
            source=f"{run.info.artifact_uri}/model",
            run_id=run.info.run_id,
            tags={TAG_PROMOTED: "true"},
        ),
        "move an alias": lambda: client.set_registered_model_alias("llamaflow-tiny", "champion", version),
        "delete a version": lambda: client.delete_model_version("llamaflow-tiny", version),
        "write an experiment not granted": lambda: client.create_run(elsewhere),
        "delete its experiment": lambda: client.delete_experiment(experiment.experiment_id),
        "delete a run": lambda: client.delete_run(run.info.run_id),
        "delete its model": lambda: client.delete_registered_model("llamaflow-tiny"),
        "create a user": lambda: _auth_client(services).create_user("intruder", "Intruder-password-1"),
        "make itself admin": lambda: _auth_client(services).update_user_admin("worker", True),
    }
    refusals = _refusals(forbidden)
    assert sorted(refusals) == sorted(forbidden)  # every attempt refused with a 403
    # what the registering flow says when a worker's alias move is refused
    assert "LLAMAFLOW_PROMOTER_USERNAME" in str(
        refused(refusals["move an alias"], "champion", "llamaflow-tiny")
    )


def test_the_promoter_moves_aliases_and_holds_the_promotion_lock(
    services: stores.Services, worker_env: dict[str, str], promoter_env: dict[str, str], monkeypatch
) -> None:
    from tasks.registry.lock import promotion_lock
    from tasks.registry.promoter import promoter_client

    assert "LLAMAFLOW_PROMOTER_PASSWORD" not in worker_env
    client = _mlflow_as(services, worker_env, monkeypatch)  # the flow runs as the worker, ...
    experiment = client.get_experiment_by_name("llamaflow-tiny")
    run = client.create_run(experiment.experiment_id)
    version = client.create_model_version(
        "llamaflow-tiny", source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    ).version
    for key in ("LLAMAFLOW_PROMOTER_USERNAME", "LLAMAFLOW_PROMOTER_PASSWORD"):
        monkeypatch.setenv(key, promoter_env[key])
    promoter = promoter_client(services.mlflow_tracking_uri)  # ... and promotes as the promoter
    assert promoter is not None
    with promotion_lock(promoter, "llamaflow-tiny", wait_s=60) as lease:
        promoter.set_registered_model_alias("llamaflow-tiny", "probe-champion", version)
        assert lease.held()
    assert client.get_model_version_by_alias("llamaflow-tiny", "probe-champion").version == version
    promoter.delete_registered_model_alias("llamaflow-tiny", "probe-champion")  # the fence's undo does
    for write in _forgeries(promoter, version).values():  # the decision's tags: the promoter's to write
        write()


def test_a_reader_holds_no_prefect_secret_and_writes_nothing(
    services: stores.Services, reader_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:

    assert not [key for key in reader_env if key.startswith("PREFECT_API_AUTH") or "PROMOTER" in key]
    admin = _mlflow_as(services, _admin_env(services), monkeypatch)
    experiment = admin.get_experiment_by_name("llamaflow-tiny").experiment_id
    run = admin.create_run(experiment).info.run_id
    client = _mlflow_as(services, reader_env, monkeypatch)
    assert client.get_experiment(experiment).name == "llamaflow-tiny"  # it reads
    assert client.search_runs([experiment], max_results=1)
    forbidden = {
        "create a run (a grant it had as a worker)": lambda: client.create_run(experiment),
        "log to a run": lambda: client.log_metric(run, "probe", 1.0),
        "tag an experiment": lambda: client.set_experiment_tag(experiment, "k", "v"),
        "create an experiment": lambda: client.create_experiment("readers-own"),
        "create a model": lambda: client.create_registered_model("readers-own"),
        "tag a model": lambda: client.set_registered_model_tag("llamaflow-tiny", "k", "v"),
    }
    assert sorted(_refusals(forbidden)) == sorted(forbidden)  # every attempt refused with a 403


def _auth_client(services: stores.Services):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from mlflow.server.auth.client import AuthServiceClient
    return AuthServiceClient(services.mlflow_tracking_uri)


def _with_userinfo(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


def _texts_under(root: Path, skip: set[Path]) -> Iterator[tuple[Path, bytes]]:
    for path in root.rglob("*"):
        if path.is_file() and path not in skip and path.stat().st_size < 50_000_000:
            yield path, path.read_bytes()


def _dump(services: stores.Services, database: str) -> bytes:
    kept = stores.Secrets.load(Path(services.root))
    dump = postgres.pg_bin("pg_dump", postgres.data_dir(services))
    done = subprocess.run(
        [dump, "--data-only", services.database_url(database)],
        env={**os.environ, "PGPASSWORD": kept.postgres_password},
        capture_output=True,
        check=True,
    )
    return done.stdout


def test_a_tiny_flow_given_credentials_inside_its_uris_completes_and_stores_none_of_them(
    services: stores.Services, worker_env: dict[str, str], promoter_env: dict[str, str], base: Path
) -> None:
    """The issue's reproduction: MLFLOW_TRACKING_URI=http://worker:PASSWORD@... (and the Prefect API URL
    alike) on the command line, over TLS (the proxy's https URLs; the CA bundle the worker's env file names,
    as env.sh does). The run registers as the least-privilege worker and its promotion step
    moves `@champion` as the promoter; then everything it printed and everything both stores hold (their
    databases, artifact files, logs) is searched."""
    root = Path(services.root)
    kept = stores.Secrets.load(root)
    mlflow_password = worker_env["MLFLOW_TRACKING_PASSWORD"]
    prefect_password = kept.prefect_auth_string.partition(":")[2]
    place = base / "cli"
    place.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_")) and k not in ("PYTHONPATH", "PGPASSWORD")
    }
    env.update(
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        PREFECT_HOME=str(place / "prefect"),
        MLFLOW_TRACKING_URI=_with_userinfo(services.mlflow_tracking_uri, "worker", mlflow_password),
        PREFECT_API_URL=_with_userinfo(services.prefect_api_url, "admin", prefect_password),
        LLAMAFLOW_PROMOTER_USERNAME=promoter_env["LLAMAFLOW_PROMOTER_USERNAME"],
        LLAMAFLOW_PROMOTER_PASSWORD=promoter_env["LLAMAFLOW_PROMOTER_PASSWORD"],
    )
    env.update({key: worker_env[key] for key in CA_VARIABLES})  # TLS: the worker's env file's CA bundle
    done = subprocess.run(
        [sys.executable, "-m", "flows.pretrain", *cli_flags(RUN)],
        cwd=place,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "registered: models:/llamaflow-tiny/" in output

    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = (
        "admin",
        kept.mlflow_admin_password,
    )
    try:
        client = MlflowClient(services.mlflow_tracking_uri, services.mlflow_tracking_uri)
        found = client.search_runs([client.get_experiment_by_name("llamaflow-tiny").experiment_id])
        (run,) = [r for r in found if "prefect.flow_run_id" in r.data.tags]  # the flow's, not a probe's
        champion = client.get_model_version_by_alias("llamaflow-tiny", "champion")
    finally:
        del os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
    assert champion.run_id == run.info.run_id  # promoted by the promoter (the worker may not)
    assert run.data.tags["prefect.flow_run_url"].startswith(services.prefect_ui_url)
    assert run.data.params  # the search below covers them (the mlflow database)

    private = {root / "secrets.json", root / "env.sh", *(root / "users").iterdir()}
    stored: list[tuple[str, bytes]] = [("output", output.encode())]
    stored += [(f"database {name}", _dump(services, name)) for name in postgres.DATABASES]
    cluster = set((root / "postgres" / "data").rglob("*"))  # its content is in the dumps; its log is searched
    stored += [(str(p), data) for p, data in _texts_under(root, private | cluster)]
    stored += [(str(p), data) for p, data in _texts_under(place, set())]
    home = Path(os.environ["LLAMAFLOW_HOME"]) / "runs"
    stored += [(str(p), data) for p, data in _texts_under(home, set())]
    assert run.info.run_id.encode() in b"".join(data for _, data in stored[1:3])  # the search sees the run
    assert any("mlflow-artifacts" in name for name, _ in stored)  # and its artifact files
    assert any(name.endswith("stunnel.log") for name, _ in stored)  # and the proxy's log
    secrets = [mlflow_password, prefect_password, kept.postgres_password, kept.mlflow_admin_password]
    secrets.append(promoter_env["LLAMAFLOW_PROMOTER_PASSWORD"])
    leaks = [(name, secret[:4]) for name, data in stored for secret in secrets if secret.encode() in data]
    assert leaks == []


def test_no_file_of_the_stores_is_open_to_other_users(services: stores.Services) -> None:
    """After the tiny flow: its artifacts, the servers' logs, the cluster, the secrets: owner only."""
    root = Path(services.root)
    assert root.stat().st_mode & 0o777 in (0o700, 0o711)  # others may pass through to the cluster, not list
    artifacts = [p for p in (root / "mlflow-artifacts").rglob("*") if p.is_file()]
    assert artifacts  # the run's, written by the MLflow server
    opened = [
        f"{oct(path.stat().st_mode & 0o777)} {path}"
        for path in root.rglob("*")
        if not path.is_socket() and path.stat().st_mode & 0o077
    ]
    assert opened == []
    if os.geteuid() == 0 and shutil.which("runuser"):
        done = _as_stranger("cat", str(root / "mlflow-server.log"), str(root / "secrets.json"))
        assert done.returncode != 0 and "Permission denied" in done.stderr


def test_a_worker_with_wrong_credentials_stops_at_its_start_with_one_line(
    services: stores.Services, worker_env: dict[str, str]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(worker_env, PREFECT_HOME=str(Path(services.root).parent / "worker-prefect"))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    command = [sys.executable, "-m", "flows.pool.worker", "--pool", "credential-check-pool"]

    def start(**changes: str) -> list[str]:
        done = subprocess.run(command, env={**env, **changes}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stdout + done.stderr
        return done.stderr.strip().splitlines()

    (line,) = start(PREFECT_API_AUTH_STRING="admin:wrong")
    assert line.startswith(
        f"error: the Prefect API at {services.prefect_api_url} refused this worker's credentials"
    )
    (line,) = start()  # the right credentials: the pool is missing
    assert line.startswith("error: work pool 'credential-check-pool' does not exist")
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    settings = {
        PREFECT_API_URL: services.prefect_api_url,
        PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"],
    }
    with temporary_settings(updates=settings), get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="credential-check-pool", type="process"))
    (line,) = start(MLFLOW_TRACKING_PASSWORD="wrong-password")
    assert line.startswith(
        f"error: MLflow tracking server at {services.mlflow_tracking_uri} refused the credentials"
    )
    assert "wrong-password" not in line


def test_prefect_logs_states_tags_and_placement_errors_show_no_credentials(
    services: stores.Services, worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The places themselves, given a credentialed URI behind the door's back: a Prefect API URL holding
    the auth string (placement's error), and an MLflow URI holding a password passed to a task whose
    MLflow call fails (Prefect's logs, the flow run's parameters and the task's state message)."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pool.placement import PlacementError, check_placement
    from flows.pretrain_config import PretrainConfig
    from tasks.tracking import store

    kept = stores.Secrets.load(Path(services.root))
    prefect_password = kept.prefect_auth_string.partition(":")[2]
    mlflow_password = worker_env["MLFLOW_TRACKING_PASSWORD"]
    api = _with_userinfo(services.prefect_api_url, "admin", prefect_password)
    closed = free_port()
    tracking = _with_userinfo(f"http://127.0.0.1:{closed}", "worker", mlflow_password)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(key, raising=False)

    # The URI reaches the task as code would hand it over, not as a parameter (Prefect stores parameters:
    # no llamaflow flow or task takes a credentialed URI as one).
    @task(retries=0)
    def look_up() -> str:
        return store.run_status("0" * 32, tracking)

    @flow(name="credentials-places")
    def places() -> str:
        return look_up()

    with temporary_settings(updates={PREFECT_API_URL: api}):
        with pytest.raises(PlacementError) as refused:
            check_placement(
                PretrainConfig(preset="tiny", placement="deployment", train_deployment="x/nowhere")
            )
        state = places(return_state=True)
        APILogHandler().flush()  # the logs are sent in the background: all of them, now
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(state.state_details.flow_run_id)
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]}))
    assert state.is_failed()
    shown = [str(refused.value), json.dumps(flow_run.parameters), str(state.message)]
    shown += [log.message for log in logs] + [str(t.state.message) for t in task_runs]
    text = "\n".join(shown)
    assert f"127.0.0.1:{closed}" in text  # MLflow's failure is there, with the URL it asked
    assert "x/nowhere" in text and "admin:***@" in text
    leaks = [
        (name, secret[:4])
        for name, secret in (("prefect", prefect_password), ("mlflow", mlflow_password))
        if secret in text
    ]
    assert leaks == [], text


def test_the_flow_run_url_tag_holds_no_credentials(services: stores.Services) -> None:
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.tracking import runs

    kept = stores.Secrets.load(Path(services.root))
    prefect_password = kept.prefect_auth_string.partition(":")[2]

    @flow(name="credentials-tag")
    def tagged() -> dict[str, str]:
        return runs.flow_run_tags()

    with temporary_settings(
        updates={PREFECT_API_URL: _with_userinfo(services.prefect_api_url, "admin", prefect_password)}
    ):
        tags = tagged()
    assert tags["prefect.flow_run_url"].startswith(services.prefect_ui_url.replace("://", "://admin:***@"))
    assert prefect_password not in json.dumps(tags)


def test_a_failed_up_stops_only_what_it_started(services: stores.Services) -> None:
    root = Path(services.root)
    before = stores.load(root)
    stop_tree(before.servers.pop("mlflow").pid)  # MLflow down; PostgreSQL and Prefect healthy
    prefect = before.servers["prefect"]
    with pytest.raises(Exception, match="MLflow server"):
        stores.up(root, pg_user=PG_OWNER, mlflow_workers=MLFLOW_WORKERS, timeout_s=0.5)
    after = stores.load(root)
    assert stores.running(after) == {"postgres": True, "prefect": True, "mlflow": False, tls.PROXY: True}
    assert after.servers["prefect"] == prefect  # the same process, untouched


def test_postgres_back_on_another_port_takes_both_servers_along(services: stores.Services) -> None:
    root = Path(services.root)
    before = stores.load(root)
    postgres.stop(before)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past its own TIME_WAIT connections
        squatter.bind(("127.0.0.1", before.pg_port))
        squatter.listen()  # the old port is taken meanwhile: PostgreSQL comes back elsewhere
        after = stores.up(root, pg_user=PG_OWNER, mlflow_workers=MLFLOW_WORKERS)
    assert after.pg_port != before.pg_port
    assert after.servers["prefect"].pid != before.servers["prefect"].pid  # restarted on the new database
    env = after.client_env()
    admin = f"{env['MLFLOW_TRACKING_USERNAME']}:{env['MLFLOW_TRACKING_PASSWORD']}"
    # Requests that need the database: both servers reach it on its new port.
    assert _status(f"{after.prefect_api_url}/flows/filter", {}, env["PREFECT_API_AUTH_STRING"]) == 200
    assert (
        _status(f"{after.mlflow_tracking_uri}/api/2.0/mlflow/experiments/search", {"max_results": 1}, admin)
        == 200
    )


# ---------------------------------------------------------------------------------------- no servers


def test_authentication_is_on_by_default_and_never_turned_off(tmp_path: Path) -> None:
    services, secrets = stores.configure(tmp_path / "s", host="0.0.0.0")
    assert services.auth and secrets is not None
    assert postgres.launch(services)[-1] == "auth=True"
    mlflow = servers.mlflow_launch(services, secrets, 2)
    prefect = servers.prefect_launch(services, secrets)
    assert "basic-auth" in mlflow.args and "--allowed-hosts" in mlflow.args
    assert prefect.secret_env["PREFECT_SERVER_API_AUTH_STRING"] == secrets.prefect_auth_string
    assert mlflow.secret_env["MLFLOW_AUTH_ADMIN_PASSWORD"] == secrets.mlflow_admin_password
    # beyond loopback: the servers on loopback behind stunnel on every address; clients get a name, https
    assert "127.0.0.1" in prefect.args and "accept = 0.0.0.0:" in tls.proxy_launch(services).config
    assert services.prefect_api_url.startswith("https://") and "0.0.0.0" not in services.prefect_api_url
    from flows.services.state import save

    save(services)
    with pytest.raises(stores.ServicesError, match="--no-auth on 0.0.0.0"):
        stores.configure(tmp_path / "s", no_auth=True)  # beyond loopback: never open
    with pytest.raises(stores.ServicesError, match="never turned off: drop --no-auth"):
        stores.configure(tmp_path / "s", host="127.0.0.1", no_auth=True)
    assert stores.configure(tmp_path / "plain")[0].auth  # no flag: on, on loopback too


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


def test_an_object_store_gets_its_variables_and_nothing_else_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The servers' environment is scrubbed, but an S3 artifact destination needs the AWS variables of
    `up`'s environment: the MLflow server gets them (as secrets: names, not values, in services.json),
    the Prefect server and a local destination do not."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-canary")
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    local, kept = stores.configure(tmp_path / "local")
    assert not [
        k for k in servers.mlflow_launch(local, kept, 1).secret_env if k.startswith(("AWS_", "MLFLOW_S3"))
    ]
    s3, kept = stores.configure(tmp_path / "s3", artifacts_destination="s3://bucket/mlflow")
    launch = servers.mlflow_launch(s3, kept, 1)
    assert "s3://bucket/mlflow" in launch.args
    assert {k: launch.secret_env[k] for k in ("AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL")} == {
        "AWS_SECRET_ACCESS_KEY": "aws-secret-canary",
        "MLFLOW_S3_ENDPOINT_URL": "http://127.0.0.1:9000",
    }
    assert "aws-secret-canary" not in " ".join(launch.fingerprint)
    prefect = servers.prefect_launch(s3, kept)
    assert not [k for k in {**prefect.env, **prefect.secret_env} if k.startswith("AWS_")]


def test_no_auth_warns_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from flows.services import __main__ as cli

    monkeypatch.setattr(cli, "up", lambda root, **_: stores.configure(root, no_auth=True)[0])
    assert cli.main(["up", "--dir", str(tmp_path / "s"), "--no-auth"]) == 0
    shown = capsys.readouterr()
    assert "authentication OFF" in shown.out
    assert shown.err.strip().splitlines()[-1].startswith("WARNING: authentication is OFF")


def test_up_down_and_add_user_wait_for_each_other(tmp_path: Path) -> None:
    from flows.services.state import locked

    root = tmp_path / "s"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with locked(root):
        down = subprocess.Popen(
            [sys.executable, "-m", "flows.services", "down", "--dir", str(root)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert down.stdout.readline().startswith("waiting for another `flows.services` command")
            time.sleep(1.0)
            assert down.poll() is None  # still waiting for the holder
        except BaseException:
            down.kill()
            raise
    assert down.wait(timeout=120) == 0


def test_a_corrupt_state_file_is_named_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from flows.services.__main__ import main

    root = tmp_path / "s"
    root.mkdir()
    (root / "services.json").write_text('{"root": "/x", "pg_po')  # a write cut short
    assert main(["status", "--dir", str(root)]) == 1
    err = capsys.readouterr().err
    assert "services.json is corrupt" in err and "remove services.json" in err


@needs_root
def test_an_up_killed_while_waiting_is_stopped_by_down(base: Path) -> None:
    """`up` records each server before waiting for it: killed meanwhile (a Ctrl-C'd terminal, an OOM
    kill), it leaves nothing `down` does not know."""
    root = base / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "flows.services", "up", "--dir", str(root), "--pg-user", PG_OWNER]
    command += ["--no-auth", "--mlflow-workers", "1"]
    up = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefect = None
    try:
        deadline = time.monotonic() + 240
        while prefect is None and time.monotonic() < deadline and up.poll() is None:
            for child in psutil.Process(up.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmdline = child.cmdline()  # [python, .../bin/prefect, server, start, ...]
                    if "server" in cmdline and "start" in cmdline and "prefect" in " ".join(cmdline[:2]):
                        prefect = child
            time.sleep(0.1)
        assert prefect is not None, "the Prefect server was never started"
        time.sleep(2.0)  # `up` now waits for it to answer
        up.kill()
        up.wait()
        stores.down(root)
        gone, _ = psutil.wait_procs([prefect], timeout=30)
        assert gone, "down left the Prefect server of the killed `up` running"
        assert not postgres.running(stores.load(root))
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        stores.down(root)  # whatever it recorded (all of it, when it finished before the kill)
        if prefect is not None and prefect.is_running():
            stop_tree(prefect.pid, grace_s=1)
        postgres.stop(stores.configure(root, no_auth=True, pg_user=PG_OWNER)[0])


def test_strangers_holding_saved_pids_are_neither_trusted_nor_signalled(tmp_path: Path) -> None:
    from flows.services.state import ServerRecord, save

    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        services, _ = stores.configure(tmp_path / "s")
        # What the saved record of a server says: the stranger got its pid after it exited. Even its command
        # line is the stranger's: only the start (the server's was this test's) tells them apart.
        services.servers = {
            name: ServerRecord(stranger.pid, start_mark(os.getpid()), ["sleep", "300"], [])
            for name in servers.SERVERS
        }
        save(services)
        assert stores.running(stores.load(tmp_path / "s")) == {
            "postgres": False,
            "prefect": False,
            "mlflow": False,
        }
        with pytest.warns(RuntimeWarning, match=f"not stopping pid {stranger.pid}"):
            stores.down(tmp_path / "s")
        time.sleep(0.5)
        assert stranger.poll() is None, "down signalled a process it did not start"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_server_is_recognised_from_the_moment_it_is_started(tmp_path: Path) -> None:
    """`up` records who a server is right after starting it; read too early, the command line is empty (the
    exec has not set it up yet) and the server is never recognised again: `status` calls it stopped and
    `down` leaves it running. A quarter of the starts were caught so on a 2-core host."""
    script = tmp_path / "server"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(300)\n")  # as the `mlflow` command is
    script.chmod(0o755)
    seen: list[ProcessIdentity | None] = []
    try:
        for i in range(40):
            pid = start_detached([str(script), "--port", str(i)], os.environ, tmp_path / "server.log")
            seen.append(ProcessIdentity.of(pid))
        time.sleep(0.5)  # every start has long finished its exec
        recognised = [who is not None and who.is_running() for who in seen]
        assert all(recognised), f"{recognised.count(False)} of {len(seen)} servers not recognised"
    finally:
        for who in seen:
            if who is not None:
                stop_tree(who.pid, grace_s=1)


def test_a_running_server_stays_recognised_when_the_clock_is_adjusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psutil gives a process's start as its boot-relative start plus /proc/stat's btime, re-read on every
    call, and every step of the wall clock moves btime (NTP; a VM's clock set after a pause, by seconds or
    hours): a server saved before must still be recognised after, or `status` calls it stopped and `down`
    leaves it running."""
    from psutil import _pslinux

    from flows.services.state import ServerRecord, save

    server = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        services, _ = stores.configure(tmp_path / "s")
        seen = ProcessIdentity.of(server.pid)
        assert seen is not None
        services.servers = {
            name: ServerRecord(server.pid, seen.started, list(seen.cmdline), []) for name in servers.SERVERS
        }
        save(services)
        booted = _pslinux.boot_time
        monkeypatch.setattr(_pslinux, "boot_time", lambda: booted() + 3600.0)
        state = stores.running(stores.load(tmp_path / "s"))
        assert state["prefect"] and state["mlflow"], state
        stores.down(tmp_path / "s")
        assert server.wait(timeout=30) is not None  # down stopped the server it recognised
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_stop_tree_never_signals_a_process_group_it_did_not_create() -> None:
    # A leader with a child in its group: stopping the child must not take the leader's group down.
    leader = subprocess.Popen(
        ["bash", "-c", "sleep 300 & echo $!; exec sleep 301"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        child = int(leader.stdout.readline())
        assert os.getpgid(child) == leader.pid
        stop_tree(child, grace_s=1)
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert leader.poll() is None, "the leader's group was signalled"
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_a_port_in_time_wait_counts_as_free() -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and PostgreSQL do
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the check did before: the port looked taken
    assert port_is_free(port)


def test_a_port_is_free_only_when_the_servers_address_has_it() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.2", 0))  # another loopback address, which a `--host` may name
        squatter.listen()
        port = squatter.getsockname()[1]
        assert not port_is_free(port, "127.0.0.2")  # the check used to ask 127.0.0.1 only: "free"
        assert port_is_free(port, "127.0.0.1")


def test_pg_bin_takes_the_version_that_created_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = postgres.pg_bin("pg_ctl")
    version = postgres._major(real)
    other = tmp_path / "other-bin"
    other.mkdir()
    fake = other / "pg_ctl"
    fake.write_text("#!/bin/sh\necho 'pg_ctl (PostgreSQL) 99.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ['PATH']}")  # a newer PostgreSQL first on PATH
    data = tmp_path / "data"
    data.mkdir()
    (data / "PG_VERSION").write_text(f"{version}\n")
    chosen = postgres.pg_bin("pg_ctl", data)
    assert chosen != str(fake) and postgres._major(chosen) == version
    (data / "PG_VERSION").write_text("11\n")
    with pytest.raises(stores.ServicesError, match="created by PostgreSQL 11 .* postgresql-11"):
        postgres.pg_bin("pg_ctl", data)
