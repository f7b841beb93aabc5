"""One process's training, set up: inputs checked, resume found, the model loaded into the plain (or
sharded) module, parallelized and compiled (`tasks.training.parallelize`), the optimizer built from the
result, the loader built, and the loop (`tasks.training.loop`) run. A single device, or one rank of a
torchrun job."""

from __future__ import annotations

import dataclasses
import functools
import random
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import LlamaConfig
from tasks.data.packed import open_blocks, read_meta
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training import checkpoint as ckpt
from tasks.training.budget import BudgetPlan, BudgetTerms
from tasks.training.calibrate import measure_and_plan
from tasks.training.distributed import DistContext, resolve_device
from tasks.training.errors import TrainingInputError
from tasks.training.loader import BlockLoader
from tasks.training.loop import TrainLoop, checkpoint_ref
from tasks.training.metrics import JsonlMetrics, MetricSink
from tasks.training.optim import build_optimizer
from tasks.training.optimizer_state import load_optimizer_state, load_parent_optimizer_state
from tasks.training.parallelize import Parallel, parallel_mode, parallelize
from tasks.training.periodic_eval import PeriodicEval
from tasks.training.precision import precision_recipe, resolve_dtype
from tasks.training.resume import RunShape, check_resume, find_resume
from tasks.training.schedule import describe_run_length, total_optimizer_steps
from tasks.training.settings import TrainSettings


def _seed_rank(seed: int, rank: int) -> None:
    """Each rank its own generators (dropout or sampling would differ per rank), reproducible from the seed."""
    rank_seed = int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)


def _configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        # Two identical compiled CPU runs drifted apart (around step 14) without it; exact resume depends on it.
        torch.use_deterministic_algorithms(True)


@contextmanager
def _backend_flags_restored() -> Iterator[None]:
    """Give back the process-wide flags `_configure_backends` sets: whatever runs after training in this
    process (evaluation in the flow, a notebook) gets its own settings, not the trainer's."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _restores_backend_flags(function: Callable[..., CheckpointRef]) -> Callable[..., CheckpointRef]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> CheckpointRef:
        with _backend_flags_restored():
            return function(*args, **kwargs)

    return wrapper


def validate_inputs(
    model_ref: ModelRef, dataset_ref: DatasetRef, settings: TrainSettings
) -> tuple[LlamaConfig, dict]:
    """The model config and dataset meta, after checking that they fit together (cheap, before any work)."""
    model_dir = Path(model_ref.path)
    for name in ("config.json", "model.safetensors"):
        if not (model_dir / name).is_file():
            raise TrainingInputError(
                f"{model_dir / name} is missing: build the ModelRef with config.json + model.safetensors"
            )
    config = LlamaConfig.from_dict(ckpt.read_json(model_dir / "config.json"))
    meta = read_meta(dataset_ref.path)
    if meta["vocab_size"] > config.vocab_size:
        raise TrainingInputError(
            f"dataset vocab_size {meta['vocab_size']} exceeds the model's vocab_size {config.vocab_size}: "
            "build the model with vocab_size >= the tokenizer's"
        )
    if meta["seq_len"] > config.max_position_embeddings:
        raise TrainingInputError(
            f"dataset seq_len {meta['seq_len']} exceeds max_position_embeddings {config.max_position_embeddings}: "
            "use a shorter seq_len or a model with more positions"
        )
    if settings.document_mask and meta.get("eos_id") is None:
        raise TrainingInputError(
            f"document_mask needs the dataset's EOS id, and {dataset_ref.path}/meta.json has none: rebuild the "
            "dataset with a tokenizer that has an EOS token, or train without document_mask"
        )
    return config, meta


@dataclass(frozen=True)
class _RunPlan:
    blocks: np.ndarray  # the train split's packed blocks
    shape: RunShape  # total_steps 0 while a time budget has not planned it yet
    length: str  # the run's length in words, for metrics and warnings
    budget: BudgetPlan | None = None

    @property
    def total_steps(self) -> int:
        return self.shape.total_steps


def _settle_device(settings: TrainSettings, dist: DistContext) -> tuple[torch.device, TrainSettings]:
    """The rank's device, and the settings with the run's precision concrete (bf16 or fp32), as its
    checkpoints and metrics record it."""
    device = resolve_device(settings.device, dist.local_rank)
    settings = settings.model_copy(update={"dtype": resolve_dtype(device, settings.dtype)})
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the first NCCL collective (the resume broadcast)
    return device, settings


def _open_run_dir(run_dir: str | Path, dist: DistContext) -> Path:
    run_dir = Path(run_dir).resolve()
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return run_dir


def _plan_run(
    dataset_ref: DatasetRef,
    meta: dict[str, Any],
    settings: TrainSettings,
    dist: DistContext,
    device: torch.device,
) -> _RunPlan:
    blocks = open_blocks(dataset_ref.path, "train")
    if settings.budget_seconds is not None:
        total_optimizer_steps(len(blocks), 1, 1, 1, 1.0, 1)  # its check of an empty split
        shape = _shape(0, settings, dist, meta, dataset_ref, device)
        return _RunPlan(blocks=blocks, shape=shape, length="planned by time_budget")
    total_steps = total_optimizer_steps(
        len(blocks),
        settings.micro_batch_size,
        settings.accumulate_steps,
        dist.world_size,
        settings.epochs,
        settings.max_steps,
    )
    shape = _shape(total_steps, settings, dist, meta, dataset_ref, device)
    length = describe_run_length(
        total_steps,
        max_steps=settings.max_steps,
        epochs=settings.epochs,
        n_blocks=len(blocks),
        global_batch=shape.global_batch,
    )
    if settings.warmup_steps > total_steps:
        warnings.warn(
            f"warmup_steps={settings.warmup_steps} is longer than the run ({length}): the learning rate "
            "never reaches its peak",
            RuntimeWarning,
            stacklevel=3,
        )
    return _RunPlan(blocks=blocks, shape=shape, length=length)


def _shape(
    total_steps: int,
    settings: TrainSettings,
    dist: DistContext,
    meta: dict[str, Any],
    dataset_ref: DatasetRef,
    device: torch.device,
) -> RunShape:
    return RunShape(
        total_steps=total_steps,
        micro_batch_size=settings.micro_batch_size,
        accumulate_steps=settings.accumulate_steps,
        world_size=dist.world_size,
        dataset_fingerprint=str(meta.get("fingerprint", dataset_ref.fingerprint)),
        precision=precision_recipe(parallel_mode(settings), device.type, settings.dtype),
    )


def _planned(plan: _RunPlan, settings: TrainSettings, budget: BudgetPlan) -> _RunPlan:
    """`plan` with the length `budget` decided."""
    length = describe_run_length(
        budget.steps,
        max_steps=None,
        epochs=settings.epochs,
        n_blocks=len(plan.blocks),
        global_batch=plan.shape.global_batch,
        budget=budget.describe(),
    )
    shape = dataclasses.replace(plan.shape, total_steps=budget.steps)
    return dataclasses.replace(plan, shape=shape, length=length, budget=budget)


def _kept_plan(plan: _RunPlan, state: dict[str, Any] | None) -> _RunPlan:
    """A budgeted run that resumes keeps the length its checkpoint was planned with: it never re-plans."""
    if state is None or plan.budget is not None or plan.shape.total_steps:
        return plan
    run = state.get("run", {})
    shape = dataclasses.replace(plan.shape, total_steps=int(state["total_steps"]))
    budget = BudgetPlan.from_dict(run["budget"]) if "budget" in run else None
    return dataclasses.replace(plan, shape=shape, length=str(run.get("length", "")), budget=budget)


def _resume_point(
    run_dir: Path, settings: TrainSettings, plan: _RunPlan, config: LlamaConfig, dist: DistContext
) -> tuple[Path | None, dict[str, Any] | None, _RunPlan]:
    """The checkpoint this run resumes from and its trainer state, checked against the run (or none), and
    the run's plan (a budgeted one's length is its checkpoint's)."""
    resume = find_resume(run_dir, dist)
    if resume is None:
        return None, None, plan
    state = ckpt.load_trainer_state(resume)
    plan = _kept_plan(plan, state)
    check_resume(resume, state, settings, plan.shape, config)
    if dist.is_main:
        print(
            f"[llamaflow] resuming from checkpoint {resume} at step {state['step']}/{plan.total_steps}",
            flush=True,
        )
        JsonlMetrics(run_dir).log_event(resumed_from=str(resume), step=int(state["step"]))
    return resume, state, plan


def _restore_state(
    resume: Path,
    state: dict[str, Any],
    parallel: Parallel,
    optimizer: torch.optim.Optimizer,
    loader: BlockLoader,
    dist: DistContext,
    device: torch.device,
) -> tuple[int, int]:
    """Optimizer, loader and this rank's generators as the checkpoint left them: (step, tokens seen)."""
    load_optimizer_state(resume, parallel.plain, optimizer)
    loader.load_state_dict(state["loader"])
    rng_state = ckpt.load_rng_state(resume, dist.rank)
    if rng_state is not None:
        ckpt.restore_rng_state(rng_state, device)
    else:
        print(
            f"[llamaflow] rank {dist.rank}: {resume} holds no RNG state of this rank (written by fewer "
            "ranks); it continues with fresh generators from the seed",
            flush=True,
        )
    return state["step"], state["tokens_seen"]


@_restores_backend_flags
def run_process(
    model_ref: ModelRef,
    dataset_ref: DatasetRef,
    settings: TrainSettings,
    run_dir: str | Path,
    sink: MetricSink | None = None,
    *,
    progress: bool = True,
    dist: DistContext | None = None,
    should_stop: Callable[[], bool] | None = None,
    budget: BudgetTerms | None = None,
) -> CheckpointRef:
    """`budget`: what the caller knows of the time outside training, for a `time_budget` run (by default
    the budget starts now and covers training alone)."""
    dist = dist or DistContext()
    started = time.time()
    config, meta = validate_inputs(model_ref, dataset_ref, settings)
    device, settings = _settle_device(settings, dist)
    run_dir = _open_run_dir(run_dir, dist)
    plan = _plan_run(dataset_ref, meta, settings, dist, device)
    resume, state, plan = _resume_point(run_dir, settings, plan, config, dist)
    if resume is not None and state is not None and state["step"] >= plan.total_steps:
        return checkpoint_ref(resume, run_dir, state)

    _configure_backends(device)
    _seed_rank(settings.seed, dist.rank)
    # The weights (initial, or the checkpoint's) go into the plain or sharded module before compilation.
    parallel = parallelize(
        config,
        resume or Path(model_ref.path),
        settings,
        device,
        eos_id=meta["eos_id"] if settings.document_mask else None,
    )
    optimizer = build_optimizer(parallel.plain, settings, device)  # from the parameters as they train
    loader = BlockLoader(
        plan.blocks,
        pad_id=meta["pad_id"],
        micro_batch_size=settings.micro_batch_size,
        accumulate_steps=settings.accumulate_steps,
        seed=settings.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        device=device,
    )
    step, tokens_seen = 0, 0
    if resume is not None and state is not None:
        step, tokens_seen = _restore_state(resume, state, parallel, optimizer, loader, dist, device)
    elif model_ref.optimizer_state is not None:  # a new run that starts with its parent's optimizer state
        load_parent_optimizer_state(Path(model_ref.optimizer_state), parallel.plain, optimizer)

    new_loop = functools.partial(
        TrainLoop,
        parallel=parallel,
        optimizer=optimizer,
        loader=loader,
        settings=settings,
        dist=dist,
        device=device,
        run_dir=run_dir,
        step=step,
        tokens_seen=tokens_seen,
        config=config,
        seq_len=meta["seq_len"],
        sink=sink,
        progress=progress,
        should_stop=should_stop,
        last_checkpoint=resume,
        periodic_eval=PeriodicEval.from_settings(dataset_ref, settings, device),
    )
    if settings.budget_seconds is not None and plan.budget is None and not plan.total_steps:
        terms = budget or BudgetTerms(total_s=settings.budget_seconds, started_at=started)
        calibration = new_loop(total_steps=1 << 30, progress=False, sink=None)
        plan = _planned(plan, settings, measure_and_plan(calibration, plan.blocks, terms, dist))
    if dist.is_main:
        print(f"[llamaflow] plan: {plan.length}", flush=True)
    loop = new_loop(
        total_steps=plan.total_steps,
        run_facts={
            **plan.shape.to_dict(),
            "length": plan.length,
            **({"budget": plan.budget.to_dict()} if plan.budget else {}),
        },
        first_metrics=plan.budget.metrics() if plan.budget and resume is None else {},
    )
    return loop.run()
