"""What a finished run leaves for people: evaluation metrics, the loss/LR figure and the samples table in
MLflow, and a summary artifact in Prefect."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any

from mlflow.entities import Metric
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext

from tasks.refs import CheckpointRef, EvalResult
from tasks.tracking.store import get_client, run_link
from tasks.training.metrics import read_metrics


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
    get_client().log_batch(run_id, metrics=metrics)
    if evaluation.samples:
        log_samples(run_id, evaluation.samples)
    history = read_metrics(checkpoint.run_dir)
    if history:
        figure = training_curves_figure(history, val_loss=(checkpoint.step, evaluation.val_loss))
        get_client().log_figure(run_id, figure, "loss_curve.png")


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
        f"**MLflow run:** {run_link(result['run_id'], result['tracking_uri'])}",
        "",
        "## Samples",
        *[f"- `{p}` → `{(p + c)[:160]}`".replace("\n", "⏎") for p, c in ev.get("samples", [])],
    ]
    create_markdown_artifact("\n".join(lines), key="pretrain-summary", description="Pretraining run summary")


def training_curves_figure(
    history: Mapping[int, Mapping[str, float]], val_loss: tuple[int, float] | None = None
) -> Any:
    """Training loss (and the final validation loss) and the learning rate against the optimizer step.

    `history` is the engine's per-step metrics (`tasks.training.metrics.read_metrics`).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    steps = [s for s in sorted(history) if "train/loss" in history[s]]
    if not steps:
        raise ValueError("the metrics history holds no train/loss: nothing to plot")
    figure = Figure(figsize=(10, 4))
    ax_loss, ax_lr = figure.subplots(1, 2)
    ax_loss.plot(steps, [history[s]["train/loss"] for s in steps], label="train loss")
    if val_loss is not None:
        ax_loss.plot([val_loss[0]], [val_loss[1]], "o", label="val loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    lr_steps = [s for s in steps if "train/lr" in history[s]]
    ax_lr.plot(lr_steps, [history[s]["train/lr"] for s in lr_steps], color="tab:green")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def log_samples(
    run_id: str, samples: tuple[tuple[str, str], ...], artifact_file: str = "samples.json"
) -> str:
    """Log (prompt, completion) pairs as an MLflow table artifact (shown in the UI's evaluation view)."""
    if not samples:
        raise ValueError("No samples to log; pass at least one (prompt, completion) pair.")
    data = {"prompt": [p for p, _ in samples], "completion": [c for _, c in samples]}
    with warnings.catch_warnings():
        # MLflow's own select_dtypes(include=["object"]) call warns under pandas 3.
        warnings.filterwarnings("ignore", message=".*'str' dtypes are included by select_dtypes")
        get_client().log_table(run_id, data=data, artifact_file=artifact_file)
    return artifact_file
