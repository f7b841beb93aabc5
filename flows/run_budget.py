"""The flow's side of a time budget: what it tells the engine about the time outside training (when the
budget started, what follows training), and the plan the engine made, read back from the final checkpoint."""

from __future__ import annotations

from pathlib import Path

from flows.pretrain_config import PretrainConfig
from tasks.refs import CheckpointRef, DatasetRef
from tasks.training.budget import BudgetPlan, BudgetTerms
from tasks.training.checkpoint import load_trainer_state

# After training, besides scoring: samples, xz on the scored text, logging the checkpoints as models,
# registration and the summary (~12 s on a 2-core host, tasks.evaluate and tasks.register), with room.
AFTER_FIXED_S = 20.0
SAMPLE_TOKEN_S = 0.02  # one generated token of a sample (a decode step; small models, CPU)


def budget_terms(config: PretrainConfig, dataset: DatasetRef, started_at: float) -> BudgetTerms:
    """The flow's budget from `started_at`, and an estimate of what follows training: the final evaluation
    scores the validation text with the initial weights, the final ones and each earlier kept checkpoint."""
    blocks = (
        dataset.val_blocks
        if config.eval_max_blocks is None
        else min(config.eval_max_blocks, dataset.val_blocks)
    )
    scorings = 2 + (config.keep_checkpoints - 1 if config.checkpoint_every else 0)
    samples = config.num_samples * config.sample_max_new_tokens
    return BudgetTerms(
        total_s=float(config.time_budget or 0),
        started_at=started_at,
        after_tokens=scorings * blocks * dataset.seq_len,
        after_fixed_s=AFTER_FIXED_S + samples * SAMPLE_TOKEN_S,
    )


def run_plan(checkpoint: CheckpointRef) -> BudgetPlan | None:
    """The budget plan the run trained with (kept in its checkpoints), or None for a run of fixed length."""
    run = load_trainer_state(Path(checkpoint.path)).get("run", {})
    return BudgetPlan.from_dict(run["budget"]) if "budget" in run else None
