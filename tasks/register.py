"""register: log a checkpoint as an MLflow pyfunc, register it, and promote it only if it is better.

"Better" is lower bits per byte on the same validation text (`tasks.scoring`): the champion's recorded
number when it was scored on a text with the same fingerprint, else the champion re-scored here on our
text with its own tokenizer, so a champion with another tokenizer or vocabulary compares too. A champion
that cannot be compared (its files are gone, it is not a llamaflow model, it cannot score our text) is
recorded "not comparable: <why>" and keeps the alias unless `promotion` says otherwise
(`tasks.refs.Promotion`). Both numbers and the decision are recorded on the new version, and sent as a
Prefect event.

The compare-and-set of the alias runs under a per-model lock in the MLflow store, fenced
(`tasks.registry.decision`, `tasks.registry.lock`): two registrations finishing together cannot leave the
worse one holding it. The decision runs as the promoter when `LLAMAFLOW_PROMOTER_USERNAME`/`_PASSWORD` are
set (`tasks.registry.promoter`: a worker's own credentials may register versions but not move aliases).
Registering a run again (a flow-run retry) returns the version it already
registered, completing what a crash left undone (the decision, the run tag, the event). Every call goes
through a client of the given store; MLflow's process-wide tracking URI is never touched. Aliases only.
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
from tasks.refs import CheckpointRef, DatasetRef, EvalResult, Promotion, RegisteredModel, TokenizerRef
from tasks.registry import events
from tasks.registry.decision import (
    NOT_COMPARABLE,
    TAG_CHAMPION_BITS_PER_BYTE,
    TAG_CHAMPION_VERSION,
    TAG_COMPARISON,
    TAG_PROMOTED,
    decide,
    number,
    recorded_score,
    score_record,
)
from tasks.registry.promoter import promoter_client, refused
from tasks.registry.publish import log_version
from tasks.scoring import ScoringError, validation_text
from tasks.tracking import store
from tasks.training.checkpoint_weights import whole_weights
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
TAG_EVENT = "llamaflow.decision_event"  # the id of the Prefect event sent for the decision
RUN_TAG_VERSION = "llamaflow.registered_version"


def _check_inputs(
    checkpoint: CheckpointRef, tokenizer: TokenizerRef, dataset: DatasetRef, eval_result: EvalResult
) -> None:
    ckpt = Path(checkpoint.path)
    whole_weights(ckpt)  # a sharded run's checkpoint: its model.safetensors, consolidated once
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


def _version_of_run(client: MlflowClient, name: str, run_id: str) -> ModelVersion | None:
    found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def _champion_bits_per_byte(
    champion: ModelVersion,
    eval_result: EvalResult,
    dataset: DatasetRef,
    tokenizer: TokenizerRef,
    *,
    uri: str,
    device: str,
) -> tuple[float | None, str]:
    """The champion's bits per byte on our validation text and how it was obtained; None and why when it
    cannot be compared. Never raises over the champion: only our own inputs can fail here."""
    from tasks.evaluate import rescore
    from tasks.lookup import download_model_files

    tags = champion.tags
    # The number its own decision recorded, never the registering worker's tags (which it may rewrite).
    recorded = recorded_score(tags, eval_result.text_fingerprint, eval_result.dtype)
    if recorded is not None:
        return recorded, "recorded on the same validation text"

    text = validation_text(dataset, tokenizer, eval_result.max_blocks)
    if text.fingerprint != eval_result.text_fingerprint:
        raise ValueError("eval_result was not measured on this dataset's validation text; re-run evaluate()")
    dev = resolve_device(device)
    stage = "downloaded"
    try:
        with tempfile.TemporaryDirectory(prefix="llamaflow-champion-") as tmp:
            files = download_model_files(f"models:/{champion.name}/{champion.version}", tmp, uri)
            stage = "loaded"
            model = load_pretrained(files.config, files.weights, device=dev).eval()
            seq_len = min(int(tags.get(TAG_SEQ_LEN, dataset.seq_len)), model.config.max_position_embeddings)
            stage = "scored on this validation text"
            bpb = rescore(
                model,
                Tokenizer.from_file(str(files.tokenizer)),
                files.token_ids,
                text,
                seq_len=seq_len,
                device=dev,
                dtype=eval_result.dtype,
            )
    except (ScoringError, MlflowException, OSError, ValueError, RuntimeError, KeyError) as exc:
        # Files gone, another kind of model, a corrupt or mismatched checkpoint, a text it cannot score.
        return None, f"{NOT_COMPARABLE}: version {champion.version} could not be {stage} ({exc})"
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
        champion_bits_per_byte=number(tags.get(TAG_CHAMPION_BITS_PER_BYTE)),
        champion_version=None
        if tags.get(TAG_CHAMPION_VERSION) in (None, "none")
        else tags[TAG_CHAMPION_VERSION],
    )


def _complete(client: MlflowClient, version: ModelVersion, registered: RegisteredModel) -> None:
    """What follows a recorded decision, each step done only if missing (a retry after a crash completes
    it): the version's description, the run's tag naming its version, the Prefect event."""
    description = _decision_sentence(version, registered)
    if version.description != description:
        client.update_model_version(version.name, version.version, description=description)
    run_tag = f"{registered.name}/{registered.version}"
    if client.get_run(registered.run_id).data.tags.get(RUN_TAG_VERSION) != run_tag:
        client.set_tag(registered.run_id, RUN_TAG_VERSION, run_tag)
    if TAG_EVENT not in version.tags:
        event = events.emit_decision(registered, version.tags.get(TAG_COMPARISON, ""))
        if event is not None:
            client.set_model_version_tag(version.name, version.version, TAG_EVENT, str(event.id))


def register_model(
    *,
    run_id: str,
    checkpoint: CheckpointRef,
    tokenizer: TokenizerRef,
    dataset: DatasetRef,
    eval_result: EvalResult,
    model_name: str,
    alias: str = "champion",
    promotion: Promotion = "if_better",
    tracking_uri: str | None = None,
    eval_device: str = "auto",
    lineage_tags: dict[str, str] | None = None,
) -> RegisteredModel:
    """Register the checkpoint as a new version of `model_name` (once per run); move `alias` to it only if
    its bits per byte on the validation text is lower than the champion's (`promotion` widens that). A
    champion scored on another text is re-scored here, on `eval_device`. `lineage_tags`
    (`tasks.registry.lineage.version_tags`) are written with the version."""
    _check_inputs(checkpoint, tokenizer, dataset, eval_result)
    uri = store.check_tracking_store(tracking_uri)
    client = store.get_client(uri)
    client.get_run(run_id)  # an unknown run fails here, before anything is logged
    version = _version_of_run(client, model_name, run_id)
    if version is None:
        version = log_version(
            client,
            run_id=run_id,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            model_name=model_name,
            tags={**_score_tags(eval_result, dataset, tokenizer, run_id), **(lineage_tags or {})},
            via_server=uri.startswith(("http://", "https://")),
        )
    if TAG_PROMOTED not in version.tags:  # no decision yet (a retry after a crash in it redoes it)

        def score_champion(champion: ModelVersion) -> tuple[float | None, str]:
            return _champion_bits_per_byte(
                champion, eval_result, dataset, tokenizer, uri=uri, device=eval_device
            )

        decider = promoter_client(uri) or client  # the alias moves by the promoter's hand, when there is one
        try:
            decide(
                decider,
                version,
                eval_result.bits_per_byte,
                score_champion,
                alias=alias,
                promotion=promotion,
                record=score_record(
                    eval_result.bits_per_byte, eval_result.text_fingerprint, eval_result.dtype
                ),
            )
        except MlflowException as exc:
            raise (refused(exc, alias, model_name) or exc) from exc
        version = client.get_model_version(model_name, version.version)
    registered = _recorded(version, alias)
    _complete(client, version, registered)
    return registered


def _decision_sentence(version: ModelVersion, registered: RegisteredModel) -> str:
    alias, ours = registered.alias, registered.bits_per_byte
    comparison = version.tags.get(TAG_COMPARISON, "")
    data = f"the validation text of dataset {version.tags.get(TAG_DATASET, '?')[:12]}"
    champion, theirs = registered.champion_version, registered.champion_bits_per_byte
    if champion is None:
        return (
            f"Version {version.version} became '{alias}': {ours:.4f} bits per byte on {data}, no previous "
            "champion."
        )
    if theirs is None:
        verb = f"took '{alias}' from version {champion}" if registered.promoted else "was not promoted"
        return (
            f"Version {version.version} {verb}: {ours:.4f} bits per byte on {data}, but version {champion} "
            f"('{alias}') could not be compared ({comparison})."
        )
    verb = "took" if registered.promoted else "did not take"
    relation = "<" if ours < theirs else ">="
    return (
        f"Version {version.version} {verb} '{alias}' from version {champion}: {ours:.4f} bits per byte "
        f"{relation} the champion's {theirs:.4f} on {data} ({comparison})."
    )


register_task = task(register_model, name="register")
