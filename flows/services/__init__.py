"""Production stores on this machine, started by one command: PostgreSQL, a Prefect server and an MLflow
tracking server on it (artifacts proxied by the MLflow server), on free ports, all data in one directory.

    python -m flows.services up [--dir DIR] [--host ADDR] [--auth]   # or `make services [HOST=..] [AUTH=1]`
    python -m flows.services status [--dir DIR]
    python -m flows.services add-user NAME [--experiment E] [--model M]   # a least-privilege MLflow user
    python -m flows.services down [--dir DIR]    # or `make services-down`; data stays for the next `up`

Loopback (127.0.0.1) is the default. Listening on any other address turns authentication on, and it
stays on for that directory: PostgreSQL with SCRAM passwords, the Prefect server with its API auth string,
the MLflow server with MLflow's basic-auth app (users and permissions). `--auth` turns it on for loopback
too. Generated secrets live in `DIR/secrets.json` (mode 0600); `DIR/env.sh` exports the URLs and the
administrator's credentials in the variables the clients read (never inside a URL); nothing prints them.

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
