"""Load a registered llamaflow model back as a plain PyTorch module plus its tokenizer.

    from tasks.lookup import load_model
    model, tokenizer = load_model("models:/llamaflow-demo@champion")      # or models:/NAME/VERSION

Without llamaflow, MLflow alone serves the same version as text in, text out:

    mlflow.pyfunc.load_model("models:/llamaflow-demo@champion").predict(["def "])
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from tokenizers import Tokenizer

from model import LlamaForPretraining, load_pretrained
from tasks.registry.manifest import verify_version
from tasks.tracking import store

_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))$")


@dataclass(frozen=True)
class ModelFiles:
    """A downloaded registered model: where its artifacts are and the special token ids."""

    name: str
    version: str
    weights: Path
    tokenizer: Path
    config: Path
    token_ids: dict[str, Any]


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """`models:/NAME@ALIAS` or `models:/NAME/VERSION` → (name, alias, version)."""
    match = _URI.match(uri.strip())
    if match is None:
        raise ValueError(
            f"Model URI {uri!r} is not of the form models:/NAME@ALIAS or models:/NAME/VERSION "
            "(e.g. models:/llamaflow-demo@champion)."
        )
    return match["name"], match["alias"], match["version"]


def resolve_version(uri: str, tracking_uri: str | None = None) -> ModelVersion:
    """The registry entry a `models:/` URI points at now (an alias is resolved once, here)."""
    name, alias, version = parse_model_uri(uri)
    client = store.get_client(store.check_tracking_store(tracking_uri))
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, version)
    except MlflowException as exc:
        try:
            known = client.get_registered_model(name)
            hint = f"known aliases: {sorted(known.aliases) or 'none'}"
        except MlflowException:
            hint = f"no registered model named {name!r}; register one with tasks.register.register_model"
        raise LookupError(f"{uri} does not resolve ({hint}).") from exc


def download_model_files(uri: str, dst: str | Path, tracking_uri: str | None = None) -> ModelFiles:
    """Download the pyfunc model behind `uri` into `dst` and locate its artifacts (from the store at
    `tracking_uri`; MLflow's process-wide tracking URI is neither read nor changed)."""
    import mlflow
    from mlflow.models import Model

    tracking_uri = store.check_tracking_store(tracking_uri)
    version = resolve_version(uri, tracking_uri)
    # Where the version's files are, asked through our client: MLflow's `models:/` artifact repository
    # resolves the name through the process-wide registry URI, whatever store it is given.
    location = store.get_client(tracking_uri).get_model_version_download_uri(version.name, version.version)
    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=location, dst_path=str(dst), tracking_uri=tracking_uri
        )
    )
    verify_version(local, version, f"{uri} (version {version.version})")  # before anything is read
    pyfunc = Model.load(local).flavors.get("python_function", {})
    artifacts = pyfunc.get("artifacts", {})
    missing = {"weights", "tokenizer", "config"} - set(artifacts)
    if missing:
        raise ValueError(
            f"{uri} (version {version.version}) is not a llamaflow model: artifacts {sorted(missing)} are "
            "missing. Register models with tasks.register.register_model."
        )
    return ModelFiles(
        name=version.name,
        version=str(version.version),
        weights=local / artifacts["weights"]["path"],
        tokenizer=local / artifacts["tokenizer"]["path"],
        config=local / artifacts["config"]["path"],
        token_ids=dict(pyfunc.get("config") or {}),  # the pyfunc's model_config, as MLmodel stores it
    )


def load_model(
    uri: str, device: str | torch.device = "cpu", tracking_uri: str | None = None
) -> tuple[LlamaForPretraining, Tokenizer]:
    """The registered model as an UNCOMPILED module in eval mode on `device`, and its tokenizer.

    Weights come from safetensors; nothing is unpickled. Compile the module afterwards if wanted.
    """
    parse_model_uri(uri)  # a malformed URI fails before any network or disk work
    with tempfile.TemporaryDirectory(prefix="llamaflow-lookup-") as tmp:
        files = download_model_files(uri, tmp, tracking_uri)
        model = load_pretrained(files.config, files.weights, device=device)
        tokenizer = Tokenizer.from_file(str(files.tokenizer))
    return model.eval(), tokenizer
