"""Who this process is in a data-parallel job, and the few collectives the training loop needs."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def sum(self, value: float, device: torch.device) -> float:
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return float(tensor.item())

    def any(self, flags: list[bool], device: torch.device) -> list[bool]:
        """Element-wise OR over ranks, so every rank takes the same decision."""
        if not self.distributed:
            return flags
        tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [bool(v) for v in tensor.tolist()]

    def broadcast_object(self, value: object) -> object:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, value: object) -> list[object] | None:
        """Every rank's `value`, in rank order, on the main rank; None on the others."""
        if not self.distributed:
            return [value]
        gathered: list[object] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, gathered, dst=0)
        return gathered

    def all_gather_object(self, value: object) -> list[object]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.distributed:
            return [value]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def leave_process_group() -> None:
    """End a rank's part in a job that succeeded, so that the interpreter can exit without aborting.

    A gloo worker thread frees each collective's work, and the tensors it holds, after the caller has
    stopped waiting for it: the barrier's work frees every earlier one. Freeing a tensor made in Python
    takes the GIL, and a thread that asks for the GIL of an interpreter that is shutting down aborts the
    process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489), so torchrun
    would fail a job whose every step was done. The barrier makes every collective complete; the sleep
    gives the GIL to the worker threads that free them. Not for the failure path: a barrier with a dead
    peer waits out the process-group timeout.
    """
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.1)


def context_from_env() -> DistContext:
    """The rank set by torchrun (RANK, WORLD_SIZE, LOCAL_RANK), or a single process."""
    return DistContext(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """`auto` is CUDA when available, else CPU; under data parallelism each rank gets `cuda:<local_rank>`."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {setting!r} requested but CUDA is not available; use device='cpu' or 'auto'"
            )
        if device.index is None:
            device = torch.device("cuda", local_rank)
    elif device.type != "cpu":
        raise ValueError(f"device {setting!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'")
    return device
