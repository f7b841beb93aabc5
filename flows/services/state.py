"""What `flows.services` keeps in its directory: `services.json` (ports, addresses, whether authentication is
on, each server's process identity and launch), `secrets.json` (every generated secret), `mlflow-roles.json`
(who may move aliases, who only reads: read by the MLflow server's policy, `flows.services.mlflow_policy`)
and the client environments (`env.sh` for the operator, `users/NAME.env` for a user). Every file is written
whole (a scratch file renamed into place) with mode 0600. Secrets go into files only, never into a URL, an
argument list or the output.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shlex
import socket
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flows.services.processes import ProcessIdentity

STATE_FILE = "services.json"
SECRETS_FILE = "secrets.json"
ROLES_FILE = "mlflow-roles.json"
LOCK_FILE = ".lock"
ENV_FILE = "env.sh"
USERS_DIR = "users"
TLS_DIR = "tls"
CA_BUNDLE = "ca-bundle.pem"  # the public CAs and the directory's own (flows.services.tls)
# Where requests (MLflow's client), httpx (Prefect's), Prefect and MLflow read a CA bundle from.
CA_VARIABLES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "PREFECT_API_SSL_CERT_FILE",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
)
DB_USER = "llamaflow"  # the cluster's superuser: `up` and the operator's tools only
# Each server's own database role (no superuser, owner of its databases only) and those databases.
SERVER_DATABASES = {"prefect": ("prefect",), "mlflow": ("mlflow", "mlflow_auth")}
ADMIN_USER = "admin"
LOOPBACK = "127.0.0.1"


class ServicesError(RuntimeError):
    """The stores cannot be started, stopped or changed; the message says why and what to do."""


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass
class ServerRecord:
    """A server this directory started: who it is (pid, start, command line) and how it was launched."""

    pid: int
    started: str
    cmdline: list[str]
    launch: list[str]

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.started, tuple(self.cmdline))


@dataclass
class Services:
    root: str
    pg_port: int
    prefect_port: int
    mlflow_port: int
    pg_user: str
    host: str = LOOPBACK
    public_host: str = LOOPBACK
    auth: bool = False  # an older services.json without the field was unauthenticated
    pg_launch: list[str] = field(default_factory=list)  # how the running cluster was started
    servers: dict[str, ServerRecord] = field(default_factory=dict)
    # TLS (flows.services.tls): stunnel on `host` at `proxy_ports`, the servers on loopback; the user's own
    # certificate and key, if given; or `public_urls`: a proxy of the user's own, in front of the servers.
    tls: bool = False
    proxy_ports: dict[str, int] = field(default_factory=dict)
    tls_cert: str = ""
    tls_key: str = ""
    public_urls: dict[str, str] = field(default_factory=dict)
    artifacts_destination: str = ""  # the MLflow server's (an object store's URI); "": DIR/mlflow-artifacts

    @property
    def bind_host(self) -> str:
        """Where the servers listen: behind the TLS proxy, loopback only."""
        return LOOPBACK if self.tls else self.host

    def _public(self, name: str) -> str:
        if name in self.public_urls:
            return self.public_urls[name].rstrip("/")
        if self.tls:
            return f"https://{url_host(self.public_host)}:{self.proxy_ports[name]}"
        return f"http://{url_host(self.public_host)}:{getattr(self, f'{name}_port')}"

    @property
    def ca_bundle(self) -> Path | None:
        """What clients trust the proxy's certificate through (None: the user's own certificate, which the
        system's CAs vouch for, or no TLS of ours)."""
        if not self.tls or self.tls_cert:
            return None
        return Path(self.root) / TLS_DIR / CA_BUNDLE

    @property
    def prefect_api_url(self) -> str:
        return f"{self._public('prefect')}/api"

    @property
    def mlflow_tracking_uri(self) -> str:
        return self._public("mlflow")

    @property
    def prefect_ui_url(self) -> str:
        return self._public("prefect")

    def database_url(self, database: str, driver: str = "", user: str = DB_USER) -> str:
        """PostgreSQL on loopback as `user`, without a password (the servers read it from PGPASSWORD)."""
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{user}@{LOOPBACK}:{self.pg_port}/{database}"

    def client_env(self, mlflow_user: str | None = ADMIN_USER, prefect: bool = True) -> dict[str, str]:
        """What a client needs: the two URLs and, with authentication on, the credentials in the variables
        Prefect and MLflow read (never in the URLs). `mlflow_user`: whose MLflow credentials; `prefect`:
        whether it gets Prefect's auth string (Prefect has one identity: whoever holds it may create
        deployments, which run code on every worker, so a read-only user never does)."""
        env = {"PREFECT_API_URL": self.prefect_api_url, "MLFLOW_TRACKING_URI": self.mlflow_tracking_uri}
        if self.ca_bundle is not None:
            env.update(dict.fromkeys(CA_VARIABLES, str(self.ca_bundle)))
        if self.auth:
            kept = Secrets.load(Path(self.root))
            if prefect:
                env["PREFECT_API_AUTH_STRING"] = kept.prefect_auth_string
            if mlflow_user is not None:
                env["MLFLOW_TRACKING_USERNAME"] = mlflow_user
                env["MLFLOW_TRACKING_PASSWORD"] = kept.mlflow_password(mlflow_user)
        return env


@dataclass
class Secrets:
    """Every generated secret of one services directory (`secrets.json`, mode 0600)."""

    postgres_password: str
    prefect_auth_string: str
    mlflow_admin_password: str
    mlflow_flask_secret_key: str
    mlflow_users: dict[str, str] = field(default_factory=dict)
    promoters: list[str] = field(default_factory=list)  # users who may move aliases (`add-user --promoter`)
    readers: list[str] = field(default_factory=list)  # users who only read (`add-user --read-only`)
    database_passwords: dict[str, str] = field(default_factory=dict)  # each server's database role's

    @staticmethod
    def generate() -> str:
        return secrets.token_urlsafe(24)

    @classmethod
    def load(cls, root: Path) -> Secrets:
        path = root / SECRETS_FILE
        if not path.is_file():
            raise ServicesError(f"{path} does not exist: authentication is on but its secrets are gone")
        return cls(**read_json(path))

    @classmethod
    def load_or_create(cls, root: Path) -> Secrets:
        if (root / SECRETS_FILE).is_file():
            kept = cls.load(root)
        else:
            kept = cls(
                postgres_password=cls.generate(),
                prefect_auth_string=f"{ADMIN_USER}:{cls.generate()}",
                mlflow_admin_password=cls.generate(),
                mlflow_flask_secret_key=cls.generate(),
            )
        missing = [role for role in SERVER_DATABASES if role not in kept.database_passwords]
        for role in missing:  # a directory from before the servers had roles of their own gets them
            kept.database_passwords[role] = cls.generate()
        if missing or not (root / SECRETS_FILE).is_file():
            kept.save(root)
        return kept

    def save(self, root: Path) -> None:
        write_private(root / SECRETS_FILE, json.dumps(asdict(self), indent=2))

    def mlflow_password(self, user: str) -> str:
        if user == ADMIN_USER:
            return self.mlflow_admin_password
        if user not in self.mlflow_users:
            raise ServicesError(
                f"no MLflow user {user!r} was created here: `python -m flows.services add-user {user}`"
            )
        return self.mlflow_users[user]


def write_private(path: Path, text: str) -> None:
    """Write `path` readable by its owner only, from the first byte on (then renamed into place)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.unlink(missing_ok=True)
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(
            out.fileno()
        )  # whole on disk before it replaces the old one: a crash leaves one or the other
    os.replace(scratch, path)


def shell_exports(env: Mapping[str, str]) -> str:
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())


def env_file_lines(env: Mapping[str, str]) -> str:
    """KEY=VALUE lines: a Docker `--env-file`, a systemd `EnvironmentFile=`, `kubectl create secret generic
    --from-env-file`, or `set -a; . FILE; set +a` in a shell (the values are URL-safe, no quoting needed)."""
    return "".join(f"{key}={value}\n" for key, value in env.items())


def advertised_host(host: str) -> str:
    """The address clients use: the bound address, or this machine's name when bound to every address."""
    if host in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return host


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object this directory wrote; a clear error when it is not one (a crash or an edit broke it)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (ValueError, UnicodeDecodeError) as err:
        raise ServicesError(
            f"{path} is corrupt ({err}): restore it from a backup, or stop what runs from this directory by "
            f"hand and remove {path.name} (the data stays; the next `up` writes a new one)"
        ) from err


def load(root: Path) -> Services | None:
    path = root / STATE_FILE
    if not path.is_file():
        return None
    data = read_json(path)
    data.pop("pids", None)  # an older layout without process identities: nothing of it can be trusted
    try:
        data["servers"] = {name: ServerRecord(**record) for name, record in data.get("servers", {}).items()}
        return Services(**data)
    except TypeError as err:
        raise ServicesError(f"{path} is corrupt ({err}): restore it, or remove it (see above)") from err


def save(services: Services) -> None:
    root = Path(services.root)
    write_private(root / STATE_FILE, json.dumps(asdict(services), indent=2))
    env = services.client_env()
    text = "# Generated by `python -m flows.services`: source it to talk to these stores.\n" + shell_exports(
        env
    )
    write_private(root / ENV_FILE, text)


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold the directory's lock (`up`, `down` and `add-user` take it: two of them at once would race on
    its secrets, its state and the cluster's `postmaster.pid`). Waits for the holder; released on exit,
    even when the holder is killed (the kernel drops a dead process's lock)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another `flows.services` command on {root} to finish", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
