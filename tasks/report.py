"""What a finished run leaves for people: evaluation in MLflow, a summary artifact in Prefect."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext

from tasks import tracking
from tasks.refs import CheckpointRef, EvalResult


def flow_run_tags() -> dict[str, str]:
    """Tags that link an MLflow run to the Prefect flow run that made it."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return {}
    return {
        "prefect.flow_run_id": str(ctx.flow_run.id),
        "prefect.flow_run_name": ctx.flow_run.name,
        "prefect.deployment_id": str(ctx.flow_run.deployment_id or ""),
    }


def log_evaluation(run_id: str, evaluation: EvalResult, *, checkpoint: CheckpointRef) -> None:
    """Validation metrics at the final step, the samples table, and the loss/LR curve figure."""
    now = int(time.time() * 1000)
    values = {"val/loss": evaluation.val_loss, "val/perplexity": evaluation.perplexity}
    if evaluation.initial_val_loss is not None:
        values["val/initial_loss"] = evaluation.initial_val_loss
    metrics = [Metric(key, float(v), now, checkpoint.step) for key, v in values.items()]
    tracking.get_client().log_batch(run_id, metrics=metrics)
    if evaluation.samples:
        tracking.log_samples(run_id, evaluation.samples)
    history = Path(checkpoint.run_dir) / "metrics.jsonl"
    if history.is_file():
        tracking.log_training_curves(run_id, history)


def publish_summary(result: dict[str, Any]) -> None:
    """A markdown artifact on the flow run: metrics table, MLflow run and registered version."""
    if FlowRunContext.get() is None:
        return
    ev, reg = result["evaluation"], result["registered"]
    rows = [("validation loss", f"{ev['val_loss']:.4f}"), ("perplexity", f"{ev['perplexity']:.2f}")]
    if ev.get("initial_val_loss") is not None:
        rows.insert(0, ("validation loss before training", f"{ev['initial_val_loss']:.4f}"))
    rows += [
        (k, f"{v:.4g}")
        for k, v in sorted(result["metrics"].items())
        if k not in ("val_loss", "val_perplexity")
    ]
    decision = "moved to this version" if reg["promoted"] else "kept by the previous champion"
    champion = reg.get("champion_val_loss")
    lines = [
        f"# Pretraining run `{result['run_id']}`",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        f"**Registered:** `{result['model_uri']}`; alias `@{reg['alias']}` {decision}"
        + (f" (previous champion's validation loss {champion:.4f})" if champion is not None else "."),
        "",
        f"**MLflow run:** {tracking.run_link(result['run_id'], result['tracking_uri'])}",
        "",
        "## Samples",
        *[f"- `{p}` → `{(p + c)[:160]}`".replace("\n", "⏎") for p, c in ev.get("samples", [])],
    ]
    create_markdown_artifact("\n".join(lines), key="pretrain-summary", description="Pretraining run summary")
