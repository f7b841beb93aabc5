"""The loss, computed here for training and scoring alike: summed float32 token losses, compiled together
with the model for training, with the count of target tokens that the sum is divided by once per optimizer
step (exact accumulation); and a model's loss on a token stream in eval mode (`stream_loss`, `score_text`),
which the evaluate task and the engine's periodic score during training share."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model import LlamaForPretraining
from model.attention import document_ids_from_eos
from tasks.scoring import ScoringError, ValidationText
from tasks.training.loader import IGNORE_INDEX
from tasks.training.precision import autocast


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


# Logits are scored this many elements at a time (16 MB in float32): the head and eager cross-entropy over a
# whole batch's float32 logits ran ~4x slower here than in cache-sized pieces (0.52 vs 0.11 s per 8,192 tokens
# at vocab 8192; benchmarks/results/levers_round4.json).
LOSS_CHUNK_ELEMENTS = 1 << 22


@torch.no_grad()
def stream_loss(
    model: LlamaForPretraining,
    tokens: np.ndarray,
    *,
    context_id: int,
    seq_len: int,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
    dtype: str = "bf16",
) -> float:
    """Summed cross-entropy (nats) of predicting each of `tokens` once: blocks of `seq_len` targets, each
    block's inputs starting with the token before its first target (`context_id` for the very first)."""
    device = torch.device(device)
    n = len(tokens)
    if n == 0:
        raise ScoringError("no tokens to score")
    rows = -(-n // seq_len)
    sequence = np.full(rows * seq_len + 1, context_id, dtype=np.int64)
    sequence[1 : n + 1] = tokens
    inputs = torch.from_numpy(sequence[:-1].reshape(rows, seq_len))
    targets = torch.from_numpy(sequence[1:].reshape(rows, seq_len).copy())
    targets.view(-1)[n:] = IGNORE_INDEX  # the last block's padding
    was_training = model.training
    model.eval()
    total = 0.0
    chunk_rows = max(1, LOSS_CHUNK_ELEMENTS // model.config.vocab_size)
    for start in range(0, rows, batch_size):
        x, y = inputs[start : start + batch_size].to(device), targets[start : start + batch_size].to(device)
        with autocast(device, dtype):
            hidden = model.hidden_states(x).flatten(0, 1)
        batch_nats = torch.zeros((), dtype=torch.float64, device=device)
        for h, t in zip(hidden.split(chunk_rows), y.flatten().split(chunk_rows), strict=True):
            with autocast(device, dtype):
                logits = model.lm_head(h)
            batch_nats += token_loss_sum(logits, t)
        total += batch_nats.item()
    model.train(was_training)
    return total


def score_text(
    model: torch.nn.Module, text: ValidationText, *, seq_len: int, device: torch.device, dtype: str
) -> tuple[float, float]:
    """(mean loss per token in nats, bits per byte) of `model` on the validation text in its own tokens."""
    nats = stream_loss(
        model, text.tokens, context_id=text.context_id, seq_len=seq_len, device=device, dtype=dtype
    )
    return nats / len(text.tokens), nats / math.log(2) / len(text.text)
