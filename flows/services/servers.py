"""The Prefect server and the MLflow tracking server of `flows.services`, on the PostgreSQL cluster.

With authentication on, the Prefect server asks every API request for its auth string
(`PREFECT_SERVER_API_AUTH_STRING`; clients send `PREFECT_API_AUTH_STRING`; `/api/health` stays open for
probes) and the MLflow server runs MLflow's basic-auth app (`--app-name basic-auth`, the `mlflow[auth]`
extra): users, passwords and permissions in its own database (`mlflow_auth` on the same cluster), its admin
created on first start with the generated password, and `flows.services.mlflow_policy` on top (who may move
aliases, who only reads). The Prefect server answers cross-origin requests from its own UI only. Secrets
reach the servers through their environment, never their argument lists (which every user of the machine
can read); that environment holds nothing else of the operator's (`processes.scrubbed_env`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from flows.services.mlflow_policy import ORIGIN_VARIABLE, ROLES_VARIABLE, origin_of
from flows.services.processes import ProcessIdentity, scrubbed_env, start_detached, wait_http
from flows.services.state import (
    ADMIN_USER,
    LOOPBACK,
    ROLES_FILE,
    Secrets,
    ServerRecord,
    Services,
    url_host,
    write_private,
)
from tasks.network import is_loopback

SERVERS = ("prefect", "mlflow")
AUTH_CONFIG = "mlflow-auth.ini"
# Users without a grant of their own may read every experiment and model (a registry user needs no
# grant); writing needs EDIT on the experiment or model, given by `python -m flows.services add-user`.
DEFAULT_PERMISSION = "READ"
POLICY_FUNCTION = "flows.services.mlflow_policy:authenticate"
# Read from `up`'s environment for an object store as the artifact destination (`--artifacts-destination`),
# for the MLflow server only: the clients' uploads go through it (`--serve-artifacts`).
OBJECT_STORE_VARIABLES = {
    "s3": (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
        "AWS_PROFILE",
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_CA_BUNDLE",
        "MLFLOW_S3_ENDPOINT_URL",
        "MLFLOW_S3_IGNORE_TLS",
        "MLFLOW_S3_UPLOAD_EXTRA_ARGS",
    ),
    "gs": ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT"),
    "wasbs": (
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCESS_KEY",
        "AZURE_CLIENT_ID",
        "AZURE_TENANT_ID",
        "AZURE_CLIENT_SECRET",
    ),
}
# The repository holding `flows`: the MLflow server imports the policy from the code that started it.
CODE_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Launch:
    """How a server is started: its argument list, and its environment (secrets only in `secret_env`)."""

    args: list[str]
    env: dict[str, str]
    secret_env: dict[str, str]
    health_url: str
    log: Path
    config_file: Path | None = None  # written before the start (no secret in it)
    config: str = ""

    @property
    def fingerprint(self) -> list[str]:
        """What a running server must match to be kept: arguments, environment, configuration file and the
        names (not the values: it is saved in services.json) of its secret variables."""
        env = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return [*self.args, *env, *self.config.splitlines(), *sorted(self.secret_env)]


def _base_env() -> dict[str, str]:
    env = scrubbed_env(PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(CODE_ROOT))
    # uvicorn and gunicorn are started by name: the interpreter's bin/ must be on PATH.
    env["PATH"] = ":".join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
    return env


def write_roles(services: Services, secrets: Secrets) -> None:
    """`mlflow-roles.json`, which the MLflow server's policy reads: the admin and the promoters may move
    aliases; readers only read."""
    roles = {"promoters": [ADMIN_USER, *sorted(secrets.promoters)], "readers": sorted(secrets.readers)}
    write_private(Path(services.root) / ROLES_FILE, json.dumps(roles, indent=2))


def prefect_launch(services: Services, secrets: Secrets | None) -> Launch:
    root = Path(services.root)
    prefect = str(Path(sys.executable).with_name("prefect"))
    args = [prefect, "server", "start", "--host", services.bind_host, "--port", str(services.prefect_port)]
    env = {
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_API_DATABASE_CONNECTION_URL": services.database_url("prefect", "asyncpg", user="prefect"),
        # The UI's own calls to the API: the address browsers reach, not the one the server binds.
        "PREFECT_UI_API_URL": services.prefect_api_url,
        # Not Prefect's default `*`: a page the operator opens elsewhere must not reach the API from the
        # browser (a deployment's pull step is a shell command a worker runs).
        "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": services.prefect_ui_url,
    }
    secret_env = {}
    if secrets is not None:
        secret_env = {
            "PGPASSWORD": secrets.database_passwords["prefect"],
            "PREFECT_SERVER_API_AUTH_STRING": secrets.prefect_auth_string,
        }
    health = f"http://{probe_host(services.bind_host)}:{services.prefect_port}/api/health"
    return Launch([*args, "--analytics-off"], env, secret_env, health, root / "prefect-server.log")


def mlflow_launch(services: Services, secrets: Secrets | None, workers: int) -> Launch:
    root = Path(services.root)
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    args = [
        mlflow,
        "server",
        "--host",
        services.bind_host,
        "--port",
        str(services.mlflow_port),
        "--backend-store-uri",
        services.database_url("mlflow", "psycopg", user="mlflow"),
        "--serve-artifacts",
        "--artifacts-destination",
        services.artifacts_destination or str(root / "mlflow-artifacts"),
        "--workers",
        str(workers),
        # uvicorn kills a worker that misses a 5 s health check: on a loaded machine, one still importing
        # MLflow's auth app would be killed and restarted over and over.
        "--uvicorn-opts",
        "--timeout-worker-healthcheck 60",
    ]
    public = urlsplit(services.mlflow_tracking_uri)
    if not is_loopback(services.host) or public.hostname not in ("localhost", LOOPBACK):
        # MLflow answers only Host headers it knows (DNS rebinding): localhost and private addresses by
        # default; and state-changing requests (the UI's POSTs) from browser origins on localhost only.
        name = url_host(public.hostname or LOOPBACK)
        hosts = ["localhost", "localhost:*", LOOPBACK, f"{LOOPBACK}:*", name, f"{name}:*"]
        origin = f"{public.scheme}://{name}" + (f":{public.port}" if public.port else "")
        args += ["--allowed-hosts", ",".join(dict.fromkeys(hosts)), "--cors-allowed-origins", origin]
    health = f"http://{probe_host(services.bind_host)}:{services.mlflow_port}/health"
    store_env = object_store_env(services.artifacts_destination)
    if secrets is None:
        return Launch(args, {}, store_env, health, root / "mlflow-server.log")
    env = {
        "MLFLOW_AUTH_CONFIG_PATH": str(root / AUTH_CONFIG),
        "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN_USER,
        ROLES_VARIABLE: str(root / ROLES_FILE),
        ORIGIN_VARIABLE: origin_of(services.mlflow_tracking_uri),
    }
    secret_env = {
        **store_env,
        "PGPASSWORD": secrets.database_passwords["mlflow"],
        "MLFLOW_AUTH_ADMIN_PASSWORD": secrets.mlflow_admin_password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.mlflow_flask_secret_key,
    }
    return Launch(
        [*args, "--app-name", "basic-auth"],
        env,
        secret_env,
        health,
        root / "mlflow-server.log",
        root / AUTH_CONFIG,
        _auth_config(services),
    )


def object_store_env(destination: str) -> dict[str, str]:
    """What the MLflow server needs of this process's environment to reach an object store as its artifact
    destination (credentials, region, endpoint: passed as secrets, their values kept out of services.json);
    nothing for a local directory."""
    scheme = urlsplit(destination).scheme
    names = OBJECT_STORE_VARIABLES.get("s3" if scheme.startswith("s3") else scheme, ())
    return {name: os.environ[name] for name in names if name in os.environ}


def probe_host(bound: str) -> str:
    """Where this machine asks a server bound to `bound` whether it is up: loopback for every address."""
    return url_host(LOOPBACK if bound in ("0.0.0.0", "::", "") else bound)


def _auth_config(services: Services) -> str:
    """MLflow's basic-auth settings (no secret in them: the admin password comes from the environment).

    Checking a password costs a PBKDF2 hash (Werkzeug's default: about 2 s a request on a loaded 2-core
    machine), which would make every metric upload that slow: a successful check is cached for 60 s per
    server worker. A password changed through the API on one worker may still work on another for as long.
    """
    return (
        "[mlflow]\n"
        f"default_permission = {DEFAULT_PERMISSION}\n"
        f"database_uri = {services.database_url('mlflow_auth', 'psycopg', user='mlflow')}\n"
        f"admin_username = {ADMIN_USER}\n"
        f"authorization_function = {POLICY_FUNCTION}\n"
        "auth_cache_ttl_seconds = 60\n"
    )


def start(
    name: str,
    launch: Launch,
    services: Services,
    timeout_s: float,
    on_started: Callable[[Services], None] = lambda _: None,
) -> ServerRecord:
    """Start server `name` as `launch` says, record it (`on_started`, before waiting: an interrupted wait
    leaves a server that `down` knows), wait until it answers, and return who it is."""
    root = Path(services.root)
    for private in (root / "prefect", root / "mlflow-artifacts"):
        private.mkdir(mode=0o700, exist_ok=True)
        private.chmod(0o700)  # one an older version made with the umask's mode
    if launch.config_file is not None:
        write_private(launch.config_file, launch.config)
    env = {**_base_env(), **launch.env, **launch.secret_env}
    pid = start_detached(launch.args, env, launch.log)
    identity = ProcessIdentity.of(pid) or ProcessIdentity(pid, "", tuple(launch.args))
    record = ServerRecord(pid, identity.started, list(identity.cmdline), launch.fingerprint)
    services.servers[name] = record
    on_started(services)
    what = {"prefect": "the Prefect server", "mlflow": "the MLflow server"}.get(name, f"the {name}")
    wait_http(launch.health_url, pid, launch.log, what, timeout_s)
    return record
