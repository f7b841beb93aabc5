"""What a `pretrain` run returns, and the summary it prints: bits per byte first, then where things are."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from tasks.home import describe_locations
from tasks.refs import (
    CheckpointRef,
    DatasetRef,
    EvalResult,
    ModelRef,
    ParentRef,
    RegisteredModel,
    TokenizerRef,
)
from tasks.tracking import store
from tasks.training.budget import BudgetPlan, format_duration


class PretrainResult(BaseModel):
    run_id: str
    model_uri: str | None = Field(description="The registered version (None: the run was not registered)")
    registered: RegisteredModel | None
    evaluation: EvalResult
    checkpoint: CheckpointRef
    tokenizer: TokenizerRef
    dataset: DatasetRef
    metrics: dict[str, float]
    tracking_uri: str = Field(description="The MLflow store, credentials redacted")
    model: ModelRef | None = Field(None, description="The initial weights (from the parent with init_from)")
    parent: ParentRef | None = Field(None, description="The model this run started from (init_from)")
    started_at: float | None = Field(None, description="Unix time the flow started")
    shape: str | None = Field(None, description="The model and batch shape that trained, and why")
    plan: BudgetPlan | None = Field(None, description="The time budget's plan (None: a fixed run length)")


def summary_lines(
    *,
    bits_per_byte: float,
    xz_bits_per_byte: float,
    val_loss: float,
    initial_bits_per_byte: float | None = None,
    initial_val_loss: float | None = None,
) -> list[str]:
    """The headline: bits per byte against xz on the same text, then the loss per token."""
    relative = 1 - bits_per_byte / xz_bits_per_byte
    versus = f"{relative:.0%} below xz" if relative >= 0 else f"{-relative:.0%} above xz"
    first = f"validation: {bits_per_byte:.3f} bits per byte (xz -9e: {xz_bits_per_byte:.3f}), {versus}"
    if initial_bits_per_byte is not None:
        first += f"; {initial_bits_per_byte:.3f} before training"
    loss = f"{val_loss:.3f} nats/token"
    if initial_val_loss is not None:
        loss = f"{initial_val_loss:.3f} before training → {loss}"
    return [first, f"validation loss: {loss}"]


def lineage_lines(result: PretrainResult) -> list[str]:
    """Where the run started, and whether it improved on its parent and on the champion (both scored on
    this run's validation text)."""
    parent, reg, ours = result.parent, result.registered, result.evaluation.bits_per_byte
    if parent is None:
        return []
    lines = [f"started from: {parent.pinned} (init_from={parent.source!r}), lineage depth {parent.depth + 1}"]
    before = result.evaluation.initial_bits_per_byte
    if before is not None:
        verdict = "improved on" if ours < before else "did NOT improve on"
        lines.append(f"vs parent:   {verdict} its parent: {before:.3f} → {ours:.3f} bits per byte")
    if reg is not None and reg.champion_bits_per_byte is not None:
        verdict = "better than" if ours < reg.champion_bits_per_byte else "NOT better than"
        lines.append(
            f"vs champion: {verdict} the champion (version {reg.champion_version}): "
            f"{reg.champion_bits_per_byte:.3f} vs {ours:.3f} bits per byte"
        )
    return lines


def timing_lines(result: PretrainResult, now: float) -> list[str]:
    """How long the flow took, against its budget and the plan's expected end when it had one."""
    if result.started_at is None:
        return []
    took = f"wall clock: {format_duration(now - result.started_at)} from the start to this summary"
    plan = result.plan
    if plan is None:
        return [took]
    verdict = "within" if now - plan.started_at <= plan.budget_s else "OVER"
    expected = time.strftime("%H:%M:%S UTC", time.gmtime(plan.end_at))
    return [
        f"{took}, {verdict} its time budget of {format_duration(plan.budget_s)} (the plan expected "
        f"{format_duration(plan.end_at - plan.started_at)}, to end at {expected})"
    ]


def print_summary(result: PretrainResult) -> None:
    ev = result.evaluation
    lines = ["", "=" * 72]
    lines += summary_lines(
        bits_per_byte=ev.bits_per_byte,
        xz_bits_per_byte=ev.xz_bits_per_byte,
        val_loss=ev.val_loss,
        initial_bits_per_byte=ev.initial_bits_per_byte,
        initial_val_loss=ev.initial_val_loss,
    )
    lines.append(
        f"perplexity: {ev.perplexity:.1f}   steps: {result.checkpoint.step}   "
        f"tokens/s: {result.metrics.get('tokens_per_s', float('nan')):,.0f}   "
        f"scored: {ev.scored_bytes:,} bytes of validation text"
    )
    if result.shape:
        lines.append(f"shape: {result.shape}")
    if result.checkpoint.run_length:
        lines.append(f"run length: {result.checkpoint.run_length}")
    lines += timing_lines(result, time.time())
    reg = result.registered
    if reg is None:
        lines.append(
            "registered: nothing (register_version: false); the run's checkpoints are logged models of it"
        )
    else:
        verdict = "now holds" if reg.promoted else "stays with the previous version; not moved to"
        versus = (
            f", champion had {reg.champion_bits_per_byte:.3f} bits per byte"
            if reg.champion_bits_per_byte
            else ""
        )
        lines.append(f"registered: {result.model_uri}  ({verdict} @{reg.alias}{versus})")
    lines += lineage_lines(result)
    for prompt, completion in ev.samples[:2]:
        lines.append(f"sample: {prompt!r} → {(prompt + completion)[:120]!r}")
    lines.append(f"look next: {store.run_link(result.run_id)}")
    lines.append(f"stored:    {describe_locations()}")
    if reg is not None:
        lines.append(f"load it:   mlflow.pyfunc.load_model('models:/{reg.name}@{reg.alias}')")
    lines.append("=" * 72)
    print("\n".join(lines))
