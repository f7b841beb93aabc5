"""Lineage: which model a model came from, recorded the MLflow way and queried from the registry.

A run that starts from a parent (`init_from`, resolved to a `ParentRef`):
- has the parent's logged model as a run input (`LoggedModelInput`: the run page's "Logged models" inputs),
  and `llamaflow.parent*` run tags (the only record where the parent has no logged model: an HF or a
  local checkpoint);
- registers a version tagged with its parent (`llamaflow.parent`, `.parent.name`, `.parent.version`,
  `.parent.model_id`, and the parent's bits per byte on this version's validation text), its tokenizer's
  hash (`llamaflow.tokenizer_sha256`), the tokens of this run and of the whole chain
  (`llamaflow.tokens_seen`, `llamaflow.tokens_seen_total`), the chain's depth and root, and its registered
  ancestors, oldest first (`llamaflow.lineage` = "|NAME/1|NAME/3|").

Every version that descends from version 3 of NAME, children and grandchildren, in one registry query:

    MlflowClient().search_model_versions("tags.`llamaflow.lineage` LIKE '%|NAME/3|%'")

(`descendants()` runs it and drops the rare false match of LIKE's `_` wildcard in a name.)
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow.entities import LoggedModelInput, RunTag
from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient

from tasks import home
from tasks.refs import ParentRef, TokenizerRef
from tasks.tracking import store

TAG_PARENT = "llamaflow.parent"
TAG_PARENT_NAME = "llamaflow.parent.name"
TAG_PARENT_VERSION = "llamaflow.parent.version"
TAG_PARENT_MODEL_ID = "llamaflow.parent.model_id"
TAG_PARENT_SOURCE = "llamaflow.parent.source"
TAG_PARENT_BITS_PER_BYTE = "llamaflow.parent.bits_per_byte"
TAG_PARENT_OPTIMIZER = "llamaflow.parent.optimizer_state"  # init_optimizer: the checkpoint it came from
TAG_LINEAGE = "llamaflow.lineage"
TAG_DEPTH = "llamaflow.lineage.depth"
TAG_ROOT = "llamaflow.lineage.root"
TAG_TOKENS_SEEN = "llamaflow.tokens_seen"
TAG_TOKENS_SEEN_TOTAL = "llamaflow.tokens_seen_total"
TAG_TOKENIZER_SHA256 = "llamaflow.tokenizer_sha256"
SCRATCH = "scratch"


@dataclass(frozen=True)
class Chain:
    """What a child inherits from its parent's registration."""

    lineage: tuple[str, ...]  # registered ancestors, oldest first, the parent last
    depth: int  # the parent's generation (1 = trained from scratch or imported)
    tokens_seen_total: int
    root: str


def parse_lineage(value: str | None) -> tuple[str, ...]:
    return tuple(part for part in (value or "").split("|") if part)


def format_lineage(ancestors: tuple[str, ...]) -> str:
    return "|" + "".join(f"{a}|" for a in ancestors)


def parent_chain(tags: dict[str, str], version: ModelVersion | None) -> Chain:
    """The chain up to and including a registered parent, from the tags its registration wrote (a version
    registered before lineage was recorded counts as a root of unknown origin)."""
    own = () if version is None else (f"{version.name}/{version.version}",)
    return Chain(
        lineage=parse_lineage(tags.get(TAG_LINEAGE)) + own,
        depth=int(tags.get(TAG_DEPTH, 1)),
        tokens_seen_total=int(tags.get(TAG_TOKENS_SEEN_TOTAL, 0)),
        root=tags.get(TAG_ROOT, "unknown" if version is not None else SCRATCH),
    )


def made_from(version: ModelVersion, model_id: str, artifact_location: str) -> bool:
    """Whether `version` was registered from logged model `model_id` (a database registry keeps no model
    id for a version registered from the model's artifact location: the location tells then)."""
    sources = (f"models:/{model_id}", artifact_location.rstrip("/"))
    return version.model_id == model_id or version.source.rstrip("/") in sources


def logged_model_id(client: MlflowClient, version: ModelVersion) -> str | None:
    """The id of the logged model a registry version was made from, if any."""
    if version.model_id:
        return version.model_id
    if version.source.startswith("models:/m-"):
        return version.source.removeprefix("models:/")
    if not version.run_id:
        return None
    experiment_id = client.get_run(version.run_id).info.experiment_id
    for logged in client.search_logged_models(
        [experiment_id], filter_string=f"source_run_id = '{version.run_id}'"
    ):
        if made_from(version, logged.model_id, logged.artifact_location):
            return logged.model_id
    return None


def parent_tags(parent: ParentRef) -> dict[str, str]:
    """The parent as tags (run and version): what it was given as, what it resolved to, its identity."""
    tags = {TAG_PARENT: parent.pinned, TAG_PARENT_SOURCE: parent.source}
    for key, value in (
        (TAG_PARENT_NAME, parent.name),
        (TAG_PARENT_VERSION, parent.version),
        (TAG_PARENT_MODEL_ID, parent.model_id),
    ):
        if value is not None:
            tags[key] = value
    return tags


def version_tags(
    parent: ParentRef | None,
    *,
    tokens_seen: int,
    tokenizer: TokenizerRef,
    parent_bits_per_byte: float | None,
) -> dict[str, str]:
    """Tags of the version a run registers: its parent, tokenizer hash, tokens seen and ancestry."""
    tags = {
        TAG_TOKENIZER_SHA256: tokenizer.sha256 or "unknown",
        TAG_TOKENS_SEEN: str(tokens_seen),
        TAG_TOKENS_SEEN_TOTAL: str(tokens_seen + (parent.tokens_seen_total if parent else 0)),
        TAG_DEPTH: str(parent.depth + 1 if parent else 1),
        TAG_ROOT: parent.root if parent else SCRATCH,
        TAG_LINEAGE: format_lineage(parent.lineage if parent else ()),
    }
    if parent is not None:
        tags.update(parent_tags(parent))
        if parent_bits_per_byte is not None:
            tags[TAG_PARENT_BITS_PER_BYTE] = repr(parent_bits_per_byte)
    return tags


def log_parent(run_id: str, parent: ParentRef, uri: str | None = None) -> None:
    """The parent as an input of the run: its logged model (`LoggedModelInput`), and tags in any case."""
    client = store.get_client(uri)
    run = client.get_run(run_id)
    if parent.model_id is not None:
        present = {m.model_id for m in (run.inputs.model_inputs or [])}
        if parent.model_id not in present:
            client.log_inputs(run_id, models=[LoggedModelInput(parent.model_id)])
    tags = [RunTag(k, v) for k, v in parent_tags(parent).items() if run.data.tags.get(k) != v]
    if tags:
        client.log_batch(run_id, tags=tags, synchronous=True)


def log_parent_optimizer(run_id: str, checkpoint: str, uri: str | None = None) -> None:
    """init_optimizer: the parent's checkpoint whose optimizer state the run started with, as a run tag."""
    store.get_client(uri).set_tag(run_id, TAG_PARENT_OPTIMIZER, home.portable(checkpoint), synchronous=True)


def descendants_filter(name: str, version: str | int) -> str:
    """The registry filter of every version descending from NAME/VERSION (any depth, any model name)."""
    return f"tags.`{TAG_LINEAGE}` LIKE '%|{name}/{version}|%'"


def descendants(name: str, version: str | int, uri: str | None = None) -> list[ModelVersion]:
    """Every registered version that descends from NAME/VERSION, oldest first."""
    wanted = f"{name}/{version}"
    found = store.get_client(uri).search_model_versions(descendants_filter(name, version))
    exact = [v for v in found if wanted in parse_lineage(v.tags.get(TAG_LINEAGE))]
    return sorted(exact, key=lambda v: (v.creation_timestamp, v.name, int(v.version)))


def base_model(tags: dict[str, str]) -> str | None:
    """What a Hugging Face model card names as `base_model`: the hub checkpoint the chain started from,
    else the registered parent (models:/NAME/VERSION); None for a model trained from scratch."""
    root = tags.get(TAG_ROOT, "")
    if root.startswith("hf:"):
        return root.removeprefix("hf:").split("@")[0]
    return tags.get(TAG_PARENT)
