"""Log a checkpoint as an MLflow pyfunc (logged as code, weights as safetensors) and register it as a version,
through one explicit client: nothing reads or sets MLflow's process-wide tracking URI or active run.

`mlflow.models.Model.log` does the same through the process-wide URI (and logs `model_config` as run
params through the fluent API), so it is not used. Its MLmodel also keeps where each artifact came from
(`uri` of every artifact, `model_code_path`, `artifact_path`): absolute paths of the machine that
registered. Those are left out here; loading needs only the paths inside the model directory.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import mlflow
import safetensors
import tokenizers
import torch
from mlflow.entities import LoggedModelOutput, LoggedModelStatus
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import Model, infer_signature
from mlflow.tracking import MlflowClient

from model import weights as model_weights
from model.weights import CONFIG_FILE
from tasks.refs import CheckpointRef, TokenizerRef
from tasks.training.checkpoint_weights import whole_weights

# Logged as code (MLflow copies the file and runs it at load time) with the `model` package beside it.
# (Not imported here: importing it registers the model with MLflow's models-from-code loader.)
PYFUNC_CODE = Path(__file__).parent / "pyfunc.py"
MODEL_PACKAGE = Path(model_weights.__file__).parent
MANIFEST_CODE = Path(__file__).parent / "manifest.py"  # the pyfunc checks its files before loading them


def pip_requirements() -> list[str]:
    # Written by hand: MLflow's detection takes seconds and pins the local `+cpu` torch build.
    return [
        f"mlflow=={mlflow.__version__}",
        f"torch>={torch.__version__.split('+')[0]}",
        f"tokenizers=={tokenizers.__version__}",
        f"safetensors=={safetensors.__version__}",
        "numpy",
    ]


def _save_pyfunc(path: Path, model: Model, checkpoint: CheckpointRef, tokenizer: TokenizerRef) -> None:
    from tasks.registry.pyfunc import DEFAULT_PARAMS

    example = ["def "]
    mlflow.pyfunc.save_model(
        path=str(path),
        mlflow_model=model,
        python_model=str(PYFUNC_CODE),
        artifacts={
            "weights": str(whole_weights(Path(checkpoint.path))),
            "tokenizer": tokenizer.path,
            "config": str(Path(checkpoint.path) / CONFIG_FILE),
        },
        model_config={"bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id},
        code_paths=[str(MODEL_PACKAGE), str(MANIFEST_CODE)],
        signature=infer_signature(example, ["generated text"], params=DEFAULT_PARAMS),
        input_example=(example, {"max_new_tokens": 8}),
        pip_requirements=pip_requirements(),
    )
    for pycache in list(path.rglob("__pycache__")):  # saving loads the model once (input example check)
        shutil.rmtree(pycache)
    saved = Model.load(str(path))
    flavor = saved.flavors["python_function"]
    for artifact in flavor.get("artifacts", {}).values():
        artifact.pop("uri", None)  # where it was copied from
    flavor["model_code_path"] = Path(flavor["model_code_path"]).name  # the loader uses the name only
    saved.save(str(path / "MLmodel"))


def _wait_ready(client: MlflowClient, version: ModelVersion, timeout_s: float = 300.0) -> ModelVersion:
    deadline = time.monotonic() + timeout_s
    while version.status == "PENDING_REGISTRATION" and time.monotonic() < deadline:
        time.sleep(0.5)
        version = client.get_model_version(version.name, version.version)
    if version.status != "READY":
        raise RuntimeError(
            f"model version {version.name}/{version.version} is {version.status}: {version.status_message}"
        )
    return version


def log_version(
    client: MlflowClient,
    *,
    run_id: str,
    checkpoint: CheckpointRef,
    tokenizer: TokenizerRef,
    model_name: str,
    tags: dict[str, str],
    via_server: bool,
) -> ModelVersion:
    """Log the pyfunc as a logged model of `run_id` (at the checkpoint's step) and register it as a new
    version of `model_name` with `tags`; `via_server`: the registry is a tracking server (http/https)."""
    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id=experiment_id, name="model", source_run_id=run_id)
    try:
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=checkpoint.step)])
        model = Model(model_uuid=logged.model_id, run_id=run_id, model_id=logged.model_id)
        with tempfile.TemporaryDirectory(prefix="llamaflow-pyfunc-") as tmp:
            local = Path(tmp) / "model"
            _save_pyfunc(local, model, checkpoint, tokenizer)
            client.log_model_artifacts(logged.model_id, str(local))
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    try:
        client.create_registered_model(model_name)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    # A database registry resolves a `models:/<id>` source through MLflow's process-wide tracking URI (a
    # TODO in MLflow's SqlAlchemyStore), i.e. maybe another store; it gets the artifact location instead.
    source = f"models:/{logged.model_id}" if via_server else logged.artifact_location
    version = client.create_model_version(
        model_name, source=source, run_id=run_id, tags=tags, model_id=logged.model_id
    )
    return _wait_ready(client, version)
