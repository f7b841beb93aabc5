"""The training engine: plain PyTorch (no Prefect, no MLflow), runnable in-process or by torchrun workers."""

from tasks.training.engine import TrainingError, TrainingInterrupted
from tasks.training.launch import train
from tasks.training.metrics import MetricSink, read_metrics
from tasks.training.schedule import lr_at, total_optimizer_steps
from tasks.training.settings import TrainSettings

__all__ = [
    "MetricSink",
    "TrainSettings",
    "TrainingError",
    "TrainingInterrupted",
    "lr_at",
    "read_metrics",
    "total_optimizer_steps",
    "train",
]
