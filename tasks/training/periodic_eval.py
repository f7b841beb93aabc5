"""Validation bits per byte during training: a fixed piece of held-out text, every `eval_every` steps.

The piece is defined in bytes: the first `eval_bytes` bytes of the validation text (`tasks.scoring`), cut
back to a character boundary and encoded with the run's tokenizer. Runs on the same data read the same
documents in the same order whatever their tokenizer or seq_len, so they are scored on the same bytes, and
their bits per byte compare: sweep trials that vary `vocab_size` or `seq_len` are pruned on the same text.
The scorer is evaluation's own (`loss.score_text`), on the training module's current weights (eager, eval
mode, no gradients). It draws no random numbers and touches no parameter or optimizer state, so training
runs the same with it on or off. Its values join the step's metrics (`val_subset/...`, with the seconds it
took), which reach `metrics.jsonl` and the metric sink; a sweep prunes on them. The final evaluation still
scores `eval_max_blocks` (every block by default); the subset's number ranks runs, it is not that number.

Every rank scores the same text (an FSDP2 module's forward is collective); the main rank logs it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from tasks.data.packed import read_meta
from tasks.refs import DatasetRef, TokenizerRef
from tasks.scoring import ValidationText, first_bytes, validation_text
from tasks.training.errors import TrainingInputError
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


def subset_text(dataset: DatasetRef, n_bytes: int) -> ValidationText:
    """The first `n_bytes` bytes of `dataset`'s validation text, in its tokenizer's ids. Refused when the
    split holds fewer: a run with another tokenizer or seq_len could not be scored on the same bytes."""
    tokenizer = dataset_tokenizer(dataset)
    blocks = -(-n_bytes // dataset.seq_len) + 1  # every token but BOS/EOS spells at least one byte
    while True:
        text = validation_text(dataset, tokenizer, min(blocks, dataset.val_blocks))
        if len(text.text) >= n_bytes or blocks >= dataset.val_blocks:
            break
        blocks *= 2
    if len(text.text) < n_bytes:
        raise TrainingInputError(
            f"eval_bytes={n_bytes}, but the validation text of {dataset.path} holds {len(text.text)} bytes: "
            f"lower eval_bytes (at most {len(text.text)}), or give a larger validation split (val_fraction, "
            "val_data)"
        )
    specials = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id}
    return first_bytes(text, n_bytes, Tokenizer.from_file(tokenizer.path), specials)


class PeriodicEval:
    """Scores the model every `every` optimizer steps; `after_step` returns the metrics to add (or none)."""

    def __init__(
        self, dataset: DatasetRef, *, every: int, n_bytes: int, device: torch.device, dtype: str
    ) -> None:
        self.every = every
        self.seq_len = dataset.seq_len
        self.device = device
        self.dtype = dtype
        self.text = subset_text(dataset, n_bytes)

    @classmethod
    def from_settings(
        cls, dataset: DatasetRef, settings: TrainSettings, device: torch.device
    ) -> PeriodicEval | None:
        if not settings.eval_every:
            return None
        return cls(
            dataset,
            every=settings.eval_every,
            n_bytes=settings.eval_bytes,
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
