"""The optimizer-step loop of one process: exact token-weighted accumulation, clipping, the schedule,
metrics, checkpoints and stops.

Per optimizer step: count the step's target tokens over all micro-batches and ranks, then backward each
micro-batch's summed token loss divided by that global count (times what the gradient reduction divides
by: DDP averages over ranks, FSDP2 here sums). The step's gradient is then exactly that of the mean token
loss of the whole step, however it is split into micro-batches and ranks. How the ranks share the model is
`Parallel`'s business (`tasks.training.parallelize`); the loop never asks which.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from model import LlamaConfig, flops_per_token
from tasks.refs import CheckpointRef
from tasks.training import checkpoint as ckpt
from tasks.training import storage
from tasks.training.control import CompileWatch, StopSignals
from tasks.training.distributed import DistContext
from tasks.training.errors import TrainingError, TrainingInterrupted
from tasks.training.faults import FaultInjector
from tasks.training.loader import BlockLoader
from tasks.training.loss import count_targets
from tasks.training.metrics import JsonlMetrics, MetricSink, device_peak_flops, peak_memory_mb
from tasks.training.optim import TrainOptimizer
from tasks.training.parallelize import Parallel
from tasks.training.periodic_eval import PeriodicEval
from tasks.training.precision import autocast
from tasks.training.schedule import lr_at
from tasks.training.settings import TrainSettings


@dataclass(eq=False)
class TrainLoop:
    parallel: Parallel  # the model as the ranks share it; `parallel.model(inputs, targets)` -> summed loss
    optimizer: TrainOptimizer
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
    run_facts: dict[str, Any] = field(default_factory=dict)  # RunShape and run length, saved for resume
    periodic_eval: PeriodicEval | None = None  # validation scores every eval_every steps
    first_metrics: dict[str, float] = field(default_factory=dict)  # logged with the first step's (the plan)

    def __post_init__(self) -> None:
        self.faults = FaultInjector(self.run_dir)
        self.jsonl = JsonlMetrics(self.run_dir) if self.dist.is_main else None
        self.flops_per_token = flops_per_token(self.config, self.seq_len)
        compute_dtype = torch.bfloat16 if self.settings.dtype == "bf16" else torch.float32
        # Measured (and cached) by the main rank alone: it alone logs MFU.
        peak = device_peak_flops(self.device, compute_dtype) if self.dist.is_main else float("nan")
        self.peak_flops = peak * self.dist.world_size
        self.start_step = self.step
        self.compile_time_s: float | None = None
        self.steady_tokens = 0
        self.steady_time = 0.0  # wall clock of the steps after the first
        # End of the previous step's whole iteration: a step's wall time runs from there, so it includes
        # loading its batch and the previous step's logging and checkpoint, not only the compute.
        self.wall_mark = time.perf_counter()
        self.last_loss = float("nan")
        self.last_metrics: dict[str, float] = {}
        self.compile_watch = CompileWatch()

    def run(self) -> CheckpointRef:
        started = self.wall_mark = time.perf_counter()
        watch = self.compile_watch
        signals = StopSignals()
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
                if self.periodic_eval is not None:
                    metrics.update(self.periodic_eval.after_step(self.parallel.plain, self.step))
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
        return checkpoint_ref(
            self.last_checkpoint, self.run_dir, ckpt.load_trainer_state(self.last_checkpoint)
        )

    def _one_step(self) -> dict[str, float]:
        step_number = self.step + 1
        self.faults.before_step(step_number)
        batch = self.loader.next_step()
        lr = self.settings.lr * self._schedule_lr()
        lrs = self.optimizer.lrs()
        t0 = time.perf_counter()
        n_tokens, step_loss = self._accumulate(batch.micro_batches, step_number)
        grad_norm = self._update(step_number, step_loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        step_time, wall_time = now - t0, now - self.wall_mark
        self.wall_mark = now

        self.step = step_number
        self.tokens_seen += int(n_tokens)
        self.last_loss = step_loss
        metrics = self._step_metrics(lr, lrs, grad_norm, n_tokens, step_time, wall_time)
        if self.compile_time_s is None:
            self.compile_time_s = wall_time
            metrics["train/compile_time_s"] = wall_time
            # What MFU is relative to: a CPU's peak is measured (and may be re-measured by a later run).
            metrics["train/peak_flops"] = self.peak_flops
            metrics.update(self.first_metrics)
        else:
            self.steady_tokens += int(n_tokens)
            self.steady_time += wall_time
        return metrics

    def _schedule_lr(self) -> float:
        """Sets the optimizer's LR scale for the coming step and returns it."""
        lr_scale = lr_at(
            self.step,
            lr=1.0,
            total_steps=self.total_steps,
            warmup_steps=self.settings.warmup_steps,
            min_lr_ratio=self.settings.min_lr_ratio,
            schedule=self.settings.schedule,
            decay_fraction=self.settings.decay_fraction,
        )
        self.optimizer.set_lr_scale(lr_scale)
        return lr_scale

    def _accumulate(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], step_number: int
    ) -> tuple[float, float]:
        """Backward of every micro-batch, scaled by the step's global target count: (that count, the step's
        mean token loss over all ranks)."""
        n_tokens = self.dist.sum(float(count_targets([t for _, t in micro_batches])), self.device)
        if n_tokens == 0:
            raise TrainingError(
                f"step {step_number} holds no target tokens (every target is padding); rebuild the dataset"
            )
        scale = self.parallel.gradient_divisor / n_tokens
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        last = len(micro_batches) - 1
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.parallel.micro_batch(last=i == last):
                with autocast(self.device, self.settings.dtype):
                    loss = self.parallel.model(inputs, targets)
                if self.faults.loss_is_nan(step_number):
                    loss = loss * float("nan")
                (loss * scale).backward()
            loss_sum += loss.detach()
        return n_tokens, self.dist.sum(float(loss_sum.item()), self.device) / n_tokens

    def _update(self, step_number: int, step_loss: float) -> float:
        """Clip, then step the optimizer unless the loss or the gradient is not finite: the gradient norm."""
        max_norm = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        grad_norm = self.parallel.clip_grad_norm(max_norm)
        if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(
                f"non-finite training at step {step_number}: loss {step_loss}, grad norm {grad_norm}; no update and "
                f"no checkpoint written; last good checkpoint: {self.last_checkpoint or 'none'}. Lower lr, raise "
                "warmup_steps or use grad_clip"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _step_metrics(
        self,
        lr: float,
        lrs: dict[str, float],
        grad_norm: float,
        n_tokens: float,
        step_time: float,
        wall_time: float,
    ) -> dict[str, float]:
        # The headline figure is wall clock, everything included; the compute-only rate is kept beside it.
        tokens_per_s = n_tokens / wall_time
        return {
            "train/loss": self.last_loss,
            "train/lr": lr,
            # What Muon's parameter group holds for this step, not a recomputation of it.
            **({"train/muon_lr": lrs["muon"]} if "muon" in lrs else {}),
            "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens_per_s,
            "train/compute_tokens_per_s": n_tokens / step_time,
            "train/mfu": self.flops_per_token * tokens_per_s / self.peak_flops,
            "train/step_time_s": wall_time,
            "train/compute_time_s": step_time,
            "train/tokens_seen": float(self.tokens_seen),
            "train/peak_mem_mb": peak_memory_mb(self.device),
            "train/total_steps": float(self.total_steps),
            "train/epoch": self.loader.position.epoch + self.loader.position.index / len(self.loader.blocks),
        }

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
        trainer_state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen,
            "loader": self.loader.state_dict(),
            "run": self.run_facts,
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
            parallel=self.parallel,
            optimizer=self.optimizer,
            trainer_state=trainer_state,
            model_config=self.config.to_dict(),
            settings=self.settings.model_dump(mode="json"),
            device=self.device,
            keep=self.settings.keep_checkpoints,
            dist=self.dist,
            midway=lambda: self.faults.mid_checkpoint(self.step),
        )
        if self.dist.is_main:  # checkpoint_dir on an object store: the mirror's new state goes up
            storage.push_checkpoint(self.run_dir, self.last_checkpoint)


def checkpoint_ref(path: Path, run_dir: Path, state: dict[str, Any]) -> CheckpointRef:
    return CheckpointRef(
        path=str(path),
        run_dir=str(run_dir),
        step=int(state["step"]),
        tokens_seen=int(state["tokens_seen"]),
        metrics={k: float(v) for k, v in state.get("summary", {}).items()},
        run_length=str(state.get("run", {}).get("length", "")),
    )
