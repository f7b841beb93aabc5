"""`up`, `down` and what runs: the three stores as one unit.

`up` keeps what runs as asked and starts or restarts the rest, in dependency order: a server whose launch
changed (a new PostgreSQL port after a restart, authentication turned on, another address) is restarted,
so no server is left pointing at a database that moved. Only processes this directory started and that are
still the same processes (pid, start time, command line) are trusted or signalled. When `up` fails, it stops
what it started itself and leaves alone what was running before it; a server is recorded in `services.json`
before `up` waits for it, so a `down` stops even what an interrupted `up` left.

Authentication is on unless `no_auth` asks otherwise (loopback only, and never for a directory that had it
on): a directory started without it before is migrated by the next `up` (its cluster gets a password and
`pg_hba.conf`, both servers are restarted with theirs). `up`, `down` and `add-user` hold the directory's lock.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from urllib.parse import urlsplit

from flows.services import postgres, servers, tls
from flows.services.processes import alive, free_port, port_is_free, stop_tree
from flows.services.state import (
    Secrets,
    Services,
    ServicesError,
    advertised_host,
    load,
    locked,
    save,
)
from flows.services.tls import TlsOptions
from tasks.network import is_loopback


def _names(services: Services) -> tuple[str, ...]:
    """The processes after PostgreSQL, in start order: the servers, then the TLS proxy in front of them."""
    return (*servers.SERVERS, tls.PROXY) if services.tls else servers.SERVERS


def running(services: Services) -> dict[str, bool]:
    state = {"postgres": postgres.running(services)}
    for name in dict.fromkeys([*_names(services), *services.servers]):
        record = services.servers.get(name)
        state[name] = record is not None and record.identity.is_running()
    return state


def _launch(name: str, services: Services, secrets: Secrets | None, mlflow_workers: int) -> servers.Launch:
    if name == "prefect":
        return servers.prefect_launch(services, secrets)
    if name == "mlflow":
        return servers.mlflow_launch(services, secrets, mlflow_workers)
    return tls.proxy_launch(services)


def listenable(host: str) -> None:
    """Raise a ServicesError naming the fix when this machine cannot listen on `host`."""
    try:
        free_port(host)
    except OSError as err:
        raise ServicesError(
            f"--host {host}: this machine cannot listen there ({err.strerror}); give one of its own addresses "
            "(`ip -brief address`), or 0.0.0.0 to listen on all of them"
        ) from err


def configure(
    root: Path,
    *,
    host: str | None = None,
    public_host: str | None = None,
    no_auth: bool = False,
    pg_user: str = "nobody",
    tls_options: TlsOptions | None = None,
    artifacts_destination: str | None = None,
) -> tuple[Services, Secrets | None]:
    """The services of `root` as asked (its saved state, then the arguments), and their secrets when
    authentication is on; nothing is started. Authentication is on unless `no_auth`, which is refused
    beyond loopback and for a directory that had authentication on (it is never turned off). TLS: see
    `TlsOptions`."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    # Its owner's only; as root, others may pass through (not list) to reach the cluster's own directory.
    root.chmod(0o711 if os.geteuid() == 0 else 0o700)
    saved = load(root)
    services = saved or Services(str(root), free_port(), free_port(), free_port(), pg_user)
    services.pg_user = pg_user
    services.host = host or services.host
    if public_host:
        services.public_host = public_host
    elif host is not None:
        services.public_host = host if is_loopback(host) else advertised_host(host)
    if no_auth and not is_loopback(services.host):
        raise ServicesError(
            f"--no-auth on {services.host}: the stores would be open to the network; drop --no-auth "
            "(or listen on 127.0.0.1 only)"
        )
    if no_auth and saved is not None and saved.auth:
        raise ServicesError(
            f"authentication is on in {root} and is never turned off: drop --no-auth (to start over "
            "without it, `down` and remove the directory, losing its data)"
        )
    services.auth = not no_auth
    if artifacts_destination is not None:
        services.artifacts_destination = artifacts_destination
    (tls_options or TlsOptions()).apply(services, host_given=host is not None)
    if services.tls:
        listenable(services.host)
        for name in servers.SERVERS:
            services.proxy_ports.setdefault(name, free_port(services.host))
    reached = [services.mlflow_tracking_uri, services.prefect_api_url] if no_auth else []
    if [url for url in reached if not is_loopback(urlsplit(url).hostname or "")]:
        raise ServicesError(
            f"--no-auth with clients reaching the stores at {', '.join(reached)}: the stores would be open to "
            "the network; drop --no-auth (or every address and --public-url with it)"
        )
    return services, (Secrets.load_or_create(root) if services.auth else None)


def up(
    root: Path,
    *,
    host: str | None = None,
    public_host: str | None = None,
    no_auth: bool = False,
    pg_user: str = "nobody",
    timeout_s: float = 180.0,
    mlflow_workers: int = 2,
    tls_options: TlsOptions | None = None,
    artifacts_destination: str | None = None,
) -> Services:
    """Start whatever of the three (and the TLS proxy) is not running as asked (see `configure`); returns
    the services (URLs, ports, processes)."""
    with locked(root.resolve()):
        services, secrets = configure(
            root,
            host=host,
            public_host=public_host,
            no_auth=no_auth,
            pg_user=pg_user,
            tls_options=tls_options,
            artifacts_destination=artifacts_destination,
        )
        return _up(services, secrets, timeout_s, mlflow_workers)


def _up(services: Services, secrets: Secrets | None, timeout_s: float, mlflow_workers: int) -> Services:
    listenable(services.bind_host)  # before anything starts
    if secrets is not None:
        servers.write_roles(services, secrets)
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
            services.pg_launch = []  # until it answers: a `down` after an interrupted start stops it
            save(services)
            postgres.start(services, secrets)
            services.pg_launch = postgres.launch(services)
        postgres.create_databases(
            services, secrets
        )  # and each server's role, in a directory from before them
        _stop_unasked(services)
        if services.tls and not state.get(tls.PROXY):
            for name in servers.SERVERS:  # before the servers' launches, which name the public URLs
                if not port_is_free(services.proxy_ports[name], services.host):
                    services.proxy_ports[name] = free_port(services.host)
        for name in _names(services):
            launch = _launch(name, services, secrets, mlflow_workers)
            record = services.servers.get(name)
            if state[name] and record is not None and record.launch == launch.fingerprint:
                continue
            if state[name] and record is not None:
                # Ours, and still the same process, but started otherwise than asked now (the database
                # moved to another port, authentication turned on): restarted, never left on the old URL.
                stop_tree(services.servers.pop(name).pid)
            port = f"{name}_port"
            if name in servers.SERVERS and not port_is_free(getattr(services, port), services.bind_host):
                setattr(services, port, free_port(services.bind_host))
                launch = _launch(name, services, secrets, mlflow_workers)
            started.append(name)
            servers.start(name, launch, services, timeout_s, on_started=save)
    except BaseException:
        _stop_started(services, started)
        save(services)
        raise
    save(services)
    return services


def _stop_unasked(services: Services) -> None:
    """Stop a recorded process that is no longer asked for (the TLS proxy, once TLS is off)."""
    for name in [n for n in services.servers if n not in _names(services)]:
        record = services.servers.pop(name)
        if record.identity.is_running():
            stop_tree(record.pid)


def _stop_servers(services: Services) -> None:
    for name in reversed(list(services.servers)):  # the proxy, MLflow, then Prefect
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
    with locked(root.resolve()):
        services = load(root.resolve())
        if services is None:
            return
        _stop_servers(services)
        postgres.stop(services)
        save(services)
