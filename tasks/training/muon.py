"""Muon on FSDP2-sharded parameters, with Muon's update: every hidden matrix orthogonalised whole.

torch.optim.Muon's step is elementwise work (momentum, Nesterov blend, weight decay, the update) around one
matrix function, the Newton-Schulz orthogonalisation. Under FSDP2 each rank holds a block of rows of each
matrix (`Shard(0)`), and orthogonalising a block of rows is not the block of rows of the orthogonalised
matrix. So here the elementwise work runs on each rank's rows, while each matrix's update is gathered whole
on one owner rank (matrices dealt round-robin over the ranks, as in "Muon is Scalable for LLM Training",
Liu et al. 2025), orthogonalised there by `newton_schulz` (the iteration torch.optim.Muon runs, written here:
torch's own function is private and changes between releases), and its rows scattered back: per
matrix one gather and one scatter of its size, and each rank computes 1/world of the orthogonalisations.

The state (`momentum_buffer`) and hyperparameters are torch.optim.Muon's: checkpoints move between DDP and
FSDP2 runs. Cost measured in benchmarks/results/muon_sharded.json (docs/scaling.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon for parameters that FSDP2 shards by rows over a 1-D device mesh (or whole ones), with
    the Newton-Schulz matmuls in `ns_dtype`: bf16 as torch.optim.Muon, or fp32 where bf16 matmuls are
    emulated (an AVX2 CPU, where they run several times slower than fp32)."""

    def __init__(
        self, params: Any, *args: Any, ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any
    ) -> None:
        super().__init__(params, *args, **kwargs)
        # Not in the param groups: the state dict, hence checkpoints, stay torch.optim.Muon's.
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: ANN401 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for param in params:
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                grad, buf = _local(param.grad), _local(state["momentum_buffer"])
                buf.lerp_(grad, 1 - group["momentum"])
                updates.append(grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
            ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
            orthogonal = orthogonalise_whole(params, updates, *ns, dtype=self.ns_dtype)
            for param, update in zip(params, orthogonal, strict=True):
                lr = group["lr"]
                local = _local(param)
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """An approximate orthogonalisation of `matrix` (its singular values moved towards 1, its singular
    vectors kept), in `dtype` (bf16 as torch.optim.Muon): `steps` rounds of the odd quintic X <- aX + (bA + cA^2)X with A = X X^T, from X
    scaled to a Frobenius norm of 1 (so every singular value starts within (0, 1]). Worked on the wide
    orientation, so A is the smaller Gram matrix. The result has `matrix`'s shape, in `dtype`."""
    if matrix.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalises a matrix, got shape {tuple(matrix.shape)}")
    a, b, c = coefficients
    tall = matrix.shape[0] > matrix.shape[1]
    x = matrix.to(dtype)
    if tall:
        x = x.mT
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*A + c*A@A
        x = torch.addmm(x, poly, x, beta=a)  # a*X + poly@X
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix learning rate: "original" scales by sqrt(max(1, rows/cols)),
    "match_rms_adamw" by 0.2*sqrt(max(rows, cols)) (an update with AdamW's RMS)."""
    rows, cols = shape[0], shape[1]
    if adjust is None or adjust == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the storage itself, so in-place updates reach the parameter)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def orthogonalise_whole(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """This rank's rows of the Newton-Schulz orthogonalisation of each whole matrix, `updates[k]` being
    this rank's rows of parameter k's update. Matrix k is orthogonalised on rank k % world."""
    results: list[torch.Tensor | None] = [None] * len(params)
    pending: list[tuple[int, torch.distributed.ProcessGroup, int, int, list[torch.Tensor] | None]] = []
    works = []
    for k, (param, update) in enumerate(zip(params, updates, strict=True)):
        if not isinstance(param, DTensor):  # a whole matrix already (one process, DDP)
            results[k] = newton_schulz(update, ns_coefficients, ns_steps, eps, dtype)
            continue
        group, rows_per_rank = _row_sharding(param, update)
        world, me = group.size(), dist.get_rank(group)
        owner = k % world
        padded = update.new_zeros((rows_per_rank, update.shape[1]))
        padded[: update.shape[0]] = update
        parts = [torch.empty_like(padded) for _ in range(world)] if me == owner else None
        works.append(dist.gather(padded, parts, group=group, group_dst=owner, async_op=True))
        pending.append((k, group, owner, rows_per_rank, parts))
    for work in works:
        work.wait()

    works, received = [], []
    for k, group, owner, rows_per_rank, parts in pending:
        rows, cols = params[k].shape
        scatter_list = None
        if parts is not None:
            whole = torch.cat(parts)[:rows]
            ortho = newton_schulz(whole, ns_coefficients, ns_steps, eps, dtype)
            # Sent in the update's dtype (exact for bf16): the rank adds it as a whole run would.
            padded = ortho.new_zeros((rows_per_rank * group.size(), cols), dtype=updates[k].dtype)
            padded[:rows] = ortho
            scatter_list = list(padded.split(rows_per_rank))
        mine = updates[k].new_empty((rows_per_rank, cols))
        works.append(dist.scatter(mine, scatter_list, group=group, group_src=owner, async_op=True))
        received.append((k, mine))
    for work in works:
        work.wait()
    for k, mine in received:
        results[k] = mine[: updates[k].shape[0]]
    return results  # type: ignore[return-value]


def _row_sharding(param: DTensor, local: torch.Tensor) -> tuple[dist.ProcessGroup, int]:
    """The process group a row-sharded parameter lives on, and the rows of a (padded) shard: FSDP2 cuts
    dim 0 as torch.chunk does, ceil(rows / world) per rank, the last ranks holding fewer or none."""
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(
            f"ShardedMuon handles parameters sharded by rows over a 1-D mesh (FSDP2); got placements "
            f"{param.placements} on a {param.device_mesh.ndim}-D mesh"
        )
    group = param.device_mesh.get_group()
    world, me = group.size(), dist.get_rank(group)
    rows_per_rank = -(-param.shape[0] // world)
    expected = max(0, min(param.shape[0] - me * rows_per_rank, rows_per_rank))
    if local.shape[0] != expected:
        raise ValueError(
            f"rank {me} holds {local.shape[0]} rows of a {tuple(param.shape)} matrix, expected {expected}"
        )
    return group, rows_per_rank
