"""The engine's errors: what callers (the train task, its retry condition) tell apart."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """Training cannot go on: bad input, a non-finite loss or gradient, a failed worker."""


class TrainingInterrupted(TrainingError):
    """Stopped by SIGINT/SIGTERM or a stop request, after writing a checkpoint."""


class TrainingInputError(TrainingError):
    """The inputs do not fit: model and dataset, or a checkpoint and the settings it is resumed with."""
