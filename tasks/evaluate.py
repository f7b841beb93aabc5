"""evaluate: held-out loss and perplexity of a checkpoint, plus a few generated samples."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from prefect import task
from tokenizers import Tokenizer

from model import LlamaForPretraining, generate, load_pretrained
from tasks.refs import CheckpointRef, DatasetRef, EvalResult, ModelRef, TokenizerRef
from tasks.training.distributed import resolve_device
from tasks.training.precision import autocast

SAMPLE_PROMPTS = ("def ", "class ", "import ", "    for i in range(", "if __name__ ==", "    return ")


@torch.no_grad()
def mean_token_loss(
    model: torch.nn.Module,
    blocks_path: str | os.PathLike[str],
    *,
    pad_id: int,
    max_blocks: int | None = None,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
    dtype: str = "bf16",
) -> float:
    """Mean cross-entropy per target token over the first `max_blocks` packed blocks (PAD ignored).

    The sum over all tokens divided by their count, so every token weighs the same whatever the batch.
    """
    device = torch.device(device)
    blocks = np.load(Path(blocks_path), mmap_mode="r", allow_pickle=False)
    n = len(blocks) if max_blocks is None else min(max_blocks, len(blocks))
    if n == 0:
        raise ValueError(f"{blocks_path} holds no blocks: nothing to evaluate")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, n, batch_size):
        batch = torch.from_numpy(np.asarray(blocks[start : min(start + batch_size, n)]).astype(np.int64)).to(
            device
        )
        inputs, targets = batch[:, :-1], batch[:, 1:].clone()
        targets[targets == pad_id] = -100
        with autocast(device, dtype):
            logits = model(inputs)
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )
        total += loss.item()
        count += int((targets != -100).sum())
    model.train(was_training)
    return total / count


@torch.no_grad()
def generate_samples(
    model: LlamaForPretraining,
    tokenizer: Tokenizer,
    prompts: tuple[str, ...],
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    seed: int,
    device: torch.device,
    temperature: float = 0.8,
    top_k: int | None = 50,
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs, sampled reproducibly from `seed`."""
    if not prompts:
        return []
    encoded = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.bool)
    for row, ids in enumerate(encoded):  # left padding
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = True
    generator = torch.Generator(device=device).manual_seed(seed)
    out = generate(
        model,
        input_ids.to(device),
        mask.to(device),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        generator=generator,
    )
    completions = []
    for prompt, row in zip(prompts, out[:, width:].tolist(), strict=True):
        ids = [t for t in row if t not in (pad_id, eos_id)]
        completions.append((prompt, tokenizer.decode(ids)))
    return completions


def evaluate(
    checkpoint: CheckpointRef,
    dataset: DatasetRef,
    tokenizer: TokenizerRef,
    *,
    initial_model: ModelRef | None = None,
    max_blocks: int = 256,
    num_samples: int = 4,
    max_new_tokens: int = 48,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "bf16",
) -> EvalResult:
    """Validation loss and perplexity of the trained weights (and of the initial ones, for contrast)."""
    dev = resolve_device(device)
    val_path = Path(dataset.path) / "val.npy"
    kwargs = {"pad_id": tokenizer.pad_id, "max_blocks": max_blocks, "device": dev, "dtype": dtype}
    initial_loss = None
    if initial_model is not None:
        initial_loss = mean_token_loss(load_pretrained(initial_model.path, device=dev), val_path, **kwargs)
    model = load_pretrained(checkpoint.path, device=dev).eval()
    val_loss = mean_token_loss(model, val_path, **kwargs)
    samples = generate_samples(
        model,
        Tokenizer.from_file(tokenizer.path),
        SAMPLE_PROMPTS[:num_samples],
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        max_new_tokens=max_new_tokens,
        seed=seed,
        device=dev,
    )
    return EvalResult(
        val_loss=val_loss,
        perplexity=math.exp(min(val_loss, 50.0)),
        initial_val_loss=initial_loss,
        samples=tuple(samples),
    )


evaluate_task = task(evaluate, name="evaluate")
