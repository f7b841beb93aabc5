"""The PostgreSQL cluster of `flows.services`: created, started, recognised and stopped.

It always listens on 127.0.0.1 only (its clients are the Prefect and MLflow servers on this machine). Each
server connects as a role of its own (`prefect`, `mlflow`: no superuser, owner of its own databases, which
no other role may connect to); the superuser `llamaflow` is `up`'s and the operator's. With authentication
on, every connection needs its role's password (SCRAM-SHA-256, `pg_hba.conf` written here); passwords are
set from SCRAM verifiers computed here, so no plain password reaches the server, a log or an argument list.
The servers read theirs from `PGPASSWORD` (libpq for MLflow, asyncpg for Prefect). PostgreSQL refuses to
run as root: as root, the cluster belongs to an unprivileged user.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from flows.services.processes import PRIVATE_UMASK, ProcessIdentity, scrubbed_env
from flows.services.state import DB_USER, LOOPBACK, SERVER_DATABASES, Secrets, Services, ServicesError
from tasks.credentials import redact, remember_secret

DATABASES = tuple(name for names in SERVER_DATABASES.values() for name in names)
PG_PACKAGE_HINT = (
    "install the PostgreSQL server (Debian/Ubuntu: `apt-get install postgresql`; Fedora: `dnf install "
    "postgresql-server`; macOS: `brew install postgresql@15`) or put its bin/ directory on PATH"
)
# Where distributions put each major version's server programs ({v}: the version).
VERSIONED_BIN_DIRS = (
    "/usr/lib/postgresql/{v}/bin",
    "/usr/pgsql-{v}/bin",
    "/opt/homebrew/opt/postgresql@{v}/bin",
    "/usr/local/opt/postgresql@{v}/bin",
)
HBA_WITH_AUTH = """\
# Written by flows.services: a password (SCRAM-SHA-256) for every connection; the server listens on loopback.
local   all   all                  scram-sha-256
host    all   all   127.0.0.1/32   scram-sha-256
host    all   all   ::1/128        scram-sha-256
"""


def data_dir(services: Services) -> Path:
    return Path(services.root) / "postgres" / "data"


def _major(program: str) -> str | None:
    """The major version of a PostgreSQL program (`15`, or `9.6` before 10), from `--version`."""
    try:
        out = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\)\s+(\d+)(?:\.(\d+))?", out)
    if found is None:
        return None
    return found[1] if int(found[1]) >= 10 else f"{found[1]}.{found[2]}"


def pg_bin(name: str, data: Path | None = None) -> str:
    """A PostgreSQL server program. For an existing cluster, of the version that created it (`PG_VERSION`:
    a server of another major version refuses its data directory); else the one on PATH, else the newest
    /usr/lib/postgresql/*/bin."""
    version_file = data / "PG_VERSION" if data is not None else None
    on_path = shutil.which(name)
    if version_file is None or not version_file.is_file():
        if on_path:
            return on_path
        found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: float(p.parts[-3]))
        if found:
            return str(found[-1])
        raise ServicesError(f"PostgreSQL's `{name}` was not found: {PG_PACKAGE_HINT}")
    version = version_file.read_text().strip()
    if on_path and _major(on_path) == version:
        return on_path
    for pattern in VERSIONED_BIN_DIRS:
        candidate = Path(pattern.format(v=version)) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    other = f" (the one on PATH, {on_path}, is version {_major(on_path)})" if on_path else ""
    raise ServicesError(
        f"the PostgreSQL cluster in {data} was created by PostgreSQL {version} and its `{name}` was not "
        f"found{other}: install PostgreSQL {version}'s server (Debian/Ubuntu: `apt-get install "
        f"postgresql-{version}`) or upgrade the cluster with pg_upgrade"
    )


def _as_pg_user(services: Services) -> dict[str, int | list[int]]:
    """Popen arguments that run a PostgreSQL program as the cluster's owner (root may not)."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(services.pg_user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _pg_run(services: Services, args: Sequence[str], what: str, stdin: str | None = None) -> None:
    done = subprocess.run(
        list(args),
        input=stdin,
        capture_output=True,
        text=True,
        cwd="/",
        env=scrubbed_env(),  # no credential of the operator's reaches the cluster's /proc/PID/environ
        umask=PRIVATE_UMASK,
        **_as_pg_user(services),
    )
    if done.returncode != 0:
        raise ServicesError(
            f"{what} failed ({done.returncode}):\n{redact((done.stdout + done.stderr)[-3000:])}"
        )


def _prepare_dir(services: Services) -> Path:
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
    pg.chmod(0o700)  # the cluster, its log and its socket: the owner's only
    return pg


def scram_verifier(password: str, iterations: int = 4096) -> str:
    """PostgreSQL's stored form of a SCRAM-SHA-256 password (RFC 5802/7677), as `CREATE ROLE` accepts it."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def postmaster(services: Services) -> ProcessIdentity | None:
    """The running postmaster of this cluster: the process its lock file names, if that process's command
    line names this data directory; None when the lock file is missing or stale (its pid now belongs to
    another process). Not the lock file's start time: a time of day, which moves with the clock."""
    data = data_dir(services)
    try:
        pid = int((data / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    who = ProcessIdentity.of(pid)
    if who is None or str(data) not in who.cmdline:
        return None
    return who if who.is_running() else None


def running(services: Services) -> bool:
    return postmaster(services) is not None


def running_port(services: Services) -> int | None:
    try:
        return int((data_dir(services) / "postmaster.pid").read_text().splitlines()[3])
    except (OSError, ValueError, IndexError):
        return None


def launch(services: Services) -> list[str]:
    """What a running cluster must match to be kept (else it is restarted): port, authentication."""
    return ["postgres", f"port={services.pg_port}", f"auth={services.auth}"]


def start(services: Services, secrets: Secrets | None) -> None:
    pg = _prepare_dir(services)
    data = data_dir(services)
    if not (data / "PG_VERSION").is_file():
        _pg_run(
            services,
            # Trust only until the password is set below, in single-user mode: no server listens before it.
            # With --no-auth (loopback only, asked for), it stays so.
            [pg_bin("initdb"), "-D", str(data), "-U", DB_USER, "--auth=trust", "-E", "UTF8"],
            "initdb",
        )
    if secrets is not None:
        # Before the server starts: no connection is ever accepted without the password.
        statement = f"ALTER ROLE {DB_USER} PASSWORD '{scram_verifier(secrets.postgres_password)}';\n"
        _pg_run(
            services,
            [pg_bin("postgres", data), "--single", "-j", "-D", str(data), "postgres"],
            "set",
            statement,
        )
        (data / "pg_hba.conf").write_text(HBA_WITH_AUTH)
    (data / "postmaster.pid").unlink(missing_ok=True)  # stale: `postmaster()` found no server behind it
    options = f"-p {services.pg_port} -k {pg} -c listen_addresses={LOOPBACK}"
    start = [
        pg_bin("pg_ctl", data),
        "-D",
        str(data),
        "-o",
        options,
        "-l",
        str(pg / "postgres.log"),
        "-w",
        "start",
    ]
    _pg_run(services, start, "pg_ctl start")


def connect(services: Services, secrets: Secrets | None, database: str = "postgres", **kwargs: object):
    """A psycopg connection to `database` as the `llamaflow` role (its password when authentication is on)."""
    import psycopg  # the `postgres` extra

    password = secrets.postgres_password if secrets is not None else None
    if password:
        remember_secret(password)
    return psycopg.connect(services.database_url(database), password=password, **kwargs)


# What a server's role takes over in a database created before it had one (tables, views, sequences not
# owned by a table, types and functions the superuser made, none of an extension's): ALTER ... OWNER each.
_HAND_OVER = """
DO $$
DECLARE r record;
BEGIN
  FOR r IN SELECT c.oid::regclass AS name, c.relkind FROM pg_class c
           JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = 'public' AND c.relowner = '{old}'::regrole AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
             AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = c.oid AND d.deptype IN ('a', 'i', 'e'))
  LOOP
    EXECUTE format('ALTER %s %s OWNER TO {new}', CASE r.relkind WHEN 'v' THEN 'VIEW'
      WHEN 'm' THEN 'MATERIALIZED VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, r.name);
  END LOOP;
  FOR r IN SELECT t.oid::regtype AS name FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
           WHERE n.nspname = 'public' AND t.typowner = '{old}'::regrole AND t.typtype IN ('e', 'd')
             AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = t.oid AND d.deptype = 'e')
  LOOP
    EXECUTE format('ALTER TYPE %s OWNER TO {new}', r.name);
  END LOOP;
  FOR r IN SELECT p.oid::regprocedure AS name FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
           WHERE n.nspname = 'public' AND p.proowner = '{old}'::regrole
             AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = p.oid AND d.deptype = 'e')
  LOOP
    EXECUTE format('ALTER ROUTINE %s OWNER TO {new}', r.name);
  END LOOP;
END $$;
"""


def create_databases(services: Services, secrets: Secrets | None) -> None:
    """Each server's role (a login, not a superuser; its password set from a SCRAM verifier) and its
    databases, which it owns and no other role may connect to. Databases made before the roles existed
    are handed over with everything the superuser had created in them. Run by every `up`."""
    with connect(services, secrets, autocommit=True) as conn:
        for role, databases in SERVER_DATABASES.items():
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            password = f" PASSWORD '{scram_verifier(secrets.database_passwords[role])}'" if secrets else ""
            verb = "ALTER" if exists else "CREATE"
            conn.execute(f'{verb} ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE{password}')
            for name in databases:
                if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                    conn.execute(f'CREATE DATABASE "{name}" OWNER "{role}"')
                else:
                    conn.execute(f'ALTER DATABASE "{name}" OWNER TO "{role}"')
                    with connect(services, secrets, name, autocommit=True) as inside:
                        inside.execute(_HAND_OVER.format(old=DB_USER, new=role))
                conn.execute(f'REVOKE CONNECT ON DATABASE "{name}" FROM PUBLIC')


def stop(services: Services) -> None:
    """Stop this cluster if it runs; a lock file whose pid is someone else's is left alone (no signal)."""
    data = data_dir(services)
    if running(services):
        _pg_run(
            services, [pg_bin("pg_ctl", data), "-D", str(data), "-m", "fast", "-w", "stop"], "pg_ctl stop"
        )
