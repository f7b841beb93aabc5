"""MLflow users of an authenticated `flows.services` directory: workers, promoters and readers.

MLflow's basic-auth app grants per experiment and per registered model: READ (see), USE, EDIT (write: runs,
metrics, params, tags, artifacts, logged models; model versions and tags) and MANAGE (also delete and
grant), plus a default for everything without a grant (here READ). `add_user` creates a user (not an admin)
with one of three roles, creating the experiments and models as the admin first so that the admin, not the
user, owns them:

- a **worker** (the default): EDIT on the named experiments and models. It trains, logs and registers
  versions; it cannot delete them, their runs or their versions, grant anything or manage users, and it
  cannot move an alias (the server's policy, `flows.services.mlflow_policy`): `@champion` moves only by a
  promoter's hand.
- a **promoter** (`promoter=True`): EDIT on the experiments, MANAGE on the models (it moves and removes
  their aliases) and on each model's promotion lock (`NAME.promotion-lock`, created here). Its credentials belong to the registering
  flow's promotion step only (`LLAMAFLOW_PROMOTER_USERNAME`/`_PASSWORD`, `tasks.registry.promoter`), never
  to a worker's environment.
- a **reader** (`read_only=True`): no grant, and the policy refuses every request of it but a read; its
  environment holds no Prefect auth string (Prefect has one identity, which may create deployments).

Making an existing user a reader revokes its grants. What MLflow cannot express (MLflow 3.17.2, workspaces
off): a worker may create experiments and registered models of its own, and manages those.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from flows.services.servers import write_roles
from flows.services.state import (
    ADMIN_USER,
    USERS_DIR,
    Secrets,
    Services,
    ServicesError,
    env_file_lines,
    locked,
    write_private,
)
from tasks.registry.lock import lock_name
from tasks.registry.promoter import PROMOTER_PASSWORD, PROMOTER_USERNAME

WORKER_PERMISSION = "EDIT"
PROMOTER_PERMISSION = "MANAGE"
LOCK_PERMISSION = "MANAGE"  # a promoter deletes its tickets (model versions) of the lock
# It names `users/NAME.env`: no path separator, no leading dot.
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


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


def _grant(
    auth: Any, user: str, resource_type: str, resource_id: str, permission: str = WORKER_PERMISSION
) -> None:
    """Give `user` exactly `permission` on the resource, whatever it had before."""
    from mlflow.exceptions import MlflowException

    try:
        auth.grant_user_permission(user, resource_type, resource_id, permission)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        auth.revoke_user_permission(user, resource_type, resource_id)
        auth.grant_user_permission(user, resource_type, resource_id, permission)


def _revoke_all(auth: Any, client: Any, user: str) -> None:
    """Take every experiment and registered-model grant of `user` away (it becomes a reader)."""
    from mlflow.exceptions import MlflowException

    experiments = [e.experiment_id for e in client.search_experiments(view_type=3)]  # active and deleted
    models = [m.name for m in client.search_registered_models()]
    for kind, ids in (("experiment", experiments), ("registered_model", models)):
        for resource in ids:
            try:
                auth.revoke_user_permission(user, kind, resource)
            except MlflowException as err:
                if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
                    raise


def _ensure_model(client: Any, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name)


def add_user(
    services: Services,
    name: str,
    *,
    experiments: Sequence[str] | None = None,
    models: Sequence[str] | None = None,
    read_only: bool = False,
    promoter: bool = False,
    env_file: Path | None = None,
) -> Path:
    """Create (or update) MLflow user `name` in its role (see the module): a worker or a promoter of
    `experiments` and `models` (default: every preset's), or a reader; write what a client running as it
    needs (URLs and credentials) to `env_file`, mode 0600. Returns it."""
    if not services.auth:
        raise ServicesError(
            f"authentication is off in {services.root} (started with --no-auth): MLflow has no users there; "
            "`python -m flows.services up` without --no-auth turns it on (it migrates the directory)"
        )
    if name == ADMIN_USER:
        raise ServicesError(f"{ADMIN_USER!r} is the administrator; name the user otherwise")
    if not USER_NAME.fullmatch(name) or ".." in name:
        raise ServicesError(
            f"user name {name!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit (it names the user's env file, users/NAME.env), e.g. worker-gpu1"
        )
    if env_file is not None and (env_file.is_symlink() or env_file.is_dir()):
        raise ServicesError(f"--env-file {env_file} is a link or a directory: name a plain file to write")
    if read_only and promoter:
        raise ServicesError("a user is a reader (--read-only) or a promoter (--promoter), not both")
    root = Path(services.root)
    with locked(root):
        secrets = Secrets.load(root)
        password = secrets.mlflow_users.get(name) or Secrets.generate()
        _create_and_grant(services, secrets, name, password, experiments, models, read_only, promoter)
        secrets.mlflow_users[name] = password
        secrets.readers = sorted({*secrets.readers, name} - (set() if read_only else {name}))
        secrets.promoters = sorted({*secrets.promoters, name} - (set() if promoter else {name}))
        secrets.save(root)
        write_roles(services, secrets)
        env = services.client_env(mlflow_user=name, prefect=not read_only)
        if promoter:
            env.update({PROMOTER_USERNAME: name, PROMOTER_PASSWORD: password})
        env_file = env_file or root / USERS_DIR / f"{name}.env"
        write_private(env_file, env_file_lines(env))
    return env_file


def _create_and_grant(
    services: Services,
    secrets: Secrets,
    name: str,
    password: str,
    experiments: Sequence[str] | None,
    models: Sequence[str] | None,
    read_only: bool,
    promoter: bool,
) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():  # the auth client imports the server's app, which warns on import
        warnings.simplefilter("ignore")
        from mlflow.server.auth.client import AuthServiceClient

    default_experiments, default_models = default_resources()
    with _as_admin(services, secrets) as uri:
        auth = AuthServiceClient(uri)
        client = MlflowClient(uri, uri)
        try:
            auth.get_user(name)
            auth.update_user_password(name, password)  # the one in secrets.json is the one that works
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            auth.create_user(name, password)
        if read_only:
            _revoke_all(auth, client, name)
            return
        for experiment in experiments or default_experiments:
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(experiment)
            _grant(auth, name, "experiment", experiment_id)
        for model in models or default_models:
            _ensure_model(client, model)
            # A promoter also removes an alias (the fence's undo when there was no champion): MANAGE.
            _grant(
                auth, name, "registered_model", model, PROMOTER_PERMISSION if promoter else WORKER_PERMISSION
            )
            if promoter:  # created here, by the admin: no worker can own (and so break) it
                _ensure_model(client, lock_name(model))
                _grant(auth, name, "registered_model", lock_name(model), LOCK_PERMISSION)
