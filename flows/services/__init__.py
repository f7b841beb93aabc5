"""Production stores on this machine, started by one command: PostgreSQL, a Prefect server and an MLflow
tracking server on it (artifacts proxied by the MLflow server), on free ports, all data in one directory.

    python -m flows.services up [--dir DIR] [--host ADDR] [--no-auth]   # or `make services [HOST=..]`
    python -m flows.services up --host ADDR [--tls-cert C --tls-key K | --public-url NAME=URL ...]
    python -m flows.services status [--dir DIR]
    python -m flows.services add-user NAME [--experiment E] [--model M] [--promoter | --read-only]
    python -m flows.services down [--dir DIR]    # or `make services-down`; data stays for the next `up`

Loopback (127.0.0.1) is the default, and authentication is on wherever they listen: PostgreSQL with SCRAM
passwords, the Prefect server with its API auth string (and CORS for its own UI only), the MLflow server
with MLflow's basic-auth app and the roles of `flows.services.mlflow_policy` (workers, promoters, readers:
`flows.services.users`). `--no-auth` turns it off, on loopback only and never for a directory that had it;
an unauthenticated directory is migrated by the next `up`. Generated secrets live in `DIR/secrets.json`;
`DIR/env.sh` exports the URLs and the administrator's credentials in the variables the clients read (never
inside a URL); nothing prints them. Every file there is 0600, the servers' environment holds nothing of
the operator's but what they need, and `up`/`down`/`add-user` hold the directory's lock. Beyond loopback
(or with `--tls`) stunnel serves both over TLS, the servers behind it on loopback (`flows.services.tls`).

DIR defaults to `<LLAMAFLOW_HOME>/services`. It holds `postgres/` (the cluster, its log and socket),
`prefect/` (PREFECT_HOME of the server), `mlflow-artifacts/`, the servers' logs, `services.json` (ports,
addresses, process identities), `secrets.json`, `env.sh` and `users/NAME.env`. PostgreSQL refuses to run as
root: as root, the cluster belongs to an unprivileged user (`--pg-user`, default `nobody`). The drivers come
with the `postgres` extra (asyncpg for Prefect, psycopg for MLflow), MLflow's auth app with the `auth` extra
(`pip install -e '.[postgres,auth]'`); the PostgreSQL server binaries from the system (Debian/Ubuntu:
`apt-get install postgresql`; Fedora: `dnf install postgresql-server`; macOS: `brew install postgresql@15`).
"""

from flows.services.lifecycle import configure, down, running, up
from flows.services.state import Secrets, Services, ServicesError, load
from flows.services.users import add_user

__all__ = ["Secrets", "Services", "ServicesError", "add_user", "configure", "down", "load", "running", "up"]
