"""Sweeps: search PretrainConfig values with Optuna, every trial a real `pretrain` run.

spec (what is searched) → study (Optuna's storage, ownership of trials) → trials (each a pretrain run, local or
on the pool) → report (MLflow parent run, confirmation, the recommendation); flow composes them.
"""

from flows.sweep.cli import main
from flows.sweep.flow import sweep

__all__ = ["main", "sweep"]
