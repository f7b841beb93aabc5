"""`python -m flows.services up|status|down|add-user`: see flows/services/__init__.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flows.services import add_user, down, load, running, up
from flows.services.processes import ProcessError
from flows.services.state import ENV_FILE, ServicesError
from flows.services.tls import PROXY, TlsOptions


def default_dir() -> Path:
    from tasks import home

    return home.home() / "services"


NO_AUTH_WARNING = (
    "WARNING: authentication is OFF (--no-auth): every local user of this machine, and any web page a "
    "browser here opens, can reach PostgreSQL as its superuser, the Prefect API (which runs code on the "
    "workers) and MLflow. `up` without --no-auth turns it on."
)


def _describe_auth(on: bool) -> str:
    if not on:
        return "OFF (--no-auth: loopback only; `up` without --no-auth turns it on)"
    return "on (PostgreSQL SCRAM passwords, Prefect API auth string, MLflow basic-auth users and roles)"


def build_parser() -> argparse.ArgumentParser:
    import flows.services

    parser = argparse.ArgumentParser(
        prog="python -m flows.services", description=(flows.services.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("command", choices=["up", "down", "status", "add-user"])
    parser.add_argument("user", nargs="?", help="add-user: the MLflow user to create (e.g. worker)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="data directory (default: <LLAMAFLOW_HOME>/services)"
    )
    parser.add_argument(
        "--host",
        default=None,
        help="up: address the Prefect and MLflow servers listen on (default 127.0.0.1, or the one used "
        "before)",
    )
    parser.add_argument(
        "--public-host",
        default=None,
        help="up: the name clients use for this machine (default: the address; for 0.0.0.0 the machine's name)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="up: TLS on loopback too (beyond loopback it is always on): stunnel in front of both servers, "
        "with a certificate from a CA generated in DIR/tls (clients trust it through env.sh)",
    )
    parser.add_argument("--tls-cert", default=None, help="up: your own certificate chain (PEM) for the proxy")
    parser.add_argument("--tls-key", default=None, help="up: the key of --tls-cert (PEM)")
    parser.add_argument(
        "--public-url",
        action="append",
        metavar="NAME=URL",
        help="up: prefect=URL or mlflow=URL (repeat): a TLS proxy of your own serves that server at URL "
        "(https; it forwards to the server's --host and port); `up` then starts no proxy of its own",
    )
    parser.add_argument(
        "--artifacts-destination",
        default=None,
        help="up: where the MLflow server keeps artifacts (default DIR/mlflow-artifacts; e.g. s3://bucket/mlflow: "
        "the store's variables of up's environment, AWS_* for S3, are passed to the MLflow server only)",
    )
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="up: no authentication (loopback only, refused for a directory that had it): every local user "
        "gets in",
    )
    parser.add_argument("--auth", action="store_true", help=argparse.SUPPRESS)  # the default now
    parser.add_argument(
        "--pg-user", default="nobody", help="owner of the PostgreSQL cluster when run as root"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="up: seconds to wait for each server")
    parser.add_argument(
        "--mlflow-workers", type=int, default=2, help="up: the MLflow server's worker processes"
    )
    parser.add_argument(
        "--experiment",
        action="append",
        help="add-user: an experiment it may write to (repeat; default: the presets')",
    )
    parser.add_argument(
        "--model",
        action="append",
        help="add-user: a registered model it may register to (repeat; default: the presets')",
    )
    parser.add_argument(
        "--env-file", type=Path, default=None, help="add-user: where to write its environment"
    )
    parser.add_argument(
        "--read-only",
        action="store_true",
        help="add-user: a reader: MLflow reads only, no Prefect credentials",
    )
    parser.add_argument(
        "--promoter",
        action="store_true",
        help="add-user: a worker that may also move its models' aliases (for the registering flow's "
        "promotion step only; never give it to a worker)",
    )
    return parser


def _public_urls(given: list[str] | None) -> dict[str, str] | None:
    if given is None:
        return None
    pairs = [item.partition("=") for item in given]
    bad = [item for item, (_, sep, url) in zip(given, pairs, strict=True) if not sep or not url]
    if bad:
        raise ServicesError(
            f"--public-url {bad[0]}: expected NAME=URL, e.g. mlflow=https://mlflow.example.org"
        )
    return {name: url for name, _, url in pairs}


def _up(args: argparse.Namespace, root: Path) -> None:
    before = load(root)
    tls = TlsOptions(args.tls, args.tls_cert, args.tls_key, _public_urls(args.public_url))
    services = up(
        root,
        host=args.host,
        public_host=args.public_host,
        no_auth=args.no_auth,
        pg_user=args.pg_user,
        timeout_s=args.timeout,
        mlflow_workers=args.mlflow_workers,
        tls_options=tls,
        artifacts_destination=args.artifacts_destination,
    )
    print(
        f"PostgreSQL {services.database_url('')}, Prefect UI {services.prefect_ui_url}, "
        f"MLflow UI {services.mlflow_tracking_uri}; data and logs in {root}"
    )
    print(f"authentication {_describe_auth(services.auth)}")
    print(f"# export these: source {root / ENV_FILE}")
    print(f"export PREFECT_API_URL={services.prefect_api_url}")
    print(f"export MLFLOW_TRACKING_URI={services.mlflow_tracking_uri}")
    if services.auth:
        print(f"# and the administrator's credentials, which {root / ENV_FILE} (mode 0600) exports")
    if services.ca_bundle is not None:
        print(
            f"TLS: stunnel in front of both servers, certificate from the CA {services.ca_bundle.parent}/ca.pem; "
            f"clients elsewhere need a copy of {services.ca_bundle} (env.sh names it)"
        )
    elif services.tls:
        print(f"TLS: stunnel in front of both servers, with your certificate {services.tls_cert}")
    if services.auth and before is not None and not before.auth:
        print(f"migrated {root} to authentication: clients need the credentials of {root / ENV_FILE}")
    if not services.auth:
        print(NO_AUTH_WARNING, file=sys.stderr)


def _add_user(args: argparse.Namespace, root: Path) -> None:
    services = load(root)
    if services is None:
        raise ServicesError(f"no services in {root}: start them first (`python -m flows.services up`)")
    env_file = add_user(
        services,
        args.user,
        experiments=args.experiment,
        models=args.model,
        read_only=args.read_only,
        promoter=args.promoter,
        env_file=args.env_file,
    )
    grants = (
        "reads only (MLflow), no Prefect credentials"
        if args.read_only
        else "EDIT on its experiments and registered models, and moves their aliases"
        if args.promoter
        else "EDIT on its experiments and registered models, no alias moves"
    )
    print(
        f"MLflow user {args.user!r}: {grants}, nothing else; its environment (URLs and credentials, "
        f"mode 0600) is in {env_file}"
    )


def _status(root: Path) -> int:
    services = load(root)
    if services is None:
        print(f"no services in {root}")
        return 1
    state = running(services)
    where = {
        "postgres": services.database_url(""),
        "prefect": services.prefect_api_url,
        "mlflow": services.mlflow_tracking_uri,
        PROXY: f"TLS on {services.host}",
    }
    for name, up_now in state.items():
        print(f"{name:9s} {'running' if up_now else 'stopped':8s} {where[name]}")
    print(f"auth      {_describe_auth(services.auth)}")
    if not services.auth:
        print(NO_AUTH_WARNING, file=sys.stderr)
    return 0 if all(state.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    root = (args.dir or default_dir()).resolve()
    if args.command == "up" and args.auth and args.no_auth:
        parser.error("--auth and --no-auth contradict each other (authentication is on by default)")
    if args.command == "add-user" and not args.user:
        parser.error("add-user needs the user's name: python -m flows.services add-user worker")
    try:
        if args.command == "up":
            _up(args, root)
        elif args.command == "down":
            down(root)
            print(f"stopped; data kept in {root}")
        elif args.command == "add-user":
            _add_user(args, root)
        else:
            return _status(root)
    except (ServicesError, ProcessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
