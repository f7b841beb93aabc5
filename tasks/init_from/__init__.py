"""`init_from`: the model a run starts from, resolved once at the start of the flow (`ParentRef`).

    resolve_init_from("models:/llamaflow-demo@champion")   # alias → version + logged model id, files cached
    resolve_init_from("runs:/<run id>/checkpoint-000350")   # a run's logged model (MLflow 3)
    resolve_init_from("models:/m-<id>")                      # a logged model by id
    resolve_init_from("meta-llama/Llama-3.2-1B")             # hub id from the local HF cache (hf:ORG/NAME@REV)
    resolve_init_from("/ckpts/hf-llama")                     # a Hugging Face Llama directory
    resolve_init_from("/runs/x/step_001200")                 # a llamaflow checkpoint (or a .safetensors file)
    resolve_init_from("s3://bucket/run/step_001200")         # one in an object store (tasks/training/storage.py)

A run that starts from a parent is a NEW run: new optimizer, new schedule (warmup included), data from the
start. Resuming (`checkpoint_dir` holding checkpoints) continues an interrupted run instead. `resolve_for_run`
records the resolved parent in the run directory, so a retry or a resumed rerun keeps the parent resolved at
its start, even after the alias moved; and it refuses to mix up the two.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from model.atomic import write_text_atomic
from tasks.data.errors import data_logger
from tasks.init_from.hf_source import is_hf_dir, looks_like_hub_id, resolve_hf, resolve_hub_id
from tasks.init_from.local import describe_run_dir, resolve_local
from tasks.init_from.mlflow_source import (
    LOGGED_MODEL_URI,
    resolve_logged_model,
    resolve_registry,
    resolve_run,
)
from tasks.init_from.parent_cache import InitFromError
from tasks.refs import ParentRef
from tasks.tracking import store
from tasks.training import checkpoint as ckpt
from tasks.training.storage import fetch_checkpoint, is_remote

__all__ = ["RECORD_FILE", "InitFromError", "resolve_for_run", "resolve_for_run_task", "resolve_init_from"]

RECORD_FILE = "init_from.json"


def resolve_init_from(source: str, tracking_uri: str | None = None) -> ParentRef:
    """Find the model `source` names, pin it (an alias to its version), and keep its files in the cache."""
    source = source.strip()
    if source.startswith("runs:/"):
        return resolve_run(source, store.check_tracking_store(tracking_uri))
    if LOGGED_MODEL_URI.match(source):
        return resolve_logged_model(source, store.check_tracking_store(tracking_uri))
    if source.startswith("models:/"):
        return resolve_registry(source, store.check_tracking_store(tracking_uri))
    if is_remote(source):  # s3://bucket/run/step_000123: the checkpoint fetched (and verified) first
        return resolve_local(source, fetch_checkpoint(source))
    path = Path(source).expanduser()
    if path.exists():
        return resolve_hf(source, path) if is_hf_dir(path) else resolve_local(source, path)
    if looks_like_hub_id(source):
        return resolve_hub_id(source)
    raise InitFromError(
        f"init_from={source!r} is not an existing path, a models:/NAME@ALIAS, models:/NAME/VERSION, "
        "models:/m-ID or runs:/RUN_ID URI, or a Hugging Face hub id (ORG/NAME)"
    )


def read_record(run_dir: str | Path) -> ParentRef | None:
    path = Path(run_dir) / RECORD_FILE
    return ParentRef.model_validate_json(path.read_text()) if path.is_file() else None


def _reopen(recorded: ParentRef, tracking_uri: str | None) -> ParentRef:
    """The recorded parent, its files fetched again by its pinned identity when the cache lost them."""
    if (Path(recorded.path) / "model.safetensors").is_file():
        return recorded
    concrete = recorded.kind in ("registry", "logged_model") or recorded.pinned.startswith("hf:")
    again = resolve_init_from(recorded.pinned if concrete else recorded.source, tracking_uri)
    if again.weights_sha256 != recorded.weights_sha256:
        raise InitFromError(
            f"this run started from {recorded.pinned} (weights sha256 {recorded.weights_sha256[:16]}), whose "
            f"cached files are gone, and {again.pinned} now holds other weights; resume is not possible"
        )
    return recorded.model_copy(update={"path": again.path, "tokenizer_path": again.tokenizer_path})


def resolve_for_run(
    source: str | None, run_dir: str | Path, tracking_uri: str | None = None
) -> ParentRef | None:
    """The run's parent, resolved once per run directory.

    A run directory that recorded its parent (a retry of the flow run, a rerun resuming it) keeps that
    one, whatever the alias points at now. A run directory holding checkpoints but no record is a run to
    resume, not one to start from `source`: that is refused, naming both ways."""
    run_dir = Path(run_dir)
    recorded = read_record(run_dir)
    if recorded is not None:
        if source is not None and source.strip() != recorded.source:
            raise InitFromError(
                f"checkpoint_dir={run_dir} holds a run started from init_from={recorded.source!r} "
                f"({recorded.pinned}); now init_from={source!r}. Resuming continues that run: drop "
                "init_from (or give the same one). To start a new run from the new parent, drop checkpoint_dir"
            )
        data_logger().info(f"this run started from {recorded.pinned} (init_from={recorded.source!r})")
        return _reopen(recorded, tracking_uri)
    if source is None:
        return None
    if ckpt.checkpoint_dirs(run_dir):
        raise InitFromError(
            f"both a run to resume and a model to start from: {describe_run_dir(run_dir)}. Giving "
            f"checkpoint_dir={run_dir} resumes it, while init_from={source!r} starts a new run; drop one"
        )
    parent = resolve_init_from(source, tracking_uri)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / RECORD_FILE, parent.model_dump_json(indent=2))
    data_logger().info(f"init_from={source!r} resolved to {parent.pinned}; this run loads that")
    return parent


resolve_for_run_task = task(resolve_for_run, name="resolve_init_from")
