"""The training loop of one process (a single device, or one rank of a torchrun job).

Per optimizer step: count the step's target tokens over all micro-batches and ranks, then backward each
micro-batch's summed token loss divided by that global count (DDP averages over ranks, so it is scaled by
world_size). The step's gradient is then exactly that of the mean token loss of the whole step, however
it is split into micro-batches and ranks.
"""

from __future__ import annotations

import math
import random
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from model import LlamaConfig, flops_per_token, load_pretrained
from tasks.data.packed import open_blocks, read_meta
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training import checkpoint as ckpt
from tasks.training.distributed import DistContext, resolve_device
from tasks.training.faults import FaultInjector
from tasks.training.loader import BlockLoader
from tasks.training.metrics import JsonlMetrics, MetricSink, device_peak_flops, peak_memory_mb
from tasks.training.optim import LossHead, build_optimizer, count_targets
from tasks.training.precision import autocast
from tasks.training.schedule import lr_at, total_optimizer_steps
from tasks.training.settings import TrainSettings

# Settings that fix the data order and the schedule: a resumed run must use the same ones.
RESUME_MUST_MATCH = (
    "micro_batch_size",
    "accumulate_steps",
    "nproc_per_node",
    "epochs",
    "max_steps",
    "seed",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "schedule",
    "decay_fraction",
)


class TrainingError(RuntimeError):
    """Training cannot go on: bad input, a non-finite loss or gradient, a failed worker."""


class TrainingInterrupted(TrainingError):
    """Stopped by SIGINT/SIGTERM or a stop request, after writing a checkpoint."""


class _CompileWatch:
    """Counts torch.compile frame compilations (Dynamo start callbacks) to detect recompiles."""

    def __init__(self) -> None:
        self.count = 0

    def _on_start(self, *args: Any, **kwargs: Any) -> None:
        self.count += 1

    @contextmanager
    def watching(self) -> Iterator[_CompileWatch]:
        handler = torch._dynamo.callback_handler
        handler.register_start_callback(self._on_start)
        try:
            yield self
        finally:
            handler.remove_start_callback(self._on_start)


class _StopSignals:
    """SIGINT/SIGTERM set a flag checked after each step (handlers can only be installed in the main thread)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        # The same signal twice (Ctrl-C, Ctrl-C) means: do not wait for the step. A different one is
        # usually a launcher forwarding the first (torchrun turns a terminal's SIGINT into SIGTERM).
        if self.received == name:
            raise KeyboardInterrupt(f"second {name}: stopping without a checkpoint")
        self.received = self.received or name

    @contextmanager
    def installed(self) -> Iterator[_StopSignals]:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        # Two identical compiled CPU runs drifted apart (around step 14) without it; exact resume depends on it.
        torch.use_deterministic_algorithms(True)


def validate_inputs(
    model_ref: ModelRef, dataset_ref: DatasetRef, settings: TrainSettings
) -> tuple[LlamaConfig, dict]:
    """The model config and dataset meta, after checking that they fit together (cheap, before any work)."""
    model_dir = Path(model_ref.path)
    for name in ("config.json", "model.safetensors"):
        if not (model_dir / name).is_file():
            raise TrainingError(
                f"{model_dir / name} is missing: build the ModelRef with config.json + model.safetensors"
            )
    config = LlamaConfig.from_dict(ckpt.read_json(model_dir / "config.json"))
    meta = read_meta(dataset_ref.path)
    if meta["vocab_size"] > config.vocab_size:
        raise TrainingError(
            f"dataset vocab_size {meta['vocab_size']} exceeds the model's vocab_size {config.vocab_size}: "
            "build the model with vocab_size >= the tokenizer's"
        )
    if meta["seq_len"] > config.max_position_embeddings:
        raise TrainingError(
            f"dataset seq_len {meta['seq_len']} exceeds max_position_embeddings {config.max_position_embeddings}: "
            "use a shorter seq_len or a model with more positions"
        )
    return config, meta


def _check_resume_settings(path: Path, settings: TrainSettings) -> None:
    saved = ckpt.read_json(path / ckpt.SETTINGS_FILE)
    now = settings.model_dump(mode="json")
    differ = {k: (saved.get(k), now[k]) for k in RESUME_MUST_MATCH if saved.get(k) != now[k]}
    if differ:
        raise TrainingError(
            f"checkpoint {path} was written with different settings {differ} (saved, now); these fix the data "
            "order and the schedule, so resume with the saved values or use a new checkpoint_dir"
        )


def _find_resume(run_dir: Path, dist: DistContext) -> Path | None:
    found = None
    if dist.is_main:
        ckpt.remove_partial_checkpoints(run_dir)
        found = ckpt.newest_valid_checkpoint(run_dir)
    found = dist.broadcast_object(None if found is None else str(found))
    return None if found is None else Path(found)  # type: ignore[arg-type]


def run_process(
    model_ref: ModelRef,
    dataset_ref: DatasetRef,
    settings: TrainSettings,
    run_dir: str | Path,
    sink: MetricSink | None = None,
    *,
    progress: bool = True,
    dist: DistContext | None = None,
    ddp_wrap: Callable[[nn.Module, torch.device], nn.Module] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> CheckpointRef:
    dist = dist or DistContext()
    config, meta = validate_inputs(model_ref, dataset_ref, settings)
    device = resolve_device(settings.device, dist.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the first NCCL collective (the resume broadcast)
    run_dir = Path(run_dir).resolve()
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    blocks = open_blocks(dataset_ref.path, "train")
    total_steps = total_optimizer_steps(
        len(blocks),
        settings.micro_batch_size,
        settings.accumulate_steps,
        dist.world_size,
        settings.epochs,
        settings.max_steps,
    )

    resume = _find_resume(run_dir, dist)
    state: dict[str, Any] | None = None
    if resume is not None:
        _check_resume_settings(resume, settings)
        state = ckpt.load_trainer_state(resume)
        if dist.is_main:
            print(
                f"[llamaflow] resuming from checkpoint {resume} at step {state['step']}/{total_steps}",
                flush=True,
            )
            JsonlMetrics(run_dir).log_event(resumed_from=str(resume), step=int(state["step"]))
        if state["step"] >= total_steps:
            return _checkpoint_ref(resume, run_dir, state)

    _configure_backends(device)
    _seed_everything(settings.seed)
    plain = load_pretrained(config, resume or Path(model_ref.path), device=device)
    plain.train()
    optimizer = build_optimizer(
        plain,
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        betas=settings.betas,
        eps=settings.eps,
        device=device,
    )
    loader = BlockLoader(
        blocks,
        pad_id=meta["pad_id"],
        micro_batch_size=settings.micro_batch_size,
        accumulate_steps=settings.accumulate_steps,
        seed=settings.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        device=device,
    )
    step, tokens_seen = 0, 0
    if state is not None:
        assert resume is not None
        optimizer.load_state_dict(ckpt.load_optimizer_state(resume))
        loader.load_state_dict(state["loader"])
        ckpt.restore_rng_state(state["rng"])
        step, tokens_seen = state["step"], state["tokens_seen"]

    # The loss is part of what is compiled (LossHead); weights were loaded into `plain` above, before this.
    model: nn.Module = LossHead(plain)
    if settings.compile:
        model = torch.compile(model, dynamic=False)
    if ddp_wrap is not None:
        model = ddp_wrap(model, device)

    loop = _Loop(
        model=model,
        plain=plain,
        optimizer=optimizer,
        loader=loader,
        settings=settings,
        dist=dist,
        device=device,
        run_dir=run_dir,
        total_steps=total_steps,
        step=step,
        tokens_seen=tokens_seen,
        config=config,
        seq_len=meta["seq_len"],
        sink=sink,
        progress=progress,
        should_stop=should_stop,
        last_checkpoint=resume,
    )
    return loop.run()


@dataclass(eq=False)
class _Loop:
    model: nn.Module  # LossHead(plain): (inputs, targets) -> summed token loss; compiled and/or DDP-wrapped
    plain: nn.Module  # the plain module: parameters, checkpoints
    optimizer: torch.optim.Optimizer
    loader: BlockLoader
    settings: TrainSettings
    dist: DistContext
    device: torch.device
    run_dir: Path
    total_steps: int
    step: int  # optimizer steps completed
    tokens_seen: int
    config: LlamaConfig
    seq_len: int
    sink: MetricSink | None
    progress: bool
    should_stop: Callable[[], bool] | None
    last_checkpoint: Path | None

    def __post_init__(self) -> None:
        self.faults = FaultInjector(self.run_dir)
        self.jsonl = JsonlMetrics(self.run_dir) if self.dist.is_main else None
        self.flops_per_token = flops_per_token(self.config, self.seq_len)
        compute_dtype = torch.bfloat16 if self.settings.dtype == "bf16" else torch.float32
        self.peak_flops = device_peak_flops(self.device, compute_dtype) * self.dist.world_size
        self.params = [p for p in self.plain.parameters() if p.requires_grad]
        self.start_step = self.step
        self.compile_time_s: float | None = None
        self.steady_tokens = 0
        self.steady_time = 0.0
        self.last_loss = float("nan")
        self.last_metrics: dict[str, float] = {}
        self.compile_watch = _CompileWatch()

    def run(self) -> CheckpointRef:
        started = time.perf_counter()
        watch = self.compile_watch
        signals = _StopSignals()
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not (self.progress and self.dist.is_main),
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )
        compiles_after_first = 0
        with watch.watching(), signals.installed(), bar:
            while self.step < self.total_steps:
                compiles_before = watch.count
                metrics = self._one_step()
                if self.step - 1 > self.start_step:
                    compiles_after_first += watch.count - compiles_before
                    if watch.count > compiles_before:
                        warnings.warn(
                            f"torch.compile recompiled at step {self.step} ({compiles_after_first} recompiles after the "
                            "first step): shapes or guards changed, throughput suffers; run with "
                            "TORCH_LOGS=recompiles to see why",
                            RuntimeWarning,
                            stacklevel=1,
                        )
                metrics["train/recompiles"] = float(compiles_after_first)
                self._log(metrics)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{metrics['train/loss']:.4f}", tok_s=f"{metrics['train/tokens_per_s']:.0f}"
                )
                self.faults.after_step(self.step)

                stop_signal = signals.received is not None or (
                    self.should_stop is not None and self.should_stop()
                )
                time_up = (
                    self.settings.max_time_s is not None
                    and time.perf_counter() - started > self.settings.max_time_s
                )
                stop_signal, time_up = self.dist.any([stop_signal, time_up], self.device)
                periodic = self.settings.checkpoint_every and self.step % self.settings.checkpoint_every == 0
                last = self.step == self.total_steps
                if periodic or last or stop_signal or time_up:
                    self._checkpoint(
                        compiles_after_first, stopped_early=(stop_signal or time_up) and not last
                    )
                if stop_signal and not last:
                    raise TrainingInterrupted(
                        f"training stopped by {signals.received or 'a stop request'} after step {self.step}; "
                        f"checkpoint {self.last_checkpoint} written, run again with the same checkpoint_dir to resume"
                    )
                if time_up:
                    break
        assert self.last_checkpoint is not None
        return _checkpoint_ref(
            self.last_checkpoint, self.run_dir, ckpt.load_trainer_state(self.last_checkpoint)
        )

    def _one_step(self) -> dict[str, float]:
        step_number = self.step + 1
        self.faults.before_step(step_number)
        batch = self.loader.next_step()
        lr = lr_at(
            self.step,
            lr=self.settings.lr,
            total_steps=self.total_steps,
            warmup_steps=self.settings.warmup_steps,
            min_lr_ratio=self.settings.min_lr_ratio,
            schedule=self.settings.schedule,
            decay_fraction=self.settings.decay_fraction,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        n_tokens = self.dist.sum(float(count_targets([t for _, t in batch.micro_batches])), self.device)
        if n_tokens == 0:
            raise TrainingError(
                f"step {step_number} holds no target tokens (every target is padding); rebuild the dataset"
            )
        # DDP averages gradients over ranks; scaling by world_size turns that average into the global sum.
        scale = self.dist.world_size / n_tokens
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        last = len(batch.micro_batches) - 1
        for i, (inputs, targets) in enumerate(batch.micro_batches):
            sync = (
                nullcontext() if (i == last or not hasattr(self.model, "no_sync")) else self.model.no_sync()
            )
            with sync:
                with autocast(self.device, self.settings.dtype):
                    loss = self.model(inputs, targets)
                if self.faults.loss_is_nan(step_number):
                    loss = loss * float("nan")
                (loss * scale).backward()
            loss_sum += loss.detach()
        step_loss = self.dist.sum(float(loss_sum.item()), self.device) / n_tokens
        max_norm = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(
                f"non-finite training at step {step_number}: loss {step_loss}, grad norm {grad_norm}; no update and "
                f"no checkpoint written; last good checkpoint: {self.last_checkpoint or 'none'}. Lower lr, raise "
                "warmup_steps or use grad_clip"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_time = time.perf_counter() - t0

        self.step = step_number
        self.tokens_seen += int(n_tokens)
        self.last_loss = step_loss
        tokens_per_s = n_tokens / step_time
        metrics = {
            "train/loss": step_loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens_per_s,
            "train/mfu": self.flops_per_token * tokens_per_s / self.peak_flops,
            "train/step_time_s": step_time,
            "train/tokens_seen": float(self.tokens_seen),
            "train/peak_mem_mb": peak_memory_mb(self.device),
            "train/total_steps": float(self.total_steps),
            "train/epoch": self.loader.position.epoch + self.loader.position.index / len(self.loader.blocks),
        }
        if self.compile_time_s is None:
            self.compile_time_s = step_time
            metrics["train/compile_time_s"] = step_time
        else:
            self.steady_tokens += int(n_tokens)
            self.steady_time += step_time
        return metrics

    def _log(self, metrics: dict[str, float]) -> None:
        self.last_metrics = metrics
        if not self.dist.is_main:
            return
        if (
            self.step % self.settings.log_every
            and self.step != self.total_steps
            and self.step != self.start_step + 1
        ):
            return
        assert self.jsonl is not None
        self.jsonl.log_metrics(metrics, self.step)
        if self.sink is not None:
            self.sink.log_metrics(metrics, self.step)

    def _summary(self, recompiles: int, stopped_early: bool) -> dict[str, float]:
        if self.steady_time > 0:
            tokens_per_s = self.steady_tokens / self.steady_time
        else:
            tokens_per_s = self.last_metrics.get("train/tokens_per_s", 0.0)
        return {
            "train_loss": self.last_loss,
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / self.peak_flops,
            "compile_time_s": self.compile_time_s or 0.0,
            "recompiles": float(recompiles),
            "compiles": float(
                self.compile_watch.count
            ),  # frames torch.compile compiled in this process's run
            "steps_this_run": float(self.step - self.start_step),
            "total_steps": float(self.total_steps),
            "peak_mem_mb": self.last_metrics.get("train/peak_mem_mb", 0.0),
            "stopped_early": float(stopped_early),
        }

    def _checkpoint(self, recompiles: int, stopped_early: bool) -> None:
        if self.dist.is_main:
            trainer_state = {
                "step": self.step,
                "total_steps": self.total_steps,
                "tokens_seen": self.tokens_seen,
                "loader": self.loader.state_dict(),
                "rng": ckpt.capture_rng_state(),
                "schedule": {
                    "lr": self.settings.lr,
                    "warmup_steps": self.settings.warmup_steps,
                    "min_lr_ratio": self.settings.min_lr_ratio,
                    "schedule": self.settings.schedule,
                },
                "summary": self._summary(recompiles, stopped_early),
            }
            self.last_checkpoint = ckpt.write_checkpoint(
                self.run_dir,
                self.step,
                model=self.plain,
                optimizer=self.optimizer,
                trainer_state=trainer_state,
                model_config=self.config.to_dict(),
                settings=self.settings.model_dump(mode="json"),
                keep=self.settings.keep_checkpoints,
                midway=lambda: self.faults.mid_checkpoint(self.step),
            )
        else:
            self.last_checkpoint = self.run_dir / ckpt.checkpoint_name(self.step)
        self.dist.barrier()


def _checkpoint_ref(path: Path, run_dir: Path, state: dict[str, Any]) -> CheckpointRef:
    return CheckpointRef(
        path=str(path),
        run_dir=str(run_dir),
        step=int(state["step"]),
        tokens_seen=int(state["tokens_seen"]),
        metrics={k: float(v) for k, v in state.get("summary", {}).items()},
    )
