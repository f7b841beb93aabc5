"""`init_from` a model in MLflow: a registry version (`models:/NAME@ALIAS`, `models:/NAME/VERSION`), a logged
model (`models:/m-...`, MLflow 3) or a run's logged model (`runs:/RUN_ID[/NAME]`).

An alias is resolved here, once, to its version and that version's logged model id; the files are
downloaded into the parent cache by that concrete identity. The parent's lineage (ancestors, tokens seen
across the chain, the root) is read from the tags its own registration wrote (`tasks.registry.lineage`).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mlflow.entities import LoggedModel
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from model.weights import CONFIG_FILE, WEIGHTS_FILE
from tasks.data.errors import blake
from tasks.init_from.parent_cache import TOKENIZER_FILE, InitFromError, materialize
from tasks.lookup import parse_model_uri, resolve_version
from tasks.refs import ParentRef
from tasks.registry import lineage
from tasks.registry.manifest import TamperedModelError, verify_version
from tasks.tracking import store

LOGGED_MODEL_URI = re.compile(r"^models:/(?P<model_id>m-[0-9a-f]{32})$")
RUNS_URI = re.compile(r"^runs:/(?P<run_id>[0-9a-f]{32})(?:/(?P<name>.+?))?/?$")
_ARTIFACT_ROLES = {"weights": WEIGHTS_FILE, "config": CONFIG_FILE, "tokenizer": TOKENIZER_FILE}


def _locate(local: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """(role → file, special token ids) in a downloaded model: a llamaflow pyfunc (artifacts named in its
    MLmodel) or a checkpoint logged model (model.safetensors + config.json at the top)."""
    if (local / "MLmodel").is_file():
        from mlflow.models import Model

        pyfunc = Model.load(str(local)).flavors.get("python_function", {})
        artifacts = pyfunc.get("artifacts", {})
        files = {role: local / artifacts[role]["path"] for role in _ARTIFACT_ROLES if role in artifacts}
        return files, dict(pyfunc.get("config") or {})
    files = {role: local / name for role, name in _ARTIFACT_ROLES.items() if (local / name).is_file()}
    return files, {}


def _download(
    uri: str, artifact_uri: str, staging: Path, what: str, version: ModelVersion | None = None
) -> dict[str, Any]:
    """Download a model's artifacts, check them against the manifest `version`'s promotion decision recorded
    (if any), and keep weights, config and tokenizer in `staging` (our layout)."""
    import mlflow

    with tempfile.TemporaryDirectory(prefix="llamaflow-parent-", dir=staging.parent) as scratch:
        local = Path(
            mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=scratch, tracking_uri=uri)
        )
        if version is not None:
            try:
                verify_version(local, version, what)
            except TamperedModelError as err:
                raise InitFromError(f"init_from: {err}") from err
        files, token_ids = _locate(local)
        for role in ("weights", "config"):
            if role not in files or not files[role].is_file():
                raise InitFromError(
                    f"{what} is not a llamaflow model: it has no {_ARTIFACT_ROLES[role]}. Give a version "
                    "registered by llamaflow, a checkpoint logged model, or a local/Hugging Face checkpoint"
                )
        for role, path in files.items():
            shutil.move(str(path), staging / _ARTIFACT_ROLES[role])
    return {"token_ids": token_ids}


def _special_names(directory: Path, token_ids: dict[str, Any]) -> dict[str, str]:
    """The token ids a pyfunc recorded, as names of its tokenizer (import_tokenizer finds them again)."""
    path = directory / TOKENIZER_FILE
    if not path.is_file() or not token_ids:
        return {}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    names = {}
    for role in ("bos", "eos", "pad"):
        token_id = token_ids.get(f"{role}_id")
        if token_id is not None and (name := tokenizer.id_to_token(int(token_id))) is not None:
            names[role] = name
    return names


def _run_tokens_seen(client: MlflowClient, run_id: str | None) -> int:
    if run_id is None:
        return 0
    try:
        return int(client.get_run(run_id).data.metrics.get("train/tokens_seen", 0))
    except MlflowException:
        return 0


def _parent(
    client: MlflowClient,
    *,
    source: str,
    kind: str,
    pinned: str,
    slot: Path,
    meta: dict[str, Any],
    version: ModelVersion | None,
    model_id: str | None,
    run_id: str | None,
) -> ParentRef:
    tags = version.tags if version is not None else {}
    chain = lineage.parent_chain(tags, version)
    return ParentRef(
        source=source,
        kind=kind,  # type: ignore[arg-type]
        pinned=pinned,
        path=str(slot),
        weights_sha256=meta["weights_sha256"],
        tokenizer_path=str(slot / TOKENIZER_FILE) if (slot / TOKENIZER_FILE).is_file() else None,
        special_tokens=_special_names(slot, meta.get("token_ids", {})),
        name=None if version is None else version.name,
        version=None if version is None else str(version.version),
        model_id=model_id,
        run_id=run_id,
        tokens_seen_total=chain.tokens_seen_total or _run_tokens_seen(client, run_id),
        lineage=chain.lineage,
        depth=chain.depth,
        root=chain.root,
    )


def resolve_registry(source: str, uri: str) -> ParentRef:
    """`models:/NAME@ALIAS` or `models:/NAME/VERSION`: pinned to the version (and logged model) it names now."""
    name, _, _ = parse_model_uri(source)
    try:
        version = resolve_version(source, uri)
    except LookupError as err:
        raise InitFromError(
            f"init_from={source!r}: {err} Register a first version (e.g. python -m flows.pretrain --preset "
            f"demo --model-name {name}) before continuing from it"
        ) from err
    client = store.get_client(uri)
    pinned = f"models:/{name}/{version.version}"
    key = blake(
        "registry", store.redact_uri(uri), name, str(version.version), version.model_id or version.source
    )

    def write(staging: Path) -> dict[str, Any]:
        location = client.get_model_version_download_uri(name, str(version.version))
        return _download(uri, location, staging, pinned, version)

    slot, meta = materialize(f"mlflow-{key[:32]}", write)
    return _parent(
        client,
        source=source,
        kind="registry",
        pinned=pinned,
        slot=slot,
        meta=meta,
        version=version,
        model_id=lineage.logged_model_id(client, version),
        run_id=version.run_id,
    )


def _registered_version_of(client: MlflowClient, logged: LoggedModel) -> ModelVersion | None:
    """The registry version made from this logged model, if any (the newest)."""
    if not logged.source_run_id:
        return None
    found = [
        v
        for v in client.search_model_versions(f"run_id = '{logged.source_run_id}'")
        if lineage.made_from(v, logged.model_id, logged.artifact_location)
    ]
    return max(found, key=lambda v: int(v.version)) if found else None


def resolve_logged_model(source: str, uri: str, model_id: str | None = None) -> ParentRef:
    """`models:/m-...`: a logged model by id (a registered pyfunc or a checkpoint of a run)."""
    client = store.get_client(uri)
    model_id = model_id or LOGGED_MODEL_URI.match(source)["model_id"]  # type: ignore[index]
    try:
        logged = client.get_logged_model(model_id)
    except MlflowException as err:
        raise InitFromError(
            f"init_from={source!r}: no logged model {model_id} in the tracking store "
            f"{store.redact_uri(uri)} ({err.message})"
        ) from err
    key = blake("logged-model", store.redact_uri(uri), model_id)
    made_into = _registered_version_of(client, logged)

    def write(staging: Path) -> dict[str, Any]:
        meta = _download(uri, logged.artifact_location, staging, f"logged model {model_id}", made_into)
        if not (staging / TOKENIZER_FILE).is_file():
            _tokenizer_of_run(client, logged, staging)
        return meta

    slot, meta = materialize(f"mlflow-{key[:32]}", write)
    return _parent(
        client,
        source=source,
        kind="logged_model",
        pinned=f"models:/{model_id}",
        slot=slot,
        meta=meta,
        version=made_into,
        model_id=model_id,
        run_id=logged.source_run_id,
    )


def _tokenizer_of_run(client: MlflowClient, logged: LoggedModel, staging: Path) -> None:
    """A checkpoint logged model holds no tokenizer: take the one its run registered (same tokenizer)."""
    import mlflow

    if not logged.source_run_id:
        return
    for other in client.search_logged_models(
        [logged.experiment_id], filter_string=f"source_run_id = '{logged.source_run_id}'"
    ):
        if other.model_id == logged.model_id:
            continue
        with tempfile.TemporaryDirectory(dir=staging.parent) as scratch:
            local = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=other.artifact_location, dst_path=scratch, tracking_uri=client.tracking_uri
                )
            )
            files, _ = _locate(local)
            if "tokenizer" in files:
                shutil.move(str(files["tokenizer"]), staging / TOKENIZER_FILE)
                return


def resolve_run(source: str, uri: str) -> ParentRef:
    """`runs:/RUN_ID/NAME`: the run's logged model NAME (`model`, `checkpoint-000350`); without NAME the
    run's registered model, else its newest checkpoint."""
    match = RUNS_URI.match(source)
    if match is None:
        raise InitFromError(f"init_from={source!r} is not of the form runs:/RUN_ID or runs:/RUN_ID/NAME")
    client = store.get_client(uri)
    try:
        run = client.get_run(match["run_id"])
    except MlflowException as err:
        raise InitFromError(f"init_from={source!r}: no run {match['run_id']} ({err.message})") from err
    models = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'"
    )
    ready = {m.name: m for m in models if str(m.status).endswith("READY")}
    if match["name"]:
        chosen = ready.get(match["name"])
    else:
        checkpoints = sorted(n for n in ready if n.startswith("checkpoint-"))
        chosen = ready.get("model") or (ready[checkpoints[-1]] if checkpoints else None)
    if chosen is None:
        raise InitFromError(
            f"init_from={source!r}: the run has no logged model {match['name'] or ''!r}; its logged models "
            f"are {sorted(ready) or 'none'} (use runs:/{run.info.run_id}/NAME or models:/m-ID)"
        )
    return resolve_logged_model(source, uri, chosen.model_id)
