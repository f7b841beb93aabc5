"""The optimizer: AdamW alone, or Muon for the hidden matrices with AdamW for the rest.

Parameters fall into four roles, each an AdamW parameter group with its own peak learning rate:
  hidden  2-D weights inside the decoder blocks (attention and MLP projections): AdamW with weight decay,
          or Muon with `optimizer="muon"` (`ShardedMuon` when FSDP2 shards them: each matrix orthogonalised
          whole; or where bf16 matmuls are emulated: it orthogonalises in fp32);
  head    an untied output head (a matmul weight outside the layers): weight decay, `head_lr`;
  embed   embedding tables, a tied output head included: no weight decay, `embed_lr`;
  scalar  1-D parameters (norm gains): no weight decay, `scalar_lr`.
`embed_lr`, `head_lr` and `scalar_lr` default to `lr`, so plain AdamW trains exactly as before the roles.
The schedule scales every group's peak LR by the same factor (`set_lr_scale`).

Build the optimizer from the module as it trains (`Parallel.plain`, after `fully_shard`): FSDP2 replaces
the parameters with DTensor shards, and an optimizer holding the old ones would update nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tasks.training.muon import ShardedMuon
from tasks.training.parallelize import decoder_blocks
from tasks.training.precision import native_bf16
from tasks.training.settings import TrainSettings

ROLES = ("hidden", "head", "embed", "scalar")


def parameter_roles(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Each trainable parameter once (tied ones deduplicated), by role; see the module docstring. Found
    through any wrapper (DDP, LossHead, torch.compile, activation checkpointing, FSDP2)."""
    embedding_ids = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    }
    layer_ids = {id(p) for block in decoder_blocks(model) for p in block.parameters()}
    roles: dict[str, list[nn.Parameter]] = {role: [] for role in ROLES}
    for param in model.parameters():  # deduplicates tied parameters
        if not param.requires_grad:
            continue
        if id(param) in embedding_ids:
            roles["embed"].append(param)
        elif param.ndim < 2:
            roles["scalar"].append(param)
        elif id(param) in layer_ids:
            roles["hidden"].append(param)
        else:
            roles["head"].append(param)
    return roles


class TrainOptimizer:
    """One or two torch optimizers driven as one: step, zero_grad, the LR schedule and one state dict.

    `state_dict()` is `{"adamw": ...}` or `{"adamw": ..., "muon": ...}`; a plain AdamW state dict (written
    before Muon existed) loads into the AdamW part.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]) -> None:
        self.parts = parts
        self.peak_lrs = [group["lr"] for group in self.param_groups]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.parts.values())

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts.values() for group in part.param_groups]

    def set_lr_scale(self, scale: float) -> None:
        """Every group's LR becomes its peak LR times `scale` (the schedule's factor for this step)."""
        for group, peak in zip(self.param_groups, self.peak_lrs, strict=True):
            group["lr"] = peak * scale

    def lrs(self) -> dict[str, float]:
        """The current LR of each optimizer part's first group, as the part will apply it (for metrics)."""
        return {name: part.param_groups[0]["lr"] for name, part in self.parts.items()}

    def step(self) -> None:
        for part in self.parts.values():
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "param_groups" in state:  # a bare torch AdamW state dict
            state = {"adamw": state}
        if set(state) != set(self.parts):
            raise ValueError(
                f"the checkpoint holds optimizer state for {sorted(state)}, this run builds {sorted(self.parts)}: "
                "resume with the optimizer the checkpoint was written with, or use a new checkpoint_dir"
            )
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


def build_optimizer(model: nn.Module, settings: TrainSettings, device: torch.device) -> TrainOptimizer:
    roles = parameter_roles(model)
    lr = settings.lr
    adamw_groups = [
        {"params": roles["head"], "lr": settings.head_lr or lr, "weight_decay": settings.weight_decay},
        {"params": roles["embed"], "lr": settings.embed_lr or lr, "weight_decay": 0.0},
        {"params": roles["scalar"], "lr": settings.scalar_lr or lr, "weight_decay": 0.0},
    ]
    if settings.optimizer == "adamw":
        adamw_groups.insert(0, {"params": roles["hidden"], "lr": lr, "weight_decay": settings.weight_decay})
    # Fused AdamW exists for CUDA and CPU: on CPU it cut the optimizer step from 17 to 4 ms at demo.
    fused = True if device.type in ("cuda", "cpu") else None
    parts: dict[str, torch.optim.Optimizer] = {
        "adamw": torch.optim.AdamW(
            [g for g in adamw_groups if g["params"]],
            lr=lr,
            betas=settings.betas,
            eps=settings.eps,
            fused=fused,
        )
    }
    if settings.optimizer == "muon":
        if not roles["hidden"]:
            raise ValueError("optimizer='muon' found no 2-D weights inside the decoder layers to optimize")
        # torch.optim.Muon has a single-tensor path only (no foreach or fused implementation in torch 2.13),
        # and orthogonalises in bf16: where bf16 matmuls are emulated, ShardedMuon does it in fp32.
        sharded = any(isinstance(p, DTensor) for p in roles["hidden"])
        ns_dtype = torch.bfloat16 if native_bf16(device.type) else torch.float32
        own = sharded or ns_dtype != torch.bfloat16
        parts["muon"] = (ShardedMuon if own else torch.optim.Muon)(
            roles["hidden"],
            lr=settings.muon_lr,
            weight_decay=settings.muon_weight_decay,
            momentum=settings.muon_momentum,
            nesterov=True,
            ns_steps=settings.muon_ns_steps,
            adjust_lr_fn=settings.muon_adjust_lr,
            **({"ns_dtype": ns_dtype} if own else {}),
        )
    return TrainOptimizer(parts)
