"""What MLflow's permissions cannot say, said in the MLflow server itself: who may move an alias, who only reads.

MLflow's basic-auth app grants per experiment and registered model, and one grant (EDIT on a model) both
creates versions and moves its aliases; any user may also create experiments and registered models of
its own. So the MLflow server of `flows.services` runs with this module's `authenticate` as its
`authorization_function` (MLflow's documented extension point): it authenticates as MLflow's basic auth
does, then refuses (403), before MLflow's own checks:

- an alias set or removed (`registered-models/alias`) by anyone but the promoters (the admin is one): moving
  `@champion` is the promotion step's alone (`tasks.registry.promoter`), so a worker's password, which
  creates versions, cannot move it;
- a model version tag of the promotion decision (`tasks.registry.decision.DECISION_TAGS`: whether it was
  promoted, the comparison, the score the decision recorded, which later decisions reuse for a champion)
  set, removed, or given at a version's creation by anyone but the promoters: a worker may tag its
  versions, but cannot forge what the decision trusts;
- any request of a read-only user but a read (GET, or a POST to a search or get endpoint).

MLflow's UI shows its logout and change-password entries only when `users/current` says `is_basic_auth`,
which MLflow decides by comparing the configured function's name with its own; this one is MLflow's basic
authentication plus the refusals above, so it answers that route itself as MLflow does, flag set.

Who is who comes from `mlflow-roles.json` in the services directory (`LLAMAFLOW_MLFLOW_ROLES` names it),
written by `up` and `add-user`, re-read when it changes: no restart.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.registry.decision import DECISION_TAGS

ROLES_VARIABLE = "LLAMAFLOW_MLFLOW_ROLES"
ALIAS_ROUTE = "/registered-models/alias"
_TAG_ROUTES = ("/model-versions/set-tag", "/model-versions/delete-tag")
_CREATE_VERSION_ROUTE = "/model-versions/create"
_READ_METHODS = ("GET", "HEAD", "OPTIONS")
_CURRENT_USER_ROUTE = "/mlflow/users/current"
_cache: dict[str, object] = {}
_lock = threading.Lock()


def roles() -> dict[str, set[str]]:
    """{"promoters": users, "readers": users} from the roles file (its last good content if it is being
    replaced); nobody is a promoter or reader when it is missing (then only the admin moves aliases)."""
    path = Path(os.environ.get(ROLES_VARIABLE, ""))
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return {"promoters": set(), "readers": set()}
    with _lock:
        if _cache.get("stamp") != stamp:
            data = json.loads(path.read_text())
            _cache["stamp"] = stamp
            _cache["roles"] = {key: set(data.get(key, [])) for key in ("promoters", "readers")}
        return _cache["roles"]  # type: ignore[return-value]


def _decision_tags(path: str, body: Mapping[str, Any]) -> list[str]:
    """The decision's tags a request writes: a version's tag set or removed, or given at its creation."""
    route = path.rstrip("/")
    if route.endswith(_TAG_ROUTES):
        keys = [body.get("key")]
    elif route.endswith(_CREATE_VERSION_ROUTE):
        tags = body.get("tags")
        keys = [tag.get("key") for tag in tags if isinstance(tag, dict)] if isinstance(tags, list) else []
    else:
        return []
    return [key for key in keys if key in DECISION_TAGS]


def allowed(user: str, method: str, path: str, body: Mapping[str, Any] | None = None) -> bool:
    """Whether this policy lets `user` make the request (`body`: its JSON or query parameters; MLflow's own
    permissions still apply after)."""
    who = roles()
    if user in who["readers"]:
        last = path.rstrip("/").rsplit("/", 1)[-1]
        return method in _READ_METHODS or (method == "POST" and ("search" in last or last.startswith("get")))
    if method in _READ_METHODS:
        return True
    if path.rstrip("/").endswith(ALIAS_ROUTE) or _decision_tags(path, body or {}):
        return user in who["promoters"]
    return True


def authenticate():
    """MLflow's basic authentication, then `allowed` (a 403 when it says no)."""
    from flask import jsonify, request
    from mlflow.server import auth

    result = auth.authenticate_request_basic_auth()
    if isinstance(result, auth.Response) or not result.username:
        return result
    body = request.get_json(silent=True) if request.is_json else None
    if not isinstance(body, dict):
        body = request.args.to_dict()  # a DELETE's parameters may come in the query string
    if not allowed(result.username, request.method, request.path, body):
        return auth.make_forbidden_response()
    if request.method == "GET" and request.path.rstrip("/").endswith(_CURRENT_USER_ROUTE):
        # MLflow's `get_current_user` would call this function again; its answer, with the flag set
        user = auth.store.get_user(result.username)
        identity = {"id": user.id, "username": user.username, "is_admin": user.is_admin}
        return jsonify({"user": identity, "is_basic_auth": True})
    return result
