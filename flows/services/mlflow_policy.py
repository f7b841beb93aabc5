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
- any request of a read-only user but a read (GET, or a POST to one of MLflow's search endpoints, or
  `get-latest-versions`); every user but the admin is a reader while the roles file cannot be read;
- a registry DELETE (a model, a version, a tag, an alias), a rename or a stage transition, and any write
  naming a promotion lock (`*.promotion-lock`, `tasks.registry.lock`), by anyone but the promoters;
- any write into a registered model's files (`frozen`): into a logged model that is no longer PENDING
  (READY: a version may be made from it), and into a run whose files a version was made from; nobody's,
  the admin's included (what the decision scored and recorded, `tasks.registry.manifest`, stays what loads);
- a state-changing request sent by a web page of another origin than the server's public one (`Origin`);
- a request MLflow could read otherwise than this policy does (`one_reading`): a state-changing request
  whose body is neither empty nor JSON sent as JSON, or any request with both a query string and a body.
  MLflow's permission check and its handlers parse a DELETE's parameters each their own way (the body
  whatever its Content-Type, or the query); a request that passes here has one reading only.

MLflow's UI shows its logout and change-password entries only when `users/current` says `is_basic_auth`,
which MLflow decides by comparing the configured function's name with its own; this one is MLflow's basic
authentication plus the refusals above, so it answers that route itself as MLflow does, flag set.

Who is who comes from `mlflow-roles.json` in the services directory (`LLAMAFLOW_MLFLOW_ROLES` names it),
written by `up` and `add-user`, re-read when it changes: no restart. Without it, the policy fails closed.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tasks.registry.decision import DECISION_TAGS
from tasks.registry.lock import LOCK_SUFFIX

ROLES_VARIABLE = "LLAMAFLOW_MLFLOW_ROLES"
ORIGIN_VARIABLE = "LLAMAFLOW_MLFLOW_ORIGIN"  # the public origin of the server: its UI's pages' origin
ALIAS_ROUTE = "/registered-models/alias"
_TAG_ROUTES = ("/model-versions/set-tag", "/model-versions/delete-tag")
_CREATE_VERSION_ROUTE = "/model-versions/create"
_READ_METHODS = ("GET", "HEAD", "OPTIONS")
_CURRENT_USER_ROUTE = "/mlflow/users/current"
# The reads MLflow serves as POST (their parameters are a JSON body), and nothing else: not
# `review-queues/get-or-create-user`, nor GraphQL.
_READER_POSTS = ("/search", "/search-datasets", "/get-latest-versions")
_REGISTRY_ROUTES = ("/registered-models/", "/model-versions/")
_PROMOTER_ROUTES = ("/registered-models/rename", "/model-versions/transition-stage")
_ARTIFACT_PREFIXES = ("/api/2.0/mlflow-artifacts/", "/ajax-api/2.0/mlflow-artifacts/")
_UPLOAD_PREFIXES = tuple(f"{prefix}artifacts/" for prefix in _ARTIFACT_PREFIXES)  # PUT: the file's bytes
_LOGGED_MODEL_ROUTE = re.compile(r"/logged-models/(m-[0-9a-f]{32})/?$")
_LOGGED_MODEL_ID = re.compile(r"^m-[0-9a-f]{32}$")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_cache: dict[str, object] = {}
_lock = threading.Lock()


def roles() -> dict[str, set[str]]:
    """{"promoters": users, "readers": users, "closed": ...} from the roles file (its last good content if it
    is being replaced). Without a readable one the policy fails closed: "closed" is set, and every user but
    MLflow's admin only reads."""
    path = Path(os.environ.get(ROLES_VARIABLE, ""))
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return {"promoters": {_admin()}, "readers": set(), "closed": {"*"}}
    with _lock:
        if _cache.get("stamp") != stamp:
            data = json.loads(path.read_text())
            _cache["stamp"] = stamp
            _cache["roles"] = {key: set(data.get(key, [])) for key in ("promoters", "readers")}
        return {**_cache["roles"], "closed": set()}  # type: ignore[dict-item]


def _admin() -> str:
    return os.environ.get("MLFLOW_AUTH_ADMIN_USERNAME", "admin")


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
    if user in who["readers"] or (who["closed"] and user != _admin()):
        return method in _READ_METHODS or (method == "POST" and path.rstrip("/").endswith(_READER_POSTS))
    if method in _READ_METHODS:
        return True
    body = body or {}
    route = path.rstrip("/")
    promoters_only = (
        route.endswith((ALIAS_ROUTE, *_PROMOTER_ROUTES))
        or (method == "DELETE" and any(part in path for part in _REGISTRY_ROUTES))
        or str(body.get("name", "")).endswith(LOCK_SUFFIX)
        or bool(_decision_tags(path, body))
    )
    return user in who["promoters"] if promoters_only else True


def one_reading(method: str, path: str, content_type: str | None, raw: bytes, has_query: bool) -> str | None:
    """Why a request could be read two ways (None: it cannot): a query string and a body together, or a
    state-changing request with a body that is not JSON sent as JSON (an upload's bytes excepted)."""
    if raw and has_query:
        return "a request carries its parameters in the query string or in a JSON body, not both"
    if method in _READ_METHODS or not raw or (method == "PUT" and path.startswith(_UPLOAD_PREFIXES)):
        return None
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        return "a state-changing request's body is JSON, sent with Content-Type: application/json"
    try:
        parsed = json.loads(raw)
    except ValueError:
        return "the request's body is not valid JSON"
    return None if isinstance(parsed, dict) else "the request's body is not a JSON object"


def origin_of(url: str) -> str:
    """A URL's origin as browsers send it (scheme://host[:port], no default port)."""
    parts = urlsplit(url.strip())
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    host = (parts.hostname or "").lower()
    host = f"[{host}]" if ":" in host else host
    port = "" if parts.port in (None, default) else f":{parts.port}"
    return f"{parts.scheme.lower()}://{host}{port}"


def foreign_origin(method: str, origin: str | None) -> str | None:
    """Why a state-changing request from a web page of another origin is refused (None: it is not one).
    MLflow itself lets any `http://localhost:*` page write, whatever --cors-allowed-origins says."""
    if method in _READ_METHODS or origin is None:
        return None
    public = os.environ.get(ORIGIN_VARIABLE, "")
    if public and origin_of(origin) == origin_of(public):
        return None
    return f"a web page at {origin} may not change anything here (only the server's own pages, {public or 'none'})"


def frozen(method: str, path: str) -> str | None:
    """Why this write would change the files of a logged model that is no longer PENDING, or of a run a
    version was made from (None: it would not). Asks the server's own stores."""
    from mlflow.entities import LoggedModelStatus
    from mlflow.exceptions import MlflowException
    from mlflow.server import handlers

    if method in _READ_METHODS:
        return None
    if match := _LOGGED_MODEL_ROUTE.search(path):  # finalizing again (back to PENDING) would reopen it
        models, runs = [match[1]], []
    elif path.startswith(_ARTIFACT_PREFIXES):
        segments = path.split("/")
        models = [s for s in segments if _LOGGED_MODEL_ID.match(s)]
        runs = [s for s in segments if _RUN_ID.match(s)]
    else:
        return None
    for model_id in models:
        try:
            status = handlers._get_tracking_store().get_logged_model(model_id, allow_deleted=True).status
        except MlflowException:
            continue  # no such logged model: nothing registered lives there
        if status != LoggedModelStatus.PENDING:
            return f"logged model {model_id} is {status}: its files are final"
    for run_id in runs:
        versions = handlers._get_model_registry_store().search_model_versions(f"run_id = '{run_id}'")
        if any(not str(v.source).startswith("models:/") for v in versions):
            return f"run {run_id} holds the files of a registered version"
    return None


def _refusal(user: str) -> str | None:
    """Why this policy refuses the current request of `user` (None: it does not)."""
    from flask import request

    upload = request.method == "PUT" and request.path.startswith(_UPLOAD_PREFIXES)
    raw = b"" if upload else request.get_data(cache=True)  # an upload's bytes are the handler's to stream
    why = foreign_origin(request.method, request.headers.get("Origin"))
    why = why or one_reading(request.method, request.path, request.content_type, raw, bool(request.args))
    if why is None:
        why = frozen(request.method, request.path)
    if why is not None:
        return why
    try:  # one of the two, never both (one_reading); a read's body is no parameter of MLflow's
        body = json.loads(raw) if raw else request.args.to_dict()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    if not allowed(user, request.method, request.path, body):
        return "this user's role may not make this request"
    return None


def _forbidden(why: str):
    from flask import make_response

    return make_response(f"Permission denied: {why}", 403)


def authenticate():
    """MLflow's basic authentication, then `allowed` (a 403 when it says no)."""
    from flask import g, jsonify, request
    from mlflow.server import auth

    result = auth.authenticate_request_basic_auth()
    if isinstance(result, auth.Response) or not result.username:
        return result
    # MLflow calls this function again within the request (its permission checks, and after the handler ran,
    # when a write may have changed what `frozen` sees): the verdict is the first call's.
    if not hasattr(g, "llamaflow_refusal"):
        g.llamaflow_refusal = _refusal(result.username)
    if g.llamaflow_refusal is not None:
        return _forbidden(g.llamaflow_refusal)
    if request.method == "GET" and request.path.rstrip("/").endswith(_CURRENT_USER_ROUTE):
        # MLflow's `get_current_user` would call this function again; its answer, with the flag set
        user = auth.store.get_user(result.username)
        identity = {"id": user.id, "username": user.username, "is_admin": user.is_admin}
        return jsonify({"user": identity, "is_basic_auth": True})
    return result
