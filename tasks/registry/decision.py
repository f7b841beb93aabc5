"""The promotion decision of a registered version: compare it with the champion and move the alias, as a
compare-and-set under the model's promotion lock (`tasks.registry.lock`), fenced, and record it.

Order of the writes, so that a retry after a crash at any point completes the decision instead of skipping
it: the comparison (champion, both numbers, the lock ticket) first, then the alias, then `llamaflow.promoted`
— the decision itself, always the last write. A version without it has no decision yet.

The fence: a holder that stalled past its lease (a paused process, a hung connection) may have lost the lock
to another registration before its alias write lands. Right after writing, the holder reads its lease again;
if it was lost, it takes the lock anew and puts the alias back on the last version promoted under the lock
(the highest lock ticket among the versions recorded `promoted`: tickets only grow), then compares again.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.refs import Promotion
from tasks.registry.lock import promotion_lock
from tasks.registry.manifest import TAG_MANIFEST, encode, manifest_of

TAG_PROMOTED = "llamaflow.promoted"
TAG_CHAMPION_BITS_PER_BYTE = "llamaflow.champion_bits_per_byte"
TAG_CHAMPION_VERSION = "llamaflow.champion_version"
TAG_COMPARISON = "llamaflow.comparison"
TAG_LOCK_TICKET = "llamaflow.promotion_lock_ticket"
# The version's own score as the decision recorded it (bits per byte, validation text, dtype): the number a
# later decision reuses for this version as champion. Not `llamaflow.bits_per_byte`, which the registering
# worker writes and may change: on a `flows.services` server only promoters may write DECISION_TAGS.
TAG_PROMOTER_SCORE = "llamaflow.promoter_score"
DECISION_TAGS = frozenset(
    (
        TAG_PROMOTED,
        TAG_CHAMPION_BITS_PER_BYTE,
        TAG_CHAMPION_VERSION,
        TAG_COMPARISON,
        TAG_LOCK_TICKET,
        TAG_PROMOTER_SCORE,
        TAG_MANIFEST,
    )
)
NOT_COMPARABLE = "not comparable"
LOCK_LEASE_S = 60.0
MAX_CHAMPION_CHANGES = 5
_log = logging.getLogger("llamaflow.register")

# The champion's bits per byte on our validation text and how it was obtained; None: not comparable.
ScoreChampion = Callable[[ModelVersion], tuple[float | None, str]]


def number(text: str | None) -> float | None:
    return None if text in (None, "none") else float(text)


def score_record(bits_per_byte: float, text_fingerprint: str, dtype: str) -> str:
    return json.dumps(
        {"bits_per_byte": repr(bits_per_byte), "validation_text": text_fingerprint, "dtype": dtype}
    )


def recorded_score(tags: dict[str, str], text_fingerprint: str, dtype: str) -> float | None:
    """The score the decision recorded for a version (`TAG_PROMOTER_SCORE`) if it was measured on this
    validation text in this dtype; None otherwise (no decision recorded one, or another text)."""
    try:
        record = json.loads(tags.get(TAG_PROMOTER_SCORE, ""))
        if record["validation_text"] == text_fingerprint and record["dtype"] == dtype:
            return float(record["bits_per_byte"])
    except (ValueError, TypeError, KeyError):
        pass
    return None


def current_champion(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def version_manifest(client: MlflowClient, version: ModelVersion) -> str:
    """The sha256 manifest (`tasks.registry.manifest`) of the version's files as the store holds them now,
    downloaded through `client`: what the decision records and every loader checks."""
    import mlflow

    location = client.get_model_version_download_uri(version.name, str(version.version))
    with tempfile.TemporaryDirectory(prefix="llamaflow-manifest-") as tmp:
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=location, dst_path=tmp, tracking_uri=client.tracking_uri
        )
        return encode(manifest_of(Path(local)))


def _alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    holder = current_champion(client, name, alias)
    return None if holder is None else str(holder.version)


def verdict(ours: float, theirs: float | None, comparison: str, promotion: Promotion) -> tuple[bool, str]:
    """(promote?, the comparison as recorded) against a champion; `theirs` None: it could not be compared."""
    if theirs is not None and ours < theirs:
        return True, comparison
    forced = promotion == "always" or (theirs is None and promotion == "if_better_or_incomparable")
    if forced:
        return True, f"{comparison}; promoted anyway (promotion={promotion!r})"
    return False, comparison


def decide(
    client: MlflowClient,  # the promoter's (`tasks.registry.promoter`): every write here is the decision's
    version: ModelVersion,
    ours: float,
    score_champion: ScoreChampion,
    *,
    alias: str,
    promotion: Promotion,
    record: str,
) -> None:
    """Decide whether `version` (scoring `ours`, as `record` says: `score_record`) takes `alias`, move it if
    so, and record the decision.

    The champion's number may need a re-score (seconds to minutes), so it is computed outside the lock; under
    it the alias is read again, and if another registration moved it meanwhile, the comparison is redone."""
    name, mine = version.name, str(version.version)
    manifest = version_manifest(client, version)  # the files a worker can no longer change (READY)
    lost_to_restore: list[str | None] = []  # the champion we had compared with, when our write was fenced off
    for _ in range(MAX_CHAMPION_CHANGES):
        if lost_to_restore:
            _undo_lost_write(client, name, alias, mine, fallback=lost_to_restore.pop())
        held_by = _alias_version(client, name, alias)
        if held_by == mine:  # a retry after the alias moved: the comparison recorded before the move stands
            earlier = client.get_model_version(name, mine).tags
            promoted, champion_version = True, earlier.get(TAG_CHAMPION_VERSION, "none")
            theirs = number(earlier.get(TAG_CHAMPION_BITS_PER_BYTE))
            comparison = earlier.get(TAG_COMPARISON, "already the champion")
        elif held_by is None:
            promoted, champion_version, theirs, comparison = True, "none", None, "no previous champion"
        else:
            theirs, measured = score_champion(client.get_model_version(name, held_by))
            promoted, comparison = verdict(ours, theirs, measured, promotion)
            champion_version = held_by
        with promotion_lock(client, name, lease_s=LOCK_LEASE_S) as lease:
            if _alias_version(client, name, alias) != held_by:
                continue  # another registration moved the alias meanwhile: compare with the new champion
            comparison_tags = {
                TAG_CHAMPION_BITS_PER_BYTE: "none" if theirs is None else repr(theirs),
                TAG_CHAMPION_VERSION: champion_version,
                TAG_COMPARISON: comparison,
                TAG_LOCK_TICKET: str(lease.ticket),
                TAG_PROMOTER_SCORE: record,
                TAG_MANIFEST: manifest,
            }
            for key, value in comparison_tags.items():
                client.set_model_version_tag(name, mine, key, value)
            if promoted and held_by != mine:
                if not lease.held():
                    continue
                client.set_registered_model_alias(name, alias, mine)
                if not lease.held():  # the write may have landed after another holder's: undo, then redo
                    lost_to_restore.append(held_by)
                    continue
                if _alias_version(client, name, alias) != mine:
                    continue  # a stalled holder's late write overwrote ours; it undoes it: compare again
            client.set_model_version_tag(name, mine, TAG_PROMOTED, str(promoted).lower())
        return
    raise RuntimeError(
        f"the '{alias}' alias of {name!r} moved {MAX_CHAMPION_CHANGES} times while comparing; try again"
    )


def _last_promoted(client: MlflowClient, name: str, exclude: str) -> str | None:
    """The version promoted last under the lock (the highest ticket), other than `exclude`."""
    found = client.search_model_versions(f"name = '{name}' and tags.`{TAG_PROMOTED}` = 'true'")
    ticketed = [
        (int(v.tags[TAG_LOCK_TICKET]), str(v.version))
        for v in found
        if TAG_LOCK_TICKET in v.tags and str(v.version) != exclude
    ]
    return max(ticketed)[1] if ticketed else None


def _undo_lost_write(client: MlflowClient, name: str, alias: str, mine: str, fallback: str | None) -> None:
    """Our alias write landed after we had lost the lock: put the alias back where the holders left it."""
    with promotion_lock(client, name, lease_s=LOCK_LEASE_S):
        if _alias_version(client, name, alias) != mine:
            return  # moved on since, under the lock
        restore = _last_promoted(client, name, exclude=mine) or fallback
        if restore is None:
            client.delete_registered_model_alias(name, alias)
        else:
            client.set_registered_model_alias(name, alias, restore)
    _log.warning(
        f"version {mine} of {name!r} moved '{alias}' after losing the promotion lock (it stalled past its "
        f"lease); the alias was put back on {'no version' if restore is None else f'version {restore}'} "
        "and the comparison is redone"
    )
