"""One rank of a `torchrun` data-parallel job: `python -m tasks.training.rank <torchrun_spec.json>`.

Under torchrun (WORLD_SIZE set, even to 1) it joins the process group, and the model is shared as
`data_parallel` says; started without torchrun, it trains as a single process: a run in its own process.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from model.atomic import write_text_atomic
from tasks.home import apply_embedded_defaults
from tasks.training.distributed import context_from_env, leave_process_group
from tasks.training.engine import run_process
from tasks.training.launch import RESULT_FILE, WorkerSpec
from tasks.training.rendezvous import worker_store

BACKEND_ENV = "LLAMAFLOW_DIST_BACKEND"


def process_group_backend(use_cuda: bool) -> str:
    """NCCL on CUDA, gloo on CPU; `LLAMAFLOW_DIST_BACKEND=gloo` on CUDA lets several ranks share one GPU (NCCL
    refuses two ranks on one device), as benchmarks/gpu_check.py runs a 2-rank job on one GPU."""
    chosen = os.environ.get(BACKEND_ENV) or ("nccl" if use_cuda else "gloo")
    if chosen not in ("nccl", "gloo"):
        raise SystemExit(f"{BACKEND_ENV}={chosen!r}: use nccl or gloo (or leave it unset)")
    return chosen


@record  # the exception a rank ends with reaches torchrun's agent, and from it the launcher (launch.py)
def main(spec_path: str) -> None:
    apply_embedded_defaults()
    spec = WorkerSpec.model_validate_json(Path(spec_path).read_text())
    settings = spec.settings
    context = context_from_env()
    use_cuda = settings.device.startswith("cuda") or (settings.device == "auto" and torch.cuda.is_available())
    launched = "WORLD_SIZE" in os.environ  # by torchrun
    if launched:
        # A peer that stops answering (a lost node) fails the job in minutes, not after torch's 30.
        timeout = timedelta(minutes=settings.process_group_timeout_min)
        store = worker_store(settings, timeout)
        if store is None:
            dist.init_process_group(backend=process_group_backend(use_cuda), timeout=timeout)
        else:
            dist.init_process_group(
                backend=process_group_backend(use_cuda),
                timeout=timeout,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
            )
    try:
        ref = run_process(
            spec.model_ref,
            spec.dataset_ref,
            settings,
            spec.run_dir,
            progress=spec.progress,
            dist=context,
            budget=spec.budget,
        )
        if context.is_main:
            write_text_atomic(Path(spec.run_dir) / RESULT_FILE, ref.model_dump_json())
    except BaseException:
        if launched:
            dist.destroy_process_group()
        raise
    if launched:
        leave_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tasks.training.rank <torchrun_spec.json>")
    main(sys.argv[1])
