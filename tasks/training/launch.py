"""`fit`, the engine's entry: trains in this process for one device, or as a `torchrun` job (each rank runs
`tasks.training.rank`) for several processes, several nodes or restarts (`tasks.training.rendezvous`).

Either way the run directory is locked for the job's whole life (`tasks.training.run_lock`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from model.atomic import write_text_atomic
from tasks.home import HOME_ENV, MLRUNS_ENV, child_pythonpath, home, mlruns_dir
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training import rendezvous, storage
from tasks.training.budget import BudgetTerms
from tasks.training.engine import run_process, validate_inputs
from tasks.training.errors import TrainingError, TrainingInputError, TrainingInterrupted
from tasks.training.faults import FaultInjector
from tasks.training.metrics import METRICS_FILE, MetricSink, tail_metrics
from tasks.training.openmp import openmp_env
from tasks.training.run_lock import hold_run_dir
from tasks.training.settings import TrainSettings

SPEC_FILE = "torchrun_spec.json"
RESULT_FILE = "torchrun_result.json"
# How long a node whose torchrun succeeded waits to see rank 0's result (NFS caches a missing file ~60 s).
RESULT_WAIT_S = 90.0


class WorkerSpec(BaseModel):
    """What every torchrun rank is given (as `torchrun_spec.json` in the run directory)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_ref: ModelRef
    dataset_ref: DatasetRef
    settings: TrainSettings
    run_dir: str
    progress: bool
    budget: BudgetTerms | None = None


def fit(
    model_ref: ModelRef,
    dataset_ref: DatasetRef,
    settings: TrainSettings,
    run_dir: str | Path,
    sink: MetricSink | None = None,
    *,
    progress: bool = True,
    should_stop: Callable[[], bool] | None = None,
    budget: BudgetTerms | None = None,
) -> CheckpointRef:
    """Train from `model_ref`'s initial weights on `dataset_ref`'s train split; return the final checkpoint.

    Resumes from the newest valid checkpoint in `run_dir`; returns at once when that checkpoint already
    finished the run. Metrics of each logged optimizer step go to `sink` and to `<run_dir>/metrics.jsonl`.
    Raises TrainingError (non-finite loss, bad input, failed workers), TrainingInterrupted (SIGINT/SIGTERM or
    `should_stop()` returned True, after a checkpoint) and RunDirectoryBusy (another job holds `run_dir` for
    longer than `stop_grace_s`; see tasks/training/run_lock.py).
    With `settings.time_budget`, `budget` says when the budget started and what follows training (the
    flow's evaluation); without it the budget starts with training and covers it alone.
    """
    run_dir = storage.local_run_dir(run_dir)  # a store URL's node-local mirror (storage.py)
    # Cheap checks first: bad input fails before the run directory exists, not in N workers after start-up.
    check_launch(settings)
    validate_inputs(model_ref, dataset_ref, settings)
    with hold_run_dir(
        run_dir,
        rendezvous.lock_identity(settings, run_dir),
        shared_by_job=settings.nnodes > 1,
        wait_s=settings.stop_grace_s,  # a stopping predecessor (a retry racing it) is done by then
    ) as lock:
        storage.pull_newest(run_dir)
        if not rendezvous.uses_torchrun(settings):
            return run_process(
                model_ref,
                dataset_ref,
                settings,
                run_dir,
                sink,
                progress=progress,
                should_stop=should_stop,
                budget=budget,
            )
        with rendezvous.served_store(settings), rendezvous.arrival(run_dir, settings):
            return _fit_with_torchrun(
                model_ref,
                dataset_ref,
                settings,
                run_dir,
                sink,
                progress=progress,
                should_stop=should_stop,
                lock_fd=lock.fd,
                budget=budget,
            )


def check_launch(settings: TrainSettings) -> None:
    """What torchrun needs that pydantic cannot check alone."""
    if settings.nnodes > 1 and settings.rdzv_endpoint is None:
        raise TrainingInputError(
            f"nnodes={settings.nnodes} needs rdzv_endpoint (host:port where node 0 hosts the rendezvous: a SLURM "
            "head node, a Kubernetes headless service), the same on every node; with placement='deployment' "
            "the pretrain flow has node 0 publish one"
        )
    if settings.nnodes > 1 and settings.node_rank >= settings.nnodes:
        raise TrainingInputError(
            f"node_rank={settings.node_rank} must be below nnodes={settings.nnodes} (node 0 is the first)"
        )
    if settings.nnodes > 1 and settings.node_rank == 0:
        host, _ = rendezvous.split_endpoint(settings.rdzv_endpoint)
        if not rendezvous.is_this_machine(host):
            raise TrainingInputError(
                f"node 0 hosts the rendezvous store at rdzv_endpoint={settings.rdzv_endpoint}, but {host} is not "
                "this machine: start node 0 (node_rank=0) on the machine that endpoint names, or give the "
                "endpoint of this one; with placement='deployment' leave rdzv_endpoint unset and node 0 "
                "publishes its own"
            )
    rendezvous.local_address(settings)  # a loopback address across machines is refused here


def _fit_with_torchrun(
    model_ref: ModelRef,
    dataset_ref: DatasetRef,
    settings: TrainSettings,
    run_dir: Path,
    sink: MetricSink | None,
    *,
    progress: bool,
    should_stop: Callable[[], bool] | None,
    lock_fd: int | None,
    budget: BudgetTerms | None = None,
) -> CheckpointRef:
    spec_path = write_worker_spec(
        WorkerSpec(
            model_ref=model_ref,
            dataset_ref=dataset_ref,
            settings=settings,
            run_dir=str(run_dir),
            progress=progress,
            budget=budget,
        )
    )
    result_path = run_dir / RESULT_FILE
    result_path.unlink(missing_ok=True)
    forward = MetricsForwarder(run_dir / METRICS_FILE, sink)

    command = rendezvous.torchrun_command(settings, spec_path, run_dir)
    env = dict(os.environ)
    env.update(openmp_env(env))
    env["PYTHONPATH"] = child_pythonpath(env)
    env[HOME_ENV], env[MLRUNS_ENV] = str(home()), str(mlruns_dir())  # the ranks see this process's places
    # Workers get a TCP store of their own per rendezvous round, not the agent's: with the shared one a
    # restarted group reads the dead group's addresses and cannot connect (pytorch issues 135712, 167288).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(rendezvous.transport_env(settings, env))
    FaultInjector(run_dir).before_launch()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="llamaflow-torchrun-") as scratch:
        # torchrun's agent writes the exception it ends with here (a rendezvous timeout, failed workers).
        error_file = Path(scratch) / "agent-error.json"
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        # Output is inherited (streamed as it comes); metrics arrive through metrics.jsonl. torchrun inherits
        # the run directory's lock: it stays held while torchrun lives, even if this process is killed.
        process = subprocess.Popen(
            command, env=env, start_new_session=True, pass_fds=() if lock_fd is None else (lock_fd,)
        )
        stop_sent = False
        try:
            while process.poll() is None:
                forward()
                if should_stop is not None and not stop_sent and should_stop():
                    process.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker once
                    stop_sent = True
                time.sleep(0.2)
        except BaseException:
            # Ctrl-C or a cancellation here: let the workers checkpoint and stop, then re-raise.
            _stop(process, rendezvous.stop_wait_s(settings))
            forward()
            raise
        forward()
        agent_error = rendezvous.read_agent_error(error_file)
    if stop_sent:
        raise TrainingInterrupted(
            f"training stopped by a stop request (torchrun exit code {process.returncode}); rerun with the same "
            f"checkpoint_dir ({run_dir}) to resume from its newest checkpoint"
        )
    result = read_result(result_path, RESULT_WAIT_S) if process.returncode == 0 else None
    input_error = rendezvous.rank_input_error(agent_error) if result is None else None
    if input_error is not None:  # the rank's own words, not "torchrun failed": the user has to act on them
        raise TrainingInputError(input_error)
    if result is None:
        raise TrainingError(
            rendezvous.failure_message(settings, run_dir, agent_error, process.returncode, started)
        )
    return result


def read_result(path: Path, wait_s: float) -> CheckpointRef | None:
    """The result global rank 0 wrote, waiting up to `wait_s` for it to show. Rank 0 may run on another
    node, and an NFS client that looked the file up before it existed (this launcher removed it at start)
    keeps that negative answer cached for up to a minute: listing the directory makes the client ask again."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError):
            os.listdir(path.parent)
        with contextlib.suppress(FileNotFoundError):
            return CheckpointRef.model_validate_json(path.read_text())
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


class MetricsForwarder:
    """Sends the records rank 0 appends to `metrics.jsonl` to `sink`, each step once: after a restart the
    workers resume from the newest checkpoint and log again the steps after it, which the sink already has."""

    def __init__(self, path: Path, sink: MetricSink | None) -> None:
        self.path, self.sink = path, sink
        self.offset = path.stat().st_size if path.exists() else 0  # what earlier runs wrote is not ours
        self.last_step = 0

    def __call__(self) -> None:
        records, self.offset = tail_metrics(self.path, self.offset)
        for step, metrics in records:
            if step <= self.last_step:
                continue
            self.last_step = step
            if self.sink is not None:
                self.sink.log_metrics(metrics, step)


def _stop(process: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM to torchrun (never to the whole group: workers would get it twice and skip the checkpoint),
    then SIGKILL to the group if it is still there after `wait_s` (torchrun's own shutdown timeout, the stop
    grace, comes first)."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def write_worker_spec(spec: WorkerSpec) -> Path:
    """Write `<run_dir>/torchrun_spec.json` for `python -m tasks.training.rank`; the main rank writes its
    result to `<run_dir>/torchrun_result.json`."""
    run_dir = Path(spec.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(run_dir / SPEC_FILE, spec.model_dump_json(indent=2))
