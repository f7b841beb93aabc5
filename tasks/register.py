"""register: log a checkpoint as an MLflow pyfunc, register it, and promote it only if it is better.

"Better" is judged on the same validation data: when the champion was scored on a dataset with our
fingerprint its recorded val_loss is compared; otherwise the champion's weights are evaluated on our
val.npy first. The decision and both numbers are recorded on the new version. Aliases only, no stages.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlflow
import safetensors
import tokenizers
import torch
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import Model, infer_signature
from prefect import task

from model import weights as model_weights
from model.weights import CONFIG_FILE as CONFIG
from model.weights import WEIGHTS_FILE as WEIGHTS
from tasks.refs import CheckpointRef, DatasetRef, EvalResult, RegisteredModel, TokenizerRef
from tasks.tracking import store

# Logged as code (MLflow copies the file and runs it at load time) with the `model` package beside it.
# (Not imported here: importing it registers the model with MLflow's models-from-code loader.)
PYFUNC_CODE = Path(__file__).parent / "registry" / "pyfunc.py"
MODEL_PACKAGE = Path(model_weights.__file__).parent

TAG_PROMOTED = "llamaflow.promoted"
TAG_VAL_LOSS = "llamaflow.val_loss"
TAG_CHAMPION_VAL_LOSS = "llamaflow.champion_val_loss"
TAG_CHAMPION_VERSION = "llamaflow.champion_version"
TAG_DATASET = "llamaflow.dataset_fingerprint"
TAG_TOKENIZER = "llamaflow.tokenizer_fingerprint"
TAG_COMPARISON = "llamaflow.comparison"
TAG_EVAL_METHOD = "llamaflow.eval_method"


def pip_requirements() -> list[str]:
    # Written by hand: MLflow's detection takes seconds and pins the local `+cpu` torch build.
    return [
        f"mlflow=={mlflow.__version__}",
        f"torch>={torch.__version__.split('+')[0]}",
        f"tokenizers=={tokenizers.__version__}",
        f"safetensors=={safetensors.__version__}",
        "numpy",
    ]


def _check_inputs(
    checkpoint: CheckpointRef, tokenizer: TokenizerRef, dataset: DatasetRef, eval_result: EvalResult
) -> dict[str, Any]:
    ckpt = Path(checkpoint.path)
    for name in (WEIGHTS, CONFIG):
        if not (ckpt / name).is_file():
            raise FileNotFoundError(
                f"Checkpoint {ckpt} lacks {name}; register the final checkpoint directory written by training "
                f"(it holds {WEIGHTS} of the unwrapped module and {CONFIG})."
            )
    if not Path(tokenizer.path).is_file():
        raise FileNotFoundError(f"Tokenizer file {tokenizer.path} does not exist.")
    if not (Path(dataset.path) / "val.npy").is_file():
        raise FileNotFoundError(
            f"Dataset {dataset.path} has no val.npy; promotion needs the validation blocks."
        )
    if not math.isfinite(eval_result.val_loss):
        raise ValueError(
            f"eval_result.val_loss is {eval_result.val_loss}; a diverged model cannot be registered."
        )
    config = json.loads((ckpt / CONFIG).read_text(encoding="utf-8"))
    if int(config["vocab_size"]) < tokenizer.vocab_size:
        raise ValueError(
            f"Model vocab_size {config['vocab_size']} < tokenizer vocab_size {tokenizer.vocab_size}: "
            "this checkpoint was not trained with this tokenizer."
        )
    return config


def _current_champion(client: mlflow.MlflowClient, name: str, alias: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def _log_pyfunc(
    run_id: str,
    checkpoint: CheckpointRef,
    tokenizer: TokenizerRef,
    model_name: str,
    version_tags: dict[str, str],
) -> str:
    """Log the pyfunc under the run's experiment, register it with `version_tags` (one request on a
    server instead of one per tag), return the new version number."""
    from tasks.registry.pyfunc import DEFAULT_PARAMS

    client = store.get_client(mlflow.get_tracking_uri())
    experiment_id = client.get_run(run_id).info.experiment_id
    # Model.log with an explicit model_id puts the model in the run's experiment without touching the
    # process-wide active run or experiment (Prefect tasks run in worker threads).
    logged = client.create_logged_model(experiment_id=experiment_id, name="model", source_run_id=run_id)
    example = ["def "]
    info = Model.log(
        artifact_path=None,
        name="model",
        flavor=mlflow.pyfunc,
        run_id=run_id,
        model_id=logged.model_id,
        registered_model_name=model_name,
        python_model=str(PYFUNC_CODE),
        artifacts={
            "weights": str(Path(checkpoint.path) / WEIGHTS),
            "tokenizer": tokenizer.path,
            "config": str(Path(checkpoint.path) / CONFIG),
        },
        model_config={"bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id},
        code_paths=[str(MODEL_PACKAGE)],
        signature=infer_signature(example, ["generated text"], params=DEFAULT_PARAMS),
        input_example=(example, {"max_new_tokens": 8}),
        pip_requirements=pip_requirements(),
        tags=version_tags,
    )
    if info.registered_model_version is None:
        raise RuntimeError(f"MLflow logged the model for run {run_id} but did not register {model_name!r}.")
    return str(info.registered_model_version)


def eval_method(max_blocks: int, dtype: str) -> str:
    return f"mean token CE, first {max_blocks} val blocks, {dtype}"


def _champion_loss_on(
    champion: ModelVersion,
    dataset: DatasetRef,
    tokenizer: TokenizerRef,
    *,
    max_blocks: int,
    dtype: str,
    device: str,
) -> tuple[float | None, str]:
    """The champion's val_loss on `dataset`, and how it was obtained (None: not comparable)."""
    from tasks.evaluate import mean_token_loss
    from tasks.lookup import load_model
    from tasks.training.distributed import resolve_device

    recorded = champion.tags.get(TAG_VAL_LOSS)
    same_data = champion.tags.get(TAG_DATASET) == dataset.fingerprint
    if (
        same_data
        and champion.tags.get(TAG_EVAL_METHOD) == eval_method(max_blocks, dtype)
        and recorded is not None
    ):
        return float(recorded), "recorded on the same dataset with the same eval method"
    if champion.tags.get(TAG_TOKENIZER, tokenizer.fingerprint) != tokenizer.fingerprint:
        return None, "champion uses another tokenizer: per-token losses are not comparable"
    dev = resolve_device(device)
    try:
        model, _ = load_model(f"models:/{champion.name}/{champion.version}", device=dev)
    except ValueError as exc:  # a version registered by something other than llamaflow
        return None, f"champion cannot be loaded as a llamaflow model ({exc})"
    if model.config.vocab_size < dataset.vocab_size:
        return None, "champion's vocabulary is smaller than this dataset's"
    loss = mean_token_loss(
        model,
        Path(dataset.path) / "val.npy",
        pad_id=tokenizer.pad_id,
        max_blocks=max_blocks,
        dtype=dtype,
        device=dev,
    )
    return loss, f"champion re-evaluated on dataset {dataset.fingerprint[:12]}"


def register_model(
    *,
    run_id: str,
    checkpoint: CheckpointRef,
    tokenizer: TokenizerRef,
    dataset: DatasetRef,
    eval_result: EvalResult,
    model_name: str,
    alias: str = "champion",
    tracking_uri: str | None = None,
    eval_max_blocks: int = 256,
    eval_dtype: str = "bf16",
    eval_device: str = "auto",
) -> RegisteredModel:
    """Register the checkpoint as a new version of `model_name`; move `alias` to it only if it is better.

    `eval_max_blocks`/`eval_dtype` must match how `eval_result` was computed (tasks.evaluate defaults).
    A champion's recorded val_loss is reused only for the same dataset fingerprint and eval method;
    otherwise the champion is evaluated here, on `eval_device`.
    """
    _check_inputs(checkpoint, tokenizer, dataset, eval_result)
    uri = store.use_tracking_uri(tracking_uri)
    client = store.get_client(uri)
    client.get_run(run_id)  # an unknown run fails here, before anything is logged

    # The comparison runs before anything is logged, so a failing champion evaluation leaves no
    # half-recorded version behind. Two registrations racing for one alias are not serialised.
    champion = _current_champion(client, model_name, alias)
    champion_loss: float | None = None
    if champion is None:
        promoted, comparison = True, "no previous champion"
    else:
        champion_loss, comparison = _champion_loss_on(
            champion, dataset, tokenizer, max_blocks=eval_max_blocks, dtype=eval_dtype, device=eval_device
        )
        promoted = champion_loss is not None and eval_result.val_loss < champion_loss

    decision = {
        TAG_PROMOTED: str(promoted).lower(),
        TAG_VAL_LOSS: repr(eval_result.val_loss),
        TAG_CHAMPION_VAL_LOSS: "none" if champion_loss is None else repr(champion_loss),
        TAG_CHAMPION_VERSION: "none" if champion is None else str(champion.version),
        TAG_DATASET: dataset.fingerprint,
        TAG_TOKENIZER: tokenizer.fingerprint,
        TAG_EVAL_METHOD: eval_method(eval_max_blocks, eval_dtype),
        TAG_COMPARISON: comparison,
        "llamaflow.run_id": run_id,
    }
    version = _log_pyfunc(run_id, checkpoint, tokenizer, model_name, version_tags=decision)
    client.update_model_version(
        model_name,
        version,
        description=_decision_sentence(
            version, alias, promoted, eval_result.val_loss, champion, champion_loss, comparison, dataset
        ),
    )
    if promoted:
        client.set_registered_model_alias(model_name, alias, version)
    client.set_tag(run_id, "llamaflow.registered_version", f"{model_name}/{version}")

    return RegisteredModel(
        name=model_name,
        version=version,
        uri=f"models:/{model_name}/{version}",
        alias=alias,
        promoted=promoted,
        run_id=run_id,
        champion_val_loss=champion_loss,
    )


def _decision_sentence(
    version: str,
    alias: str,
    promoted: bool,
    val_loss: float,
    champion: ModelVersion | None,
    champion_loss: float | None,
    comparison: str,
    dataset: DatasetRef,
) -> str:
    data = f"validation data {dataset.fingerprint[:12]}"
    if champion is None:
        return f"Version {version} became '{alias}': val_loss {val_loss:.4f} on {data}, no previous champion."
    if champion_loss is None:
        return (
            f"Version {version} was not promoted: val_loss {val_loss:.4f} on {data}, but version "
            f"{champion.version} ('{alias}') could not be compared ({comparison})."
        )
    verb = "took" if promoted else "did not take"
    relation = "<" if promoted else ">="
    return (
        f"Version {version} {verb} '{alias}' from version {champion.version}: val_loss {val_loss:.4f} "
        f"{relation} champion's {champion_loss:.4f} on {data} ({comparison})."
    )


register_task = task(register_model, name="register")
