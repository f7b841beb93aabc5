"""Production stores on this machine, started by one command: PostgreSQL, a Prefect server and an MLflow
tracking server on it (artifacts proxied by the MLflow server), on free local ports, all data in one directory.

    python -m flows.services up [--dir DIR]      # or `make services`; prints the two URLs to export
    python -m flows.services status [--dir DIR]
    python -m flows.services down [--dir DIR]    # or `make services-down`; data stays for the next `up`

DIR defaults to `<LLAMAFLOW_HOME>/services`. It holds `postgres/` (the cluster, its log and socket),
`prefect/` (PREFECT_HOME of the server), `mlflow-artifacts/`, the servers' logs, `services.json` (ports and
process ids) and `env.sh` (the exports). PostgreSQL refuses to run as root: as root, the cluster belongs to
an unprivileged user (`--pg-user`, default `nobody`). The drivers come with the `postgres` extra
(asyncpg for Prefect, psycopg for MLflow: `pip install -e '.[postgres]'`); the PostgreSQL server binaries from the system (Debian/Ubuntu:
`apt-get install postgresql`; Fedora: `dnf install postgresql-server`; macOS: `brew install postgresql@15`).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flows.processes import ProcessError, alive, free_port, port_is_free, start_detached, stop_tree, wait_http

STATE_FILE = "services.json"
DB_USER = "llamaflow"
DATABASES = ("prefect", "mlflow")
PG_PACKAGE_HINT = (
    "install the PostgreSQL server (Debian/Ubuntu: `apt-get install postgresql`; Fedora: `dnf install "
    "postgresql-server`; macOS: `brew install postgresql@15`) or put its bin/ directory on PATH"
)


class ServicesError(RuntimeError):
    """The stores cannot be started or stopped; the message says why and what to do."""


@dataclass
class Services:
    root: str
    pg_port: int
    prefect_port: int
    mlflow_port: int
    pg_user: str
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def prefect_api_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    @property
    def mlflow_tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    def database_url(self, database: str, driver: str = "") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{DB_USER}@127.0.0.1:{self.pg_port}/{database}"

    def exports(self) -> str:
        return (
            f"export PREFECT_API_URL={self.prefect_api_url}\n"
            f"export MLFLOW_TRACKING_URI={self.mlflow_tracking_uri}\n"
        )


# ---------------------------------------------------------------------------------------- PostgreSQL


def pg_bin(name: str) -> str:
    """A PostgreSQL server program: on PATH, else the newest /usr/lib/postgresql/*/bin (Debian puts it there)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
    if candidates:
        return str(candidates[-1])
    raise ServicesError(f"PostgreSQL's `{name}` was not found: {PG_PACKAGE_HINT}")


def _as_pg_user(services: Services) -> dict[str, int | list[int]]:
    """Popen arguments that run a PostgreSQL program as the cluster's owner (root may not)."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(services.pg_user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _pg_run(services: Services, args: Sequence[str], what: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True, cwd="/", **_as_pg_user(services))
    if done.returncode != 0:
        raise ServicesError(f"{what} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def _prepare_pg_dir(services: Services) -> Path:
    pg = Path(services.root) / "postgres"
    pg.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        try:
            entry = pwd.getpwnam(services.pg_user)
        except KeyError as err:
            raise ServicesError(
                f"PostgreSQL refuses to run as root and user {services.pg_user!r} does not exist: "
                "pass --pg-user with an existing unprivileged user"
            ) from err
        os.chown(pg, entry.pw_uid, entry.pw_gid)
        probe = subprocess.run(["test", "-w", str(pg)], **_as_pg_user(services))
        if probe.returncode != 0:
            raise ServicesError(
                f"user {services.pg_user!r} cannot write {pg}: a parent directory is closed to other users "
                "(e.g. a 0700 temporary directory); choose --dir under a directory it can traverse"
            )
    return pg


def start_postgres(services: Services) -> None:
    pg = _prepare_pg_dir(services)
    data = pg / "data"
    if not (data / "PG_VERSION").is_file():
        _pg_run(
            services,
            [pg_bin("initdb"), "-D", str(data), "-U", DB_USER, "--auth=trust", "-E", "UTF8", "--no-sync"],
            "initdb",
        )
    options = f"-p {services.pg_port} -k {pg} -c listen_addresses=127.0.0.1"
    start = [pg_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(pg / "postgres.log"), "-w", "start"]
    _pg_run(services, start, "pg_ctl start")
    _create_databases(services)


def _create_databases(services: Services) -> None:
    import psycopg  # the `postgres` extra

    with psycopg.connect(services.database_url("postgres"), autocommit=True) as conn:
        for name in DATABASES:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{name}"')


def stop_postgres(services: Services) -> None:
    data = Path(services.root) / "postgres" / "data"
    if (data / "postmaster.pid").is_file():
        _pg_run(services, [pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], "pg_ctl stop")


# ---------------------------------------------------------------------------------------- servers


def _server_env(services: Services) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env.update(
        {
            "PREFECT_HOME": str(Path(services.root) / "prefect"),
            "PREFECT_API_DATABASE_CONNECTION_URL": services.database_url("prefect", "asyncpg"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
    )
    return env


def start_prefect(services: Services, timeout_s: float) -> None:
    root = Path(services.root)
    (root / "prefect").mkdir(exist_ok=True)
    log = root / "prefect-server.log"
    prefect = str(Path(sys.executable).with_name("prefect"))
    args = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(services.prefect_port)]
    pid = start_detached([*args, "--analytics-off"], _server_env(services), log)
    services.pids["prefect"] = pid
    wait_http(f"{services.prefect_api_url}/health", pid, log, "the Prefect server", timeout_s)


def start_mlflow(services: Services, timeout_s: float, workers: int) -> None:
    root = Path(services.root)
    artifacts = root / "mlflow-artifacts"
    artifacts.mkdir(exist_ok=True)
    log = root / "mlflow-server.log"
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    args = [
        mlflow,
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(services.mlflow_port),
        "--backend-store-uri",
        services.database_url("mlflow", "psycopg"),
        "--serve-artifacts",
        "--artifacts-destination",
        str(artifacts),
        "--workers",
        str(workers),
    ]
    env = _server_env(services)
    # uvicorn and gunicorn are started by name: the interpreter's bin/ must be on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    pid = start_detached(args, env, log)
    services.pids["mlflow"] = pid
    wait_http(f"{services.mlflow_tracking_uri}/health", pid, log, "the MLflow server", timeout_s)


# ---------------------------------------------------------------------------------------- commands


def default_dir() -> Path:
    from tasks import home

    return home.home() / "services"


def load(root: Path) -> Services | None:
    state = root / STATE_FILE
    if not state.is_file():
        return None
    return Services(**json.loads(state.read_text()))


def save(services: Services) -> None:
    root = Path(services.root)
    (root / STATE_FILE).write_text(json.dumps(asdict(services), indent=2))
    (root / "env.sh").write_text(services.exports())


def running(services: Services) -> dict[str, bool]:
    pid_file = Path(services.root) / "postgres" / "data" / "postmaster.pid"
    return {
        "postgres": pid_file.is_file() and alive(int(pid_file.read_text().split()[0])),
        "prefect": alive(services.pids.get("prefect")),
        "mlflow": alive(services.pids.get("mlflow")),
    }


def up(root: Path, *, pg_user: str = "nobody", timeout_s: float = 180.0, mlflow_workers: int = 2) -> Services:
    """Start whatever of the three is not running; returns the services (URLs, ports, pids)."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    services = load(root)
    if services is None:
        services = Services(str(root), free_port(), free_port(), free_port(), pg_user)
    state = running(services)
    for name, attr in (("postgres", "pg_port"), ("prefect", "prefect_port"), ("mlflow", "mlflow_port")):
        if not state[name] and not port_is_free(getattr(services, attr)):
            setattr(services, attr, free_port())  # the old port was taken meanwhile
    try:
        if not state["postgres"]:
            start_postgres(services)
        if not state["prefect"]:
            start_prefect(services, timeout_s)
        if not state["mlflow"]:
            start_mlflow(services, timeout_s, mlflow_workers)
    except BaseException:
        save(services)
        down(root)
        raise
    save(services)
    return services


def down(root: Path) -> None:
    """Stop the servers and PostgreSQL; the data stays in `root` for the next `up`."""
    services = load(root.resolve())
    if services is None:
        return
    for name in ("mlflow", "prefect"):  # clients of the database first
        pid = services.pids.pop(name, None)
        if pid and alive(pid):
            stop_tree(pid)
    stop_postgres(services)
    save(services)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.services", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--dir", type=Path, default=None, help="data directory (default: <LLAMAFLOW_HOME>/services)"
    )
    parser.add_argument(
        "--pg-user", default="nobody", help="owner of the PostgreSQL cluster when run as root"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for each server")
    args = parser.parse_args(argv)
    root = (args.dir or default_dir()).resolve()
    try:
        if args.command == "up":
            services = up(root, pg_user=args.pg_user, timeout_s=args.timeout)
            print(
                f"PostgreSQL {services.database_url('')}, Prefect UI http://127.0.0.1:{services.prefect_port}, "
                f"MLflow UI {services.mlflow_tracking_uri}; data and logs in {root}"
            )
            print(f"# export these (or: source {root / 'env.sh'}):")
            print(services.exports(), end="")
        elif args.command == "down":
            down(root)
            print(f"stopped; data kept in {root}")
        else:
            services = load(root)
            if services is None:
                print(f"no services in {root}")
                return 1
            state = running(services)
            for name, up_now in state.items():
                print(f"{name:9s} {'running' if up_now else 'stopped'}")
            print(services.exports(), end="")
            return 0 if all(state.values()) else 1
    except (ServicesError, ProcessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
