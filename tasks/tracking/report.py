"""What a finished run leaves for people: evaluation metrics, the loss/LR figure and the samples table in
MLflow; a link to the MLflow run and a summary artifact in Prefect."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any

from mlflow.entities import Metric

from tasks.refs import CheckpointRef, EvalResult
from tasks.tracking.store import get_client, run_link, run_url
from tasks.training.metrics import read_metrics


def _in_flow_run() -> bool:
    from prefect.runtime import flow_run

    return flow_run.id is not None


def evaluation_metrics(evaluation: EvalResult) -> dict[str, float]:
    values = {
        "val/bits_per_byte": evaluation.bits_per_byte,
        "val/xz_bits_per_byte": evaluation.xz_bits_per_byte,
        "val/loss": evaluation.val_loss,
        "val/perplexity": evaluation.perplexity,
        "val/scored_bytes": float(evaluation.scored_bytes),
        "val/scored_tokens": float(evaluation.scored_tokens),
    }
    if evaluation.initial_val_loss is not None:
        values["val/initial_loss"] = evaluation.initial_val_loss
    if evaluation.initial_bits_per_byte is not None:
        values["val/initial_bits_per_byte"] = evaluation.initial_bits_per_byte
    return values


def log_evaluation(
    run_id: str, evaluation: EvalResult, *, checkpoint: CheckpointRef, uri: str | None = None
) -> None:
    """Validation metrics at the final step (once: a continued run that has them keeps them), the
    samples table, and the loss/LR curve figure."""
    client = get_client(uri)
    have = client.get_run(run_id).data._metric_objs
    logged = {m.key for m in have if m.step == checkpoint.step}
    now = int(time.time() * 1000)
    metrics = [
        Metric(key, float(v), now, checkpoint.step)
        for key, v in evaluation_metrics(evaluation).items()
        if key not in logged
    ]
    if metrics:
        client.log_batch(run_id, metrics=metrics)
    if evaluation.samples:
        log_samples(run_id, evaluation.samples, uri=uri)
    history = read_metrics(checkpoint.run_dir)
    if history:
        figure = training_curves_figure(history, val_loss=(checkpoint.step, evaluation.val_loss))
        client.log_figure(run_id, figure, "loss_curve.png")


def link_mlflow_run(run_id: str, uri: str | None = None) -> None:
    """A link artifact from the Prefect flow run to its MLflow run (nothing outside a flow run)."""
    if not _in_flow_run():
        return
    from prefect.artifacts import create_link_artifact

    create_link_artifact(
        link=run_url(run_id, uri),
        link_text=f"MLflow run {run_id}",
        key="mlflow-run",
        description=f"The MLflow run of this flow run. {run_link(run_id, uri)}",
    )


def publish_summary(result: dict[str, Any]) -> None:
    """A markdown artifact on the flow run: bits per byte against xz, metrics table, MLflow run, version."""
    if not _in_flow_run():
        return
    ev, reg = result["evaluation"], result["registered"]
    rows = [
        ("bits per byte", f"{ev['bits_per_byte']:.4f}"),
        ("xz -9e, same text", f"{ev['xz_bits_per_byte']:.4f}"),
        ("validation loss (nats/token)", f"{ev['val_loss']:.4f}"),
        ("perplexity", f"{ev['perplexity']:.2f}"),
        ("scored text", f"{ev['scored_bytes']:,} bytes, {ev['scored_tokens']:,} tokens"),
    ]
    if ev.get("initial_bits_per_byte") is not None:
        rows.insert(2, ("bits per byte before training", f"{ev['initial_bits_per_byte']:.4f}"))
    rows += [
        (k, f"{v:.4g}")
        for k, v in sorted(result["metrics"].items())
        if k not in ("val_loss", "val_perplexity", "bits_per_byte", "xz_bits_per_byte")
    ]
    if reg is None:
        registered = "**Registered:** nothing (`register_version: false`)."
    else:
        decision = "moved to this version" if reg["promoted"] else "kept by the previous champion"
        champion = reg.get("champion_bits_per_byte")
        registered = f"**Registered:** `{result['model_uri']}`; alias `@{reg['alias']}` {decision}" + (
            f" (previous champion: {champion:.4f} bits per byte on the same text)"
            if champion is not None
            else "."
        )
    lines = [
        f"# Pretraining run `{result['run_id']}`",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        registered,
        "",
        f"**MLflow run:** {run_link(result['run_id'])}",
        "",
        "## Samples",
        *[f"- `{p}` → `{(p + c)[:160]}`".replace("\n", "⏎") for p, c in ev.get("samples", [])],
    ]
    from prefect.artifacts import create_markdown_artifact

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
    run_id: str,
    samples: tuple[tuple[str, str], ...],
    artifact_file: str = "samples.json",
    uri: str | None = None,
) -> str:
    """Log (prompt, completion) pairs as an MLflow table artifact (shown in the UI's evaluation view)."""
    if not samples:
        raise ValueError("No samples to log; pass at least one (prompt, completion) pair.")
    data = {"prompt": [p for p, _ in samples], "completion": [c for _, c in samples]}
    with warnings.catch_warnings():
        # MLflow's own select_dtypes(include=["object"]) call warns under pandas 3.
        warnings.filterwarnings("ignore", message=".*'str' dtypes are included by select_dtypes")
        get_client(uri).log_table(run_id, data=data, artifact_file=artifact_file)
    return artifact_file
