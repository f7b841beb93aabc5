"""The promoter: the identity that moves aliases, apart from the one that registers.

On an MLflow server of `flows.services`, a worker's credentials create versions but cannot move an alias
(`flows.services.mlflow_policy`): moving `@champion` is the promotion decision's (`tasks.registry.decision`),
made after rescoring, with the promoter's credentials. The registering flow gets them in
`LLAMAFLOW_PROMOTER_USERNAME` and `LLAMAFLOW_PROMOTER_PASSWORD` (from `add-user NAME --promoter`, or the
operator's `env.sh`); only the decision's client uses them, so the rest of the flow (training, logging,
the version itself) runs as the worker. Without them, the decision runs with the registering client's own
credentials (an administrator, a local store), and an alias write it may not make fails with a message
naming the fix.
"""

from __future__ import annotations

import os

from mlflow.exceptions import MlflowException
from mlflow.store.model_registry.rest_store import RestStore
from mlflow.tracking import MlflowClient
from mlflow.tracking._model_registry.client import ModelRegistryClient
from mlflow.utils.credentials import get_default_host_creds

from tasks.credentials import remember_secret

PROMOTER_USERNAME = "LLAMAFLOW_PROMOTER_USERNAME"
PROMOTER_PASSWORD = "LLAMAFLOW_PROMOTER_PASSWORD"


class PromotionRefused(PermissionError):
    """The registering identity may not move the alias and no promoter credentials were given."""


class _RegistryAs(ModelRegistryClient):
    """A registry client whose requests carry the given credentials instead of the environment's."""

    def __init__(self, uri: str, username: str, password: str) -> None:
        def creds():
            found = get_default_host_creds(uri)  # TLS settings and the like from the environment
            found.username, found.password, found.token = username, password, None
            return found

        self._store = RestStore(creds)
        super().__init__(uri, uri)

    @property
    def store(self) -> RestStore:
        return self._store


def promoter_client(uri: str) -> MlflowClient | None:
    """A client of the registry at `uri` (an http(s) server) acting as the promoter; None when no promoter
    credentials are set (or the store is not a server: it has no users)."""
    username, password = os.environ.get(PROMOTER_USERNAME), os.environ.get(PROMOTER_PASSWORD)
    if not (username and password) or not uri.startswith(("http://", "https://")):
        return None
    remember_secret(password)
    client = MlflowClient(uri, uri)
    # MlflowClient takes its credentials from the process's environment only (shared by every thread, the
    # lock's renewal included): the registry client it builds lazily is given ours instead.
    client._registry_client_lazy = _RegistryAs(uri, username, password)  # type: ignore[attr-defined]
    return client


def refused(exc: MlflowException, alias: str, name: str) -> PromotionRefused | None:
    """A clear error for a promotion step the server refused (403: the alias, or the promotion lock), else
    None."""
    if exc.error_code != "PERMISSION_DENIED" and exc.get_http_status_code() != 403:
        return None
    return PromotionRefused(
        f"the MLflow server refused the promotion step of {name!r} (moving '{alias}', or its promotion lock): "
        "these credentials may register versions but not promote them. Give the registering flow a "
        f"promoter's credentials in {PROMOTER_USERNAME} and {PROMOTER_PASSWORD} (`python -m flows.services "
        "add-user NAME --promoter`), or register as the administrator; registering this run again redoes "
        "the decision"
    )
