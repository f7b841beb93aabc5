"""One rank of a `torchrun` data-parallel job: `python -m tasks.training.worker <torchrun_spec.json>`.

Started without torchrun (no WORLD_SIZE), it trains as a single process: a run in its own process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from model.atomic import write_text_atomic
from tasks.home import apply_embedded_defaults
from tasks.training.distributed import context_from_env
from tasks.training.engine import run_process
from tasks.training.launch import RESULT_FILE, WorkerSpec


def _wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    # The only buffers are the RoPE tables, derived from the config on every rank: nothing to broadcast.
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def main(spec_path: str) -> None:
    apply_embedded_defaults()
    spec = WorkerSpec.model_validate_json(Path(spec_path).read_text())
    settings = spec.settings
    context = context_from_env()
    use_cuda = settings.device.startswith("cuda") or (settings.device == "auto" and torch.cuda.is_available())
    if context.distributed:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    try:
        ref = run_process(
            spec.model_ref,
            spec.dataset_ref,
            settings,
            spec.run_dir,
            progress=spec.progress,
            dist=context,
            ddp_wrap=_wrap_ddp if context.distributed else None,
        )
        if context.is_main:
            write_text_atomic(Path(spec.run_dir) / RESULT_FILE, ref.model_dump_json())
    finally:
        if context.distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tasks.training.worker <torchrun_spec.json>")
    main(sys.argv[1])
