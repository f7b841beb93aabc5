"""Validation bits per byte during training: a fixed subset of held-out blocks, every `eval_every` steps.

The score is evaluation's own: the validation text (`tasks.scoring`) cut to its first `eval_blocks` blocks,
scored by the same function (`loss.score_text`), on the training module's current weights (eager, eval
mode, no gradients). It draws no random numbers and touches no parameter or optimizer state, so training
runs the same with it on or off. Its values join the step's metrics (`val_subset/...`, with the seconds it took), which reach
`metrics.jsonl` and the metric sink; a sweep prunes on them. The final evaluation still scores
`eval_max_blocks` (every block by default); the subset's number ranks runs, it is not that number.

Every rank scores the same text (an FSDP2 module's forward is collective); the main rank logs it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from tasks.data.packed import read_meta
from tasks.refs import DatasetRef, TokenizerRef
from tasks.scoring import validation_text
from tasks.training.loss import score_text
from tasks.training.settings import TrainSettings

BITS_PER_BYTE = "val_subset/bits_per_byte"
LOSS = "val_subset/loss"
SECONDS = "val_subset/time_s"


def dataset_tokenizer(dataset: DatasetRef) -> TokenizerRef:
    """The tokenizer that built `dataset`: its copy in the dataset directory, with the ids meta.json names."""
    meta = read_meta(dataset.path)
    return TokenizerRef(
        path=str(Path(dataset.path) / "tokenizer.json"),
        fingerprint=str(meta["stats"].get("tokenizer_fingerprint", "")),
        vocab_size=int(meta["vocab_size"]),
        bos_id=int(meta["bos_id"]),
        eos_id=int(meta["eos_id"]),
        pad_id=int(meta["pad_id"]),
    )


class PeriodicEval:
    """Scores the model every `every` optimizer steps; `after_step` returns the metrics to add (or none)."""

    def __init__(
        self, dataset: DatasetRef, *, every: int, blocks: int, device: torch.device, dtype: str
    ) -> None:
        self.every = every
        self.seq_len = dataset.seq_len
        self.device = device
        self.dtype = dtype
        self.text = validation_text(dataset, dataset_tokenizer(dataset), min(blocks, dataset.val_blocks))

    @classmethod
    def from_settings(
        cls, dataset: DatasetRef, settings: TrainSettings, device: torch.device
    ) -> PeriodicEval | None:
        if not settings.eval_every:
            return None
        return cls(
            dataset,
            every=settings.eval_every,
            blocks=settings.eval_blocks,
            device=device,
            dtype=settings.dtype,
        )

    def after_step(self, model: nn.Module, step: int) -> dict[str, float]:
        """`model` is the plain module being trained (not the compiled or wrapped one)."""
        if step % self.every:
            return {}
        started = time.perf_counter()
        loss, bits_per_byte = score_text(
            model, self.text, seq_len=self.seq_len, device=self.device, dtype=self.dtype
        )
        return {BITS_PER_BYTE: bits_per_byte, LOSS: loss, SECONDS: time.perf_counter() - started}
