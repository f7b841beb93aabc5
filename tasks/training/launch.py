"""`train`: in this process for one device, or a `torchrun` job for `nproc_per_node > 1`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.settings import PROJECT_ROOT
from tasks.training.engine import TrainingError, TrainingInterrupted, run_training, validate_inputs
from tasks.training.metrics import METRICS_FILE, MetricSink, tail_metrics
from tasks.training.settings import TrainSettings

SPEC_FILE = "worker_spec.json"
RESULT_FILE = "worker_result.json"


def train(
    model_ref: ModelRef,
    dataset_ref: DatasetRef,
    settings: TrainSettings,
    sink: MetricSink | None = None,
    *,
    progress: bool = True,
    should_stop: Callable[[], bool] | None = None,
) -> CheckpointRef:
    """Train from `model_ref`'s initial weights on `dataset_ref`'s train split; return the final checkpoint.

    Resumes from the newest valid checkpoint in `settings.checkpoint_dir`; returns at once when that
    checkpoint already finished the run. Metrics of each logged optimizer step go to `sink` and to
    `<checkpoint_dir>/metrics.jsonl`. Raises TrainingError (non-finite loss, bad input, failed workers) and
    TrainingInterrupted (SIGINT/SIGTERM or `should_stop()` returned True, after a checkpoint).
    """
    if settings.nproc_per_node == 1:
        return run_training(
            model_ref, dataset_ref, settings, sink, progress=progress, should_stop=should_stop
        )
    return _train_with_torchrun(
        model_ref, dataset_ref, settings, sink, progress=progress, should_stop=should_stop
    )


def _train_with_torchrun(
    model_ref: ModelRef,
    dataset_ref: DatasetRef,
    settings: TrainSettings,
    sink: MetricSink | None,
    *,
    progress: bool,
    should_stop: Callable[[], bool] | None,
) -> CheckpointRef:
    validate_inputs(model_ref, dataset_ref, settings)  # fail here, not in N workers after their start-up
    run_dir = Path(settings.checkpoint_dir).resolve()
    spec_path = write_worker_spec(model_ref, dataset_ref, settings, progress=progress)
    result_path = run_dir / RESULT_FILE
    result_path.unlink(missing_ok=True)
    metrics_path = run_dir / METRICS_FILE
    offset = metrics_path.stat().st_size if metrics_path.exists() else 0

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={settings.nproc_per_node}",
        "-m",
        "tasks.training.worker",
        str(spec_path),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    # Output is inherited (streamed as it comes); metrics arrive through metrics.jsonl.
    process = subprocess.Popen(command, env=env, cwd=PROJECT_ROOT, start_new_session=True)
    stop_sent = False
    try:
        while process.poll() is None:
            offset = _forward(metrics_path, offset, sink)
            if should_stop is not None and not stop_sent and should_stop():
                process.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker once
                stop_sent = True
            time.sleep(0.2)
    except BaseException:
        # Ctrl-C here: let the workers checkpoint and stop, then re-raise.
        _stop(process)
        raise
    _forward(metrics_path, offset, sink)
    if stop_sent:
        raise TrainingInterrupted(
            f"training stopped by a stop request (torchrun exit code {process.returncode}); rerun with the same "
            f"checkpoint_dir ({run_dir}) to resume from its newest checkpoint"
        )
    if process.returncode != 0 or not result_path.is_file():
        raise TrainingError(
            f"torchrun with {settings.nproc_per_node} workers failed (exit code {process.returncode}); see the "
            f"workers' output above. Rerun with the same checkpoint_dir ({run_dir}) to resume"
        )
    return CheckpointRef.model_validate_json(result_path.read_text())


def _stop(process: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGTERM to torchrun (never to the whole group: workers would get it twice and skip the checkpoint),
    then SIGKILL to the group if it is still there after `grace_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def write_worker_spec(
    model_ref: ModelRef, dataset_ref: DatasetRef, settings: TrainSettings, *, progress: bool = False
) -> Path:
    """Write `<checkpoint_dir>/worker_spec.json` for `python -m tasks.training.worker`; its result lands in
    `<checkpoint_dir>/worker_result.json`."""
    run_dir = Path(settings.checkpoint_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model_ref": model_ref.model_dump(mode="json"),
        "dataset_ref": dataset_ref.model_dump(mode="json"),
        "settings": settings.model_dump(mode="json"),
        "progress": progress,
        "result_path": str(run_dir / RESULT_FILE),
    }
    spec_path = run_dir / SPEC_FILE
    spec_path.write_text(json.dumps(spec, indent=2))
    return spec_path


def _forward(metrics_path: Path, offset: int, sink: MetricSink | None) -> int:
    records, offset = tail_metrics(metrics_path, offset)
    if sink is not None:
        for step, metrics in records:
            sink.log_metrics(metrics, step)
    return offset
