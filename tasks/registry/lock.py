"""A per-model-name lock kept in the MLflow store itself, around the compare-and-set of an alias.

The lock is a queue of tickets: the model versions of a registered model `<name>.promotion-lock`. A store
numbers a registered model's versions one after the other and never reuses a number (a deleted version is
kept as deleted), in every MLflow store and through a tracking server, so the numbers order the
registrations and name each ticket for good. The holder is the lowest live ticket; releasing deletes it.

- **Renewed while held** (and while waiting): a background thread bumps a tag of the ticket every third of
  the lease. A ticket whose tag has not changed for a whole lease, timed by the observer's own monotonic
  clock from when it first saw that value, belongs to a holder that died or stalled, and the observer
  deletes it. No clock is ever compared with another machine's (a skewed clock changes nothing), and no
  store timestamp either: a database store stamps rows with its writers' clocks.
- **Breaking deletes that ticket only** (its number), never "whatever lock has that name now": two waiters
  breaking the same dead ticket cannot delete each other's fresh one.
- **Fenced**: a holder that stalled past its lease has lost the lock without knowing; `Lease.check()` before
  a write and `Lease.held()` after it tell (see `tasks.register`, which undoes a write made after the loss).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

LOCK_SUFFIX = ".promotion-lock"
TICKET_SOURCE = "llamaflow:/promotion-lock"  # a ticket holds no model (a server wants an absolute path)
TAG_HOLDER = "llamaflow.lock_holder"
TAG_RENEWAL = "llamaflow.lock_renewal"
_TAKEN = ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS")
_GONE = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")
_log = logging.getLogger("llamaflow.register")


class PromotionLockTimeout(TimeoutError):
    """Another registration held the model's promotion lock for too long."""


class PromotionLockLost(RuntimeError):
    """The holder stalled past its lease and another registration took the lock."""


def lock_name(model_name: str) -> str:
    return f"{model_name}{LOCK_SUFFIX}"


def _gone(exc: MlflowException) -> bool:
    return exc.error_code in _GONE


@dataclass
class Lease:
    """The held lock: `ticket` is its number in the queue (it only grows: later holders, larger tickets)."""

    client: MlflowClient
    name: str
    ticket: int
    holder: str
    lease_s: float
    _lost: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)

    def held(self) -> bool:
        """Whether the ticket is still in the store (read now, not remembered)."""
        if self._lost.is_set():
            return False
        try:
            self.client.get_model_version(self.name, str(self.ticket))
        except MlflowException as exc:
            if not _gone(exc):
                raise
            self._lost.set()
            return False
        return True

    def check(self) -> None:
        if not self.held():
            raise PromotionLockLost(
                f"the promotion lock {self.name!r} (ticket {self.ticket}) was taken over: this process stalled "
                f"for more than its {self.lease_s:.0f} s lease"
            )

    def _renew(self) -> None:
        count = 0
        while not self._stop.wait(self.lease_s / 3):
            count += 1
            try:
                self.client.set_model_version_tag(self.name, str(self.ticket), TAG_RENEWAL, str(count))
            except MlflowException as exc:
                if _gone(exc):
                    self._lost.set()  # broken by a waiter; the holder finds out through held()/check()
                    continue
                _log.warning(f"could not renew the promotion lock {self.name!r}: {exc}")
            except Exception as exc:  # the store is unreachable: keep trying until the lease is over
                _log.warning(f"could not renew the promotion lock {self.name!r}: {exc}")


def _take_ticket(client: MlflowClient, name: str, holder: str, model_name: str) -> int:
    try:
        client.create_registered_model(
            name, description=f"The promotion lock of {model_name!r}: its live versions are the queue."
        )
    except MlflowException as exc:
        if exc.error_code not in _TAKEN:
            raise
    version = client.create_model_version(
        name,
        source=TICKET_SOURCE,
        tags={TAG_HOLDER: holder, TAG_RENEWAL: "0"},
        description=f"Held by pid {os.getpid()} on {socket.gethostname()} while a version of {model_name!r} "
        "is compared with its champion.",
    )
    return int(version.version)


def _delete_ticket(client: MlflowClient, name: str, ticket: int) -> None:
    try:
        client.delete_model_version(name, str(ticket))
    except MlflowException as exc:
        if not _gone(exc):
            raise


def _heartbeat(version: ModelVersion) -> tuple[str, str]:
    return version.tags.get(TAG_HOLDER, ""), version.tags.get(TAG_RENEWAL, "")


class _Queue:
    """What a waiter saw of the tickets ahead of it: each one's heartbeat and since when (monotonic)."""

    def __init__(self, client: MlflowClient, name: str, lease_s: float) -> None:
        self.client, self.name, self.lease_s = client, name, lease_s
        self.seen: dict[int, tuple[tuple[str, str], float]] = {}

    def ahead_of(self, ticket: int) -> list[int] | None:
        """The live tickets before `ticket` after breaking the dead ones; None when `ticket` is gone."""
        live = {int(v.version): v for v in self.client.search_model_versions(f"name = '{self.name}'")}
        if ticket not in live:
            return None
        now = time.monotonic()
        ahead = []
        for number in sorted(n for n in live if n < ticket):
            beat = _heartbeat(live[number])
            previous = self.seen.get(number)
            if previous is None or previous[0] != beat:
                self.seen[number] = (beat, now)
                ahead.append(number)
            elif now - previous[1] >= self.lease_s:
                warnings.warn(
                    f"breaking ticket {number} of the promotion lock {self.name!r}: not renewed for "
                    f"{now - previous[1]:.0f} s (its holder died or stalled)",
                    RuntimeWarning,
                    stacklevel=4,
                )
                _delete_ticket(self.client, self.name, number)
            else:
                ahead.append(number)
        return ahead


@contextmanager
def promotion_lock(
    client: MlflowClient, model_name: str, *, lease_s: float = 60.0, wait_s: float = 600.0
) -> Iterator[Lease]:
    """Hold `model_name`'s promotion lock in `client`'s store for the body; the lease is renewed meanwhile.

    A waiter breaks a ticket that went unrenewed for `lease_s`; a holder that stalled that long finds out
    through the returned `Lease` (`check()` raises, `held()` is False)."""
    name = lock_name(model_name)
    holder = uuid.uuid4().hex
    lease = Lease(client, name, _take_ticket(client, name, holder, model_name), holder, lease_s)
    renewal = threading.Thread(
        target=lease._renew, name=f"{threading.current_thread().name}/promotion-lock-renewal", daemon=True
    )
    renewal.start()
    try:
        queue = _Queue(client, name, lease_s)
        deadline = time.monotonic() + wait_s
        while (ahead := queue.ahead_of(lease.ticket)) != []:
            if ahead is None:  # this waiter stalled past its lease and was broken: queue again
                lease.ticket = _take_ticket(client, name, holder, model_name)
                lease._lost.clear()
            if time.monotonic() > deadline:
                raise PromotionLockTimeout(
                    f"the promotion lock of {model_name!r} (registered model {name!r}) was held for more than "
                    f"{wait_s:.0f} s by ticket {min(ahead or [lease.ticket])}; if no registration is running, "
                    "delete that version in the MLflow UI"
                )
            time.sleep(random.uniform(0.05, 0.25))
        yield lease
    finally:
        lease._stop.set()
        renewal.join(lease_s)  # a renewal stuck on an unreachable store is left behind (a daemon)
        lost = lease._lost.is_set()
        _delete_ticket(client, name, lease.ticket)
        if lost:
            warnings.warn(
                f"the promotion lock {name!r} (ticket {lease.ticket}) was broken while held: this process "
                f"stalled for more than the {lease_s:.0f} s lease",
                RuntimeWarning,
                stacklevel=3,
            )
