"""A sweep's parents, pinned once per study: `init_from: models:/NAME@ALIAS` (in the base, or among a space's
choices) is resolved to its version and logged model when the study is created, recorded in the study,
and every trial, confirmation run and the winner start from that version. A promotion during the sweep
(the alias moved) then changes nothing: the paired comparison compares runs of one parent."""

from __future__ import annotations

from typing import Any

import optuna

from flows.sweep.spec import SweepSpec
from tasks.lookup import parse_model_uri, resolve_version
from tasks.registry import lineage
from tasks.tracking import store

PARENTS = "parents"  # the study's user attribute: {source: {"pinned": models:/NAME/VERSION, "model_id": ...}}


def aliased_sources(spec: SweepSpec) -> list[str]:
    """The `models:/NAME@ALIAS` values init_from takes in this sweep."""
    sources = [spec.base.get("init_from")]
    if "init_from" in spec.space and spec.space["init_from"].choices is not None:
        sources += spec.space["init_from"].choices
    return [
        s.strip() for s in sources if isinstance(s, str) and s.strip().startswith("models:/") and "@" in s
    ]


def pin_parents(spec: SweepSpec, study: optuna.Study, uri: str) -> dict[str, str]:
    """{alias URI: the version URI it was pinned to for this study}, resolved the first time only."""
    recorded: dict[str, Any] = dict(study.user_attrs.get(PARENTS, {}))
    new = [source for source in aliased_sources(spec) if source not in recorded]
    for source in new:
        name, _, _ = parse_model_uri(source)
        try:
            version = resolve_version(source, uri)
        except LookupError as err:
            raise ValueError(f"init_from={source!r}: {err} Register the parent first") from err
        model_id = lineage.logged_model_id(store.get_client(uri), version)
        recorded[source] = {"pinned": f"models:/{name}/{version.version}", "model_id": model_id}
        print(
            f"init_from {source} is {recorded[source]['pinned']} (logged model {model_id}) for this whole sweep"
        )
    if new:
        study.set_user_attr(PARENTS, recorded)
    return {source: str(pin["pinned"]) for source, pin in recorded.items()}


def pinned(values: dict[str, Any], pins: dict[str, str]) -> dict[str, Any]:
    """A trial's PretrainConfig values with its init_from alias replaced by the study's pinned version."""
    source = values.get("init_from")
    if isinstance(source, str) and source.strip() in pins:
        return {**values, "init_from": pins[source.strip()]}
    return values
