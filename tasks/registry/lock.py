"""A per-model-name lock kept in the MLflow store itself, around the compare-and-set of an alias.

The lock is a registered model `<name>.promotion-lock`: creating a registered model is atomic in every
MLflow store (a unique name in SQL, the same call through a server), so it works with SQLite, PostgreSQL
or a tracking server, with or without a Prefect server, and serialises every process that registers into
the store, whichever Prefect deployment or plain script it runs in. It lives for the compare-and-set only
(well under a second); a holder that died is recognised by its lease, after which a waiter breaks it.
"""

from __future__ import annotations

import random
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

LOCK_SUFFIX = ".promotion-lock"
TAG_HOLDER = "llamaflow.lock_holder"
TAG_EXPIRES = "llamaflow.lock_expires"
_TAKEN = ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS")
_GONE = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


class PromotionLockTimeout(TimeoutError):
    """Another registration held the model's promotion lock for too long."""


def lock_name(model_name: str) -> str:
    return f"{model_name}{LOCK_SUFFIX}"


def _holder(client: MlflowClient, name: str) -> tuple[str, float] | None:
    try:
        tags = client.get_registered_model(name).tags
    except MlflowException as exc:
        if exc.error_code in _GONE:
            return None
        raise
    return tags.get(TAG_HOLDER, ""), float(tags.get(TAG_EXPIRES, "0"))


def _delete(client: MlflowClient, name: str) -> None:
    try:
        client.delete_registered_model(name)
    except MlflowException as exc:
        if exc.error_code not in _GONE:
            raise


def _break_if_stale(client: MlflowClient, name: str) -> None:
    """Delete a lock whose holder's lease ran out (it crashed), checking it is still that holder's."""
    seen = _holder(client, name)
    if seen is None or seen[1] > time.time():
        return
    if _holder(client, name) == seen:
        warnings.warn(
            f"breaking the promotion lock {name!r}: its holder's lease ended {time.time() - seen[1]:.0f} s ago",
            RuntimeWarning,
            stacklevel=3,
        )
        _delete(client, name)


@contextmanager
def promotion_lock(
    client: MlflowClient, model_name: str, *, lease_s: float = 60.0, wait_s: float = 600.0
) -> Iterator[None]:
    """Hold `model_name`'s promotion lock in `client`'s store for the body (keep the body short)."""
    name = lock_name(model_name)
    holder = uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    while True:
        tags = {TAG_HOLDER: holder, TAG_EXPIRES: repr(time.time() + lease_s)}
        try:
            client.create_registered_model(
                name,
                tags=tags,
                description=f"Held while a version of {model_name!r} is compared with its champion.",
            )
            break
        except MlflowException as exc:
            if exc.error_code not in _TAKEN:
                raise
        _break_if_stale(client, name)
        if time.monotonic() > deadline:
            raise PromotionLockTimeout(
                f"registered model {name!r} (the promotion lock of {model_name!r}) was held for more than "
                f"{wait_s:.0f} s; if no registration is running, delete it in the MLflow UI"
            )
        time.sleep(random.uniform(0.05, 0.25))
    try:
        yield
    finally:
        seen = _holder(client, name)
        if seen is not None and seen[0] == holder:
            _delete(client, name)
        else:
            warnings.warn(
                f"the promotion lock {name!r} was broken while held (lease {lease_s:.0f} s exceeded)",
                RuntimeWarning,
                stacklevel=3,
            )
