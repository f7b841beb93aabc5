"""The loss as the engine computes it: summed float32 token losses, compiled together with the model, and
the count of target tokens that the sum is divided by once per optimizer step (exact accumulation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import document_ids_from_eos
from tasks.training.loader import IGNORE_INDEX


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

    With `eos_id`, attention is masked per document: the document ids are derived from the inputs inside
    the compiled graph (EOS closes a document), so the loader and the batches stay as they are.
    """

    def __init__(self, model: nn.Module, eos_id: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.eos_id = eos_id

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        documents = None if self.eos_id is None else document_ids_from_eos(inputs, self.eos_id)
        logits = self.model(inputs, document_ids=documents)
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return token_loss_sum(logits, targets)
