"""register: log a checkpoint as an MLflow pyfunc, register it, and promote it only if it is better.

"Better" is lower bits per byte on the same validation text (`tasks.scoring`): the champion's recorded
number when it was scored on a text with the same fingerprint, else the champion re-scored here on our
text with its own tokenizer, so a champion with another tokenizer or vocabulary compares too. Both
numbers and the decision are recorded on the new version, and sent as a Prefect event.

The compare-and-set of the alias runs under a per-model lock in the MLflow store (`tasks.registry.lock`):
two registrations finishing together cannot leave the worse one holding it. Registering a run again
(a flow-run retry) returns the version it already registered. Every call goes through a client of the
given store; MLflow's process-wide tracking URI is never touched. Aliases only, no stages.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import task
from tokenizers import Tokenizer

from model import load_pretrained
from model.weights import CONFIG_FILE as CONFIG
from model.weights import WEIGHTS_FILE as WEIGHTS
from tasks.refs import CheckpointRef, DatasetRef, EvalResult, RegisteredModel, TokenizerRef
from tasks.registry import events
from tasks.registry.lock import promotion_lock
from tasks.registry.publish import log_version
from tasks.scoring import ScoringError, validation_text
from tasks.tracking import store
from tasks.training.distributed import resolve_device

TAG_BITS_PER_BYTE = "llamaflow.bits_per_byte"
TAG_VAL_LOSS = "llamaflow.val_loss"
TAG_XZ_BITS_PER_BYTE = "llamaflow.xz_bits_per_byte"
TAG_TEXT = "llamaflow.validation_text"
TAG_EVAL_DTYPE = "llamaflow.eval_dtype"
TAG_SEQ_LEN = "llamaflow.seq_len"
TAG_DATASET = "llamaflow.dataset_fingerprint"
TAG_TOKENIZER = "llamaflow.tokenizer_fingerprint"
TAG_RUN = "llamaflow.run_id"
# The decision, written under the promotion lock:
TAG_PROMOTED = "llamaflow.promoted"
TAG_CHAMPION_BITS_PER_BYTE = "llamaflow.champion_bits_per_byte"
TAG_CHAMPION_VERSION = "llamaflow.champion_version"
TAG_COMPARISON = "llamaflow.comparison"
RUN_TAG_VERSION = "llamaflow.registered_version"
MAX_CHAMPION_CHANGES = 5


def _check_inputs(
    checkpoint: CheckpointRef, tokenizer: TokenizerRef, dataset: DatasetRef, eval_result: EvalResult
) -> None:
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
            f"Dataset {dataset.path} has no val.npy; promotion needs the validation text."
        )
    if not (math.isfinite(eval_result.bits_per_byte) and math.isfinite(eval_result.val_loss)):
        raise ValueError(
            f"bits per byte is {eval_result.bits_per_byte} (loss {eval_result.val_loss}): a diverged model "
            "cannot be registered."
        )
    if eval_result.dataset_fingerprint != dataset.fingerprint:
        raise ValueError(
            f"eval_result was measured on dataset {eval_result.dataset_fingerprint[:12]}, not on {dataset.fingerprint[:12]}: "
            "pass the dataset that evaluate() scored"
        )
    config = json.loads((ckpt / CONFIG).read_text(encoding="utf-8"))
    if int(config["vocab_size"]) < tokenizer.vocab_size:
        raise ValueError(
            f"Model vocab_size {config['vocab_size']} < tokenizer vocab_size {tokenizer.vocab_size}: "
            "this checkpoint was not trained with this tokenizer."
        )


def _current_champion(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def _version_of_run(client: MlflowClient, name: str, run_id: str) -> ModelVersion | None:
    found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def _number(text: str | None) -> float | None:
    return None if text in (None, "none") else float(text)


def _champion_bits_per_byte(
    champion: ModelVersion,
    eval_result: EvalResult,
    dataset: DatasetRef,
    tokenizer: TokenizerRef,
    *,
    uri: str,
    device: str,
) -> tuple[float | None, str]:
    """The champion's bits per byte on our validation text, and how it was obtained (None: not comparable)."""
    from tasks.evaluate import rescore
    from tasks.lookup import download_model_files

    tags = champion.tags
    same_text = (
        tags.get(TAG_TEXT) == eval_result.text_fingerprint and tags.get(TAG_EVAL_DTYPE) == eval_result.dtype
    )
    if same_text and (recorded := _number(tags.get(TAG_BITS_PER_BYTE))) is not None:
        return recorded, "recorded on the same validation text"

    text = validation_text(dataset, tokenizer, eval_result.max_blocks)
    if text.fingerprint != eval_result.text_fingerprint:
        raise ValueError("eval_result was not measured on this dataset's validation text; re-run evaluate()")
    dev = resolve_device(device)
    with tempfile.TemporaryDirectory(prefix="llamaflow-champion-") as tmp:
        try:
            files = download_model_files(f"models:/{champion.name}/{champion.version}", tmp, uri)
        except ValueError as exc:  # a version registered by something other than llamaflow
            return None, f"champion cannot be loaded as a llamaflow model ({exc})"
        model = load_pretrained(files.config, files.weights, device=dev).eval()
        seq_len = min(int(tags.get(TAG_SEQ_LEN, dataset.seq_len)), model.config.max_position_embeddings)
        try:
            bpb = rescore(
                model,
                Tokenizer.from_file(str(files.tokenizer)),
                files.token_ids,
                text,
                seq_len=seq_len,
                device=dev,
                dtype=eval_result.dtype,
            )
        except ScoringError as exc:
            return None, f"champion cannot be scored on this validation text: {exc}"
    return (
        bpb,
        f"champion re-scored on this validation text ({len(text.text):,} bytes) with its own tokenizer",
    )


def _score_tags(
    eval_result: EvalResult, dataset: DatasetRef, tokenizer: TokenizerRef, run_id: str
) -> dict[str, str]:
    return {
        TAG_BITS_PER_BYTE: repr(eval_result.bits_per_byte),
        TAG_VAL_LOSS: repr(eval_result.val_loss),
        TAG_XZ_BITS_PER_BYTE: repr(eval_result.xz_bits_per_byte),
        TAG_TEXT: eval_result.text_fingerprint,
        TAG_EVAL_DTYPE: eval_result.dtype,
        TAG_SEQ_LEN: str(dataset.seq_len),
        TAG_DATASET: dataset.fingerprint,
        TAG_TOKENIZER: tokenizer.fingerprint,
        TAG_RUN: run_id,
    }


def _recorded(version: ModelVersion, alias: str) -> RegisteredModel:
    tags = version.tags
    return RegisteredModel(
        name=version.name,
        version=str(version.version),
        uri=f"models:/{version.name}/{version.version}",
        alias=alias,
        promoted=tags[TAG_PROMOTED] == "true",
        run_id=tags.get(TAG_RUN, version.run_id),
        bits_per_byte=float(tags[TAG_BITS_PER_BYTE]),
        champion_bits_per_byte=_number(tags.get(TAG_CHAMPION_BITS_PER_BYTE)),
        champion_version=None
        if tags.get(TAG_CHAMPION_VERSION) in (None, "none")
        else tags[TAG_CHAMPION_VERSION],
    )


def _decide(
    client: MlflowClient,
    version: ModelVersion,
    eval_result: EvalResult,
    dataset: DatasetRef,
    tokenizer: TokenizerRef,
    *,
    alias: str,
    uri: str,
    device: str,
) -> tuple[RegisteredModel, str]:
    """Compare with the champion and move the alias if better: compare-and-set under the model's lock.

    The champion's number may need a re-score (seconds to minutes), so it is computed outside the lock; under
    it the alias is read again, and if another registration moved it meanwhile, the comparison is redone."""
    name, ours = version.name, eval_result.bits_per_byte
    for _ in range(MAX_CHAMPION_CHANGES):
        holder = _current_champion(client, name, alias)
        held_by = None if holder is None else str(holder.version)
        # A retry that moved the alias before it could record the decision holds it already.
        champion = None if held_by in (None, str(version.version)) else holder
        theirs, comparison = None, "no previous champion" if held_by is None else "already the champion"
        if champion is not None:
            theirs, comparison = _champion_bits_per_byte(
                champion, eval_result, dataset, tokenizer, uri=uri, device=device
            )
        with promotion_lock(client, name):
            now = _current_champion(client, name, alias)
            if (None if now is None else str(now.version)) != held_by:
                continue  # another registration moved the alias meanwhile: compare with the new champion
            promoted = champion is None or (theirs is not None and ours < theirs)
            if promoted and held_by != str(version.version):
                client.set_registered_model_alias(name, alias, version.version)
            decision = {
                TAG_PROMOTED: str(promoted).lower(),
                TAG_CHAMPION_BITS_PER_BYTE: "none" if theirs is None else repr(theirs),
                TAG_CHAMPION_VERSION: "none" if champion is None else str(champion.version),
                TAG_COMPARISON: comparison,
            }
            for key, value in decision.items():
                client.set_model_version_tag(name, version.version, key, value)
        description = _decision_sentence(
            version.version, alias, promoted, ours, champion, theirs, comparison, dataset
        )
        client.update_model_version(name, version.version, description=description)
        return _recorded(client.get_model_version(name, version.version), alias), comparison
    raise RuntimeError(
        f"the '{alias}' alias of {name!r} moved {MAX_CHAMPION_CHANGES} times while comparing; try again"
    )


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
    eval_device: str = "auto",
) -> RegisteredModel:
    """Register the checkpoint as a new version of `model_name` (once per run); move `alias` to it only if
    its bits per byte on the validation text is lower than the champion's. A champion scored on another
    text is re-scored here, on `eval_device`."""
    _check_inputs(checkpoint, tokenizer, dataset, eval_result)
    uri = store.check_tracking_store(tracking_uri)
    client = store.get_client(uri)
    client.get_run(run_id)  # an unknown run fails here, before anything is logged
    version = _version_of_run(client, model_name, run_id)
    if version is not None and TAG_PROMOTED in version.tags:
        return _recorded(version, alias)  # a retry: this run's registration is done
    if version is None:
        version = log_version(
            client,
            run_id=run_id,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            model_name=model_name,
            tags=_score_tags(eval_result, dataset, tokenizer, run_id),
            via_server=uri.startswith(("http://", "https://")),
        )
    registered, comparison = _decide(
        client, version, eval_result, dataset, tokenizer, alias=alias, uri=uri, device=eval_device
    )
    client.set_tag(run_id, RUN_TAG_VERSION, f"{model_name}/{registered.version}")
    events.emit_decision(registered, comparison)
    return registered


def _decision_sentence(
    version: str,
    alias: str,
    promoted: bool,
    ours: float,
    champion: ModelVersion | None,
    theirs: float | None,
    comparison: str,
    dataset: DatasetRef,
) -> str:
    data = f"the validation text of dataset {dataset.fingerprint[:12]}"
    if champion is None:
        return (
            f"Version {version} became '{alias}': {ours:.4f} bits per byte on {data}, no previous champion."
        )
    if theirs is None:
        return (
            f"Version {version} was not promoted: {ours:.4f} bits per byte on {data}, but version "
            f"{champion.version} ('{alias}') could not be compared ({comparison})."
        )
    verb = "took" if promoted else "did not take"
    relation = "<" if promoted else ">="
    return (
        f"Version {version} {verb} '{alias}' from version {champion.version}: {ours:.4f} bits per byte "
        f"{relation} the champion's {theirs:.4f} on {data} ({comparison})."
    )


register_task = task(register_model, name="register")
