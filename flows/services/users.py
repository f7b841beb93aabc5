"""MLflow users of an authenticated `flows.services` directory: the least-privilege worker.

MLflow's basic-auth app grants per experiment and per registered model: READ (see), USE, EDIT (write: runs,
metrics, params, tags, artifacts, logged models; model versions, aliases and tags) and MANAGE (also
delete and grant), plus a default for everything without a grant (here READ). `add_user` creates a user
(not an admin) and gives it EDIT on the named experiments and registered models, creating them as the admin
first so that the admin, not the worker, owns them: the worker can then train, log and register into them
but cannot delete them, their runs or their versions, remove an alias, grant anything or manage users.

What MLflow cannot express (checked against MLflow 3.17.2 with workspaces off): any user may create new
experiments and registered models and becomes their manager (so it may delete those); the registry's
promotion lock (`NAME.promotion-lock`) is such a model, created and deleted by the registering worker.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from flows.services.state import (
    ADMIN_USER,
    USERS_DIR,
    Secrets,
    Services,
    ServicesError,
    env_file_lines,
    write_private,
)

WORKER_PERMISSION = "EDIT"


def default_resources() -> tuple[list[str], list[str]]:
    """The experiments and registered models of the run presets and of the defaults."""
    from flows.pretrain_config import RUN_PRESETS, PretrainConfig

    fields = PretrainConfig.model_fields
    experiments = {
        fields["experiment"].default,
        *(p["experiment"] for p in RUN_PRESETS.values() if "experiment" in p),
    }
    models = {
        fields["model_name"].default,
        *(p["model_name"] for p in RUN_PRESETS.values() if "model_name" in p),
    }
    return sorted(experiments), sorted(models)


@contextlib.contextmanager
def _as_admin(services: Services, secrets: Secrets) -> Iterator[str]:
    """MLflow's clients read credentials from the environment only: the admin's, for this block."""
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    before = {name: os.environ.get(name) for name in names}
    os.environ.pop("MLFLOW_TRACKING_TOKEN", None)
    os.environ["MLFLOW_TRACKING_USERNAME"] = ADMIN_USER
    os.environ["MLFLOW_TRACKING_PASSWORD"] = secrets.mlflow_admin_password
    try:
        yield services.mlflow_tracking_uri
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _grant(auth: Any, user: str, resource_type: str, resource_id: str) -> None:
    """Give `user` exactly EDIT on the resource, whatever it had before."""
    from mlflow.exceptions import MlflowException

    try:
        auth.grant_user_permission(user, resource_type, resource_id, WORKER_PERMISSION)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        auth.revoke_user_permission(user, resource_type, resource_id)
        auth.grant_user_permission(user, resource_type, resource_id, WORKER_PERMISSION)


def add_user(
    services: Services,
    name: str,
    *,
    experiments: Sequence[str] | None = None,
    models: Sequence[str] | None = None,
    read_only: bool = False,
    env_file: Path | None = None,
) -> Path:
    """Create (or keep) MLflow user `name` with EDIT on `experiments` and `models` (default: every preset's;
    none when `read_only`: it reads, as every user may); write what a client running as it needs (URLs and
    credentials) to `env_file`, mode 0600. Returns it."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():  # the auth client imports the server's app, which warns on import
        warnings.simplefilter("ignore")
        from mlflow.server.auth.client import AuthServiceClient

    if not services.auth:
        raise ServicesError(
            f"authentication is off in {services.root}: MLflow has no users there; start the stores with "
            "`python -m flows.services up --auth` (or `make services AUTH=1`)"
        )
    if name == ADMIN_USER:
        raise ServicesError(f"{ADMIN_USER!r} is the administrator; name the worker's user otherwise")
    root = Path(services.root)
    secrets = Secrets.load(root)
    default_experiments, default_models = default_resources()
    experiments = [] if read_only else list(experiments or default_experiments)
    models = [] if read_only else list(models or default_models)
    password = secrets.mlflow_users.get(name) or Secrets.generate()
    with _as_admin(services, secrets) as uri:
        auth = AuthServiceClient(uri)
        try:
            auth.get_user(name)
            auth.update_user_password(name, password)  # the one in secrets.json is the one that works
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            auth.create_user(name, password)
        secrets.mlflow_users[name] = password
        secrets.save(root)
        client = MlflowClient(uri, uri)
        for experiment in experiments:
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(experiment)
            _grant(auth, name, "experiment", experiment_id)
        for model in models:
            try:
                client.get_registered_model(model)
            except MlflowException:
                client.create_registered_model(model)
            _grant(auth, name, "registered_model", model)
    env_file = env_file or root / USERS_DIR / f"{name}.env"
    write_private(env_file, env_file_lines(services.client_env(mlflow_user=name)))
    return env_file
