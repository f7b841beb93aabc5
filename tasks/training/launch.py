"""`fit`, the engine's entry: trains in this process for one device, or as a `torchrun` job for
`nproc_per_node > 1` (each rank runs `tasks.training.worker`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from model.atomic import write_text_atomic
from tasks.home import HOME_ENV, MLRUNS_ENV, PROJECT_ROOT, home, mlruns_dir
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training.engine import run_process, validate_inputs
from tasks.training.errors import TrainingError, TrainingInterrupted
from tasks.training.metrics import METRICS_FILE, MetricSink, tail_metrics
from tasks.training.openmp import openmp_env
from tasks.training.settings import TrainSettings

SPEC_FILE = "torchrun_spec.json"
RESULT_FILE = "torchrun_result.json"


class WorkerSpec(BaseModel):
    """What every torchrun rank is given (as `torchrun_spec.json` in the run directory)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_ref: ModelRef
    dataset_ref: DatasetRef
    settings: TrainSettings
    run_dir: str
    progress: bool


def fit(
    model_ref: ModelRef,
    dataset_ref: DatasetRef,
    settings: TrainSettings,
    run_dir: str | Path,
    sink: MetricSink | None = None,
    *,
    progress: bool = True,
    should_stop: Callable[[], bool] | None = None,
) -> CheckpointRef:
    """Train from `model_ref`'s initial weights on `dataset_ref`'s train split; return the final checkpoint.

    Resumes from the newest valid checkpoint in `run_dir`; returns at once when that checkpoint already
    finished the run. Metrics of each logged optimizer step go to `sink` and to `<run_dir>/metrics.jsonl`.
    Raises TrainingError (non-finite loss, bad input, failed workers) and TrainingInterrupted (SIGINT/SIGTERM or `should_stop()` returned True, after a checkpoint).
    """
    if settings.nproc_per_node == 1:
        return run_process(
            model_ref, dataset_ref, settings, run_dir, sink, progress=progress, should_stop=should_stop
        )
    return _fit_with_torchrun(
        model_ref, dataset_ref, settings, Path(run_dir), sink, progress=progress, should_stop=should_stop
    )


def _fit_with_torchrun(
    model_ref: ModelRef,
    dataset_ref: DatasetRef,
    settings: TrainSettings,
    run_dir: Path,
    sink: MetricSink | None,
    *,
    progress: bool,
    should_stop: Callable[[], bool] | None,
) -> CheckpointRef:
    validate_inputs(model_ref, dataset_ref, settings)  # fail here, not in N workers after their start-up
    run_dir = run_dir.resolve()
    spec_path = write_worker_spec(
        WorkerSpec(
            model_ref=model_ref,
            dataset_ref=dataset_ref,
            settings=settings,
            run_dir=str(run_dir),
            progress=progress,
        )
    )
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
    env.update(openmp_env(env))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    env[HOME_ENV], env[MLRUNS_ENV] = str(home()), str(mlruns_dir())  # the ranks see this process's places
    # Output is inherited (streamed as it comes); metrics arrive through metrics.jsonl.
    process = subprocess.Popen(command, env=env, start_new_session=True)
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


def write_worker_spec(spec: WorkerSpec) -> Path:
    """Write `<run_dir>/torchrun_spec.json` for `python -m tasks.training.worker`; the main rank writes its
    result to `<run_dir>/torchrun_result.json`."""
    run_dir = Path(spec.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(run_dir / SPEC_FILE, spec.model_dump_json(indent=2))


def _forward(metrics_path: Path, offset: int, sink: MetricSink | None) -> int:
    records, offset = tail_metrics(metrics_path, offset)
    if sink is not None:
        for step, metrics in records:
            sink.log_metrics(metrics, step)
    return offset
