"""The training engine: plain PyTorch (no Prefect, no MLflow), runnable in-process or by torchrun workers.

    ref = fit(model_ref, dataset_ref, TrainSettings(micro_batch_size=8, max_steps=100), run_dir, sink)

A run directory holds `step_000123/` checkpoints (model.safetensors, or model_shards/ under FSDP2: see
`checkpoint_weights`; optimizer/, trainer_state.pt,
config.json, train_settings.json, manifest.json with sha256 of each), `metrics.jsonl` (one line per
logged step; the last line of a step wins), and for torchrun jobs `torchrun_spec.json` /
`torchrun_result.json`. Calling `fit` again with the same directory resumes from the newest valid
checkpoint, or returns at once when that checkpoint finished the run.

One concern per module: `launch` (in-process or torchrun), `worker` (one torchrun rank), `engine` (one
process, set up), `loop` (its optimizer steps), `loader` (batches), `loss`, `optim`, `schedule` (LR and run
length), `checkpoint`, `resume`, `metrics`, `control` (compile watch, stop signals), `distributed`,
`precision`, `settings`, `errors`, `faults` (fault injection for tests).
"""

from tasks.training.errors import TrainingError, TrainingInputError, TrainingInterrupted
from tasks.training.launch import fit
from tasks.training.metrics import MetricSink, read_metrics
from tasks.training.schedule import lr_at, total_optimizer_steps
from tasks.training.settings import TrainSettings

__all__ = [
    "MetricSink",
    "TrainSettings",
    "TrainingError",
    "TrainingInputError",
    "TrainingInterrupted",
    "fit",
    "lr_at",
    "read_metrics",
    "total_optimizer_steps",
]
