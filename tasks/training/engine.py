"""One process's training, set up: inputs checked, resume found, the model loaded (then compiled),
optimizer and loader built, and the loop (`tasks.training.loop`) run. A single device, or one rank of a
torchrun job."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from model import LlamaConfig, load_pretrained
from tasks.data.packed import open_blocks, read_meta
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.training import checkpoint as ckpt
from tasks.training.distributed import DistContext, resolve_device
from tasks.training.errors import TrainingError
from tasks.training.loader import BlockLoader
from tasks.training.loop import TrainLoop, checkpoint_ref
from tasks.training.loss import LossHead
from tasks.training.metrics import JsonlMetrics, MetricSink
from tasks.training.optim import build_optimizer
from tasks.training.resume import check_resume_settings, find_resume
from tasks.training.schedule import total_optimizer_steps
from tasks.training.settings import TrainSettings


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

    resume = find_resume(run_dir, dist)
    state: dict[str, Any] | None = None
    if resume is not None:
        check_resume_settings(resume, settings)
        state = ckpt.load_trainer_state(resume)
        if dist.is_main:
            print(
                f"[llamaflow] resuming from checkpoint {resume} at step {state['step']}/{total_steps}",
                flush=True,
            )
            JsonlMetrics(run_dir).log_event(resumed_from=str(resume), step=int(state["step"]))
        if state["step"] >= total_steps:
            return checkpoint_ref(resume, run_dir, state)

    _configure_backends(device)
    _seed_everything(settings.seed)
    plain = load_pretrained(config, resume or Path(model_ref.path), device=device)
    plain.train()
    optimizer = build_optimizer(plain, settings, device)
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

    loop = TrainLoop(
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
