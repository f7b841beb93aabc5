"""One rank of a `torchrun` data-parallel job: `python -m tasks.training.worker <worker_spec.json>`.

Started without torchrun (no WORLD_SIZE), it trains as a single process: a run in its own process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tasks.refs import DatasetRef, ModelRef
from tasks.training.distributed import context_from_env
from tasks.training.engine import run_training
from tasks.training.settings import TrainSettings


def _wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    settings = TrainSettings(**spec["settings"])
    context = context_from_env()
    use_cuda = settings.device.startswith("cuda") or (settings.device == "auto" and torch.cuda.is_available())
    if context.distributed:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    try:
        ref = run_training(
            ModelRef(**spec["model_ref"]),
            DatasetRef(**spec["dataset_ref"]),
            settings,
            progress=spec["progress"],
            dist=context,
            ddp_wrap=_wrap_ddp if context.distributed else None,
        )
        if context.is_main:
            result = Path(spec["result_path"])
            tmp = result.with_name(result.name + f".{os.getpid()}.tmp")
            tmp.write_text(ref.model_dump_json())
            os.replace(tmp, result)
    finally:
        if context.distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tasks.training.worker <worker_spec.json>")
    main(sys.argv[1])
