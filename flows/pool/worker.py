"""A Prefect worker that checks what it was given before it asks for work.

    python -m flows.pool.worker --pool gpu-pool [any other `prefect worker start` option]

A worker with wrong or missing credentials would otherwise start, take flow runs and fail each of them, or
stop in a traceback. This entry point first takes credentials out of the store URIs
(`tasks.credentials.guard_credentials`: every flow run it starts inherits the cleaned environment), then
checks, within seconds, that the Prefect API accepts its credentials and has the pool, and that the MLflow
store accepts its own; it stops with one line naming what to fix, or becomes `prefect worker start` with the
same arguments (the same process: systemd, Docker and Kubernetes see the worker itself).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import urllib.parse

from tasks.credentials import CredentialsError, guard_credentials, redact_uri


class WorkerSetupError(RuntimeError):
    """The worker cannot serve its pool; the message says what to set."""


def _auth_headers() -> dict[str, str]:
    if key := os.environ.get("PREFECT_API_KEY"):
        return {"Authorization": f"Bearer {key}"}
    if auth := os.environ.get("PREFECT_API_AUTH_STRING"):
        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    return {}


def check_prefect(pool: str, timeout_s: float = 30.0) -> None:
    """One authenticated request for the pool: refused credentials, a missing pool or no server fail here."""
    import httpx

    api = os.environ.get("PREFECT_API_URL")
    if not api:
        raise WorkerSetupError(
            "PREFECT_API_URL is not set: a worker needs the Prefect server's API address "
            "(e.g. export PREFECT_API_URL=http://prefect.internal:4200/api)"
        )
    url = f"{api.rstrip('/')}/work_pools/{urllib.parse.quote(pool, safe='')}"
    try:
        response = httpx.get(url, headers=_auth_headers(), timeout=timeout_s)
    except httpx.HTTPError as err:
        raise WorkerSetupError(
            f"the Prefect API at {redact_uri(api)} is not reachable ({type(err).__name__}): start the server "
            "or fix PREFECT_API_URL"
        ) from None
    if response.status_code in (401, 403):
        raise WorkerSetupError(
            f"the Prefect API at {redact_uri(api)} refused this worker's credentials (HTTP "
            f"{response.status_code}): set PREFECT_API_AUTH_STRING to the server's auth string "
            "(its PREFECT_SERVER_API_AUTH_STRING; `flows.services` writes it to users/NAME.env)"
        )
    if response.status_code == 404:
        raise WorkerSetupError(
            f"work pool {pool!r} does not exist on {redact_uri(api)}: create it "
            f"(`prefect work-pool create {pool} --type process`)"
        )
    if response.status_code != 200:
        raise WorkerSetupError(
            f"the Prefect API at {redact_uri(api)} answered HTTP {response.status_code} for pool {pool!r}"
        )


def check_mlflow() -> None:
    """The MLflow store this worker's runs will write to accepts its credentials. Without
    MLFLOW_TRACKING_URI each run uses an embedded store of its own: nothing to check here."""
    from tasks.tracking.store import TrackingStoreUnavailable, check_tracking_store

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    try:
        check_tracking_store(uri)
    except TrackingStoreUnavailable as err:
        raise WorkerSetupError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flows.pool.worker",
        description="Check the worker's Prefect and MLflow credentials, then run `prefect worker start`.",
    )
    parser.add_argument("--pool", "-p", required=True, help="the work pool to serve (e.g. gpu-pool)")
    args, rest = parser.parse_known_args(argv)
    try:
        # First, and nothing else of the entry points' defaults: the flow runs this worker starts apply
        # those themselves, in their own working directories.
        guard_credentials()
        check_prefect(args.pool)
        check_mlflow()
    except (CredentialsError, WorkerSetupError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", args.pool, *rest]
    sys.stdout.flush()
    os.execv(sys.executable, command)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
