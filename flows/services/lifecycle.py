"""`up`, `down` and what runs: the three stores as one unit.

`up` keeps what runs as asked and starts or restarts the rest, in dependency order: a server whose launch
changed (a new PostgreSQL port after a restart, authentication turned on, another address) is restarted,
so no server is left pointing at a database that moved. Only processes this directory started and that are
still the same processes (pid, start time, command line) are trusted or signalled. When `up` fails, it stops
what it started itself and leaves alone what was running before it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from flows.services import postgres, servers
from flows.services.processes import alive, free_port, port_is_free, stop_tree
from flows.services.state import (
    LOOPBACK,
    Secrets,
    Services,
    advertised_host,
    is_loopback,
    load,
    save,
)


def running(services: Services) -> dict[str, bool]:
    state = {"postgres": postgres.running(services)}
    for name in servers.SERVERS:
        record = services.servers.get(name)
        state[name] = record is not None and record.identity.is_running()
    return state


def _launches(services: Services, secrets: Secrets | None, mlflow_workers: int) -> dict[str, servers.Launch]:
    return {
        "prefect": servers.prefect_launch(services, secrets),
        "mlflow": servers.mlflow_launch(services, secrets, mlflow_workers),
    }


def configure(
    root: Path,
    *,
    host: str | None = None,
    public_host: str | None = None,
    auth: bool = False,
    pg_user: str = "nobody",
) -> tuple[Services, Secrets | None]:
    """The services of `root` as asked (its saved state, then the arguments), and their secrets when
    authentication is on; nothing is started. Authentication is on when asked (`auth`), when listening
    beyond loopback, or when it was on before: it is never turned off for a directory."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    services = load(root) or Services(str(root), free_port(), free_port(), free_port(), pg_user)
    services.pg_user = pg_user
    services.host = host or services.host
    if public_host:
        services.public_host = public_host
    elif host is not None:
        services.public_host = LOOPBACK if is_loopback(host) else advertised_host(host)
    services.auth = services.auth or auth or not is_loopback(services.host)
    return services, (Secrets.load_or_create(root) if services.auth else None)


def up(
    root: Path,
    *,
    host: str | None = None,
    public_host: str | None = None,
    auth: bool = False,
    pg_user: str = "nobody",
    timeout_s: float = 180.0,
    mlflow_workers: int = 2,
) -> Services:
    """Start whatever of the three is not running as asked (see `configure`); returns the services (URLs,
    ports, processes)."""
    services, secrets = configure(root, host=host, public_host=public_host, auth=auth, pg_user=pg_user)
    state = running(services)
    started: list[str] = []
    try:
        if state["postgres"]:
            services.pg_port = postgres.running_port(services) or services.pg_port
            if services.pg_launch != postgres.launch(services):  # e.g. authentication turned on
                _stop_servers(services)  # the database's clients first
                postgres.stop(services)
                state = running(services)
        if not state["postgres"]:
            if not port_is_free(services.pg_port):
                services.pg_port = free_port()  # the old port was taken meanwhile
            started.append("postgres")
            postgres.start(services, secrets)
            services.pg_launch = postgres.launch(services)
        for name in servers.SERVERS:
            launch = _launches(services, secrets, mlflow_workers)[name]
            record = services.servers.get(name)
            if state[name] and record is not None and record.launch == launch.fingerprint:
                continue
            if state[name] and record is not None:
                # Ours, and still the same process, but started otherwise than asked now (the database
                # moved to another port, authentication turned on): restarted, never left on the old URL.
                stop_tree(services.servers.pop(name).pid)
            port = f"{name}_port"
            if not port_is_free(getattr(services, port)):
                setattr(services, port, free_port())
                launch = _launches(services, secrets, mlflow_workers)[name]
            started.append(name)
            servers.start(name, launch, services, timeout_s)
    except BaseException:
        _stop_started(services, started)
        save(services)
        raise
    save(services)
    return services


def _stop_servers(services: Services) -> None:
    for name in reversed(servers.SERVERS):  # MLflow, then Prefect
        record = services.servers.pop(name, None)
        if record is not None and record.identity.is_running():
            stop_tree(record.pid)
        elif record is not None and alive(record.pid):
            warnings.warn(
                f"not stopping pid {record.pid}: it is not the {name} server {services.root} started (its start "
                "or command line differs: the pid was reused)",
                RuntimeWarning,
                stacklevel=2,
            )


def _stop_started(services: Services, started: list[str]) -> None:
    """After a failed `up`: stop what it started, nothing that ran before it."""
    for name in reversed(started):
        if name == "postgres":
            postgres.stop(services)
            continue
        record = services.servers.pop(name, None)
        if record is not None and record.identity.is_running():
            stop_tree(record.pid)


def down(root: Path) -> None:
    """Stop the servers and PostgreSQL; the data stays in `root` for the next `up`."""
    services = load(root.resolve())
    if services is None:
        return
    _stop_servers(services)
    postgres.stop(services)
    save(services)
