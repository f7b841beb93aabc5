"""AdamW with weight decay only on matmul weights, and exact loss normalisation over accumulated steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tasks.training.loader import IGNORE_INDEX


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matmul weights; never norms, biases or embeddings (a tied head counts as embedding)."""
    no_decay_ids: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding) or param.ndim < 2:
                no_decay_ids.add(id(param))
    decay, no_decay = [], []
    for param in model.parameters():  # deduplicates tied parameters
        if param.requires_grad:
            (no_decay if id(param) in no_decay_ids else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    device: torch.device,
) -> torch.optim.AdamW:
    # Fused AdamW exists for CUDA and CPU: on CPU it cut the optimizer step from 17 to 4 ms at demo.
    fused = True if device.type in ("cuda", "cpu") else None
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused)


def count_targets(targets: list[torch.Tensor]) -> int:
    """Non-ignored target tokens of a step's micro-batches (one host sync, before any backward pass)."""
    return int(sum((t != IGNORE_INDEX).sum() for t in targets).item())


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the float32 token losses: the step divides by its global token count once."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )


class LossHead(nn.Module):
    """The model followed by its summed token loss, as one module for torch.compile.

    Compiling the loss with the model lets inductor fuse the float32 upcast, log-softmax and gather into
    the model's graph instead of materialising float32 logits between graphs: 1.36x tokens/s on the demo
    preset here (benchmarks/README.md, "loss inside the compiled graph"). The loss runs outside autocast.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return token_loss_sum(logits, targets)
