"""evaluate: bits per byte of the validation text (and loss per token), xz's bits per byte on the same
bytes, and a few generated samples.

The validation text is `tasks.scoring`'s, how a model is scored on it the engine's loss
(`tasks.training.loss`); the engine's periodic score uses the same. `rescore` scores a model with another tokenizer on the same text, so models with different
vocabularies compare.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from prefect import task
from tokenizers import Tokenizer

from model import LlamaForPretraining, generate, load_pretrained
from tasks.refs import CheckpointRef, CheckpointScore, DatasetRef, EvalResult, ModelRef, TokenizerRef
from tasks.scoring import ScoringError, ValidationText, encode_documents, validation_text, xz_bits_per_byte
from tasks.training.checkpoint import checkpoint_dirs, is_valid
from tasks.training.checkpoint_weights import whole_weights
from tasks.training.distributed import resolve_device
from tasks.training.loss import score_text, stream_loss
from tasks.training.precision import resolve_dtype

SAMPLE_PROMPTS = ("def ", "class ", "import ", "    for i in range(", "if __name__ ==", "    return ")


def rescore(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    token_ids: dict[str, int],
    text: ValidationText,
    *,
    seq_len: int,
    device: torch.device,
    dtype: str,
) -> float:
    """Bits per byte of a model with its own tokenizer (special ids `token_ids`) on the validation text.

    Its documents are encoded with that tokenizer and joined with its EOS as ours were; the tokenizer must
    spell the text back exactly, or the bytes would not be the same (ScoringError).
    """
    if "eos_id" not in token_ids:
        raise ScoringError("its model_config names no eos_id, which separates the documents")
    eos = int(token_ids["eos_id"])
    tokens = encode_documents(text, tokenizer, {"eos": eos, "bos": int(token_ids.get("bos_id", eos))})
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and int(tokens.max()) >= vocab:
        raise ScoringError(
            f"its tokenizer emits id {int(tokens.max())} beyond the model's {vocab} embeddings"
        )
    nats = stream_loss(model, tokens, context_id=eos, seq_len=seq_len, device=device, dtype=dtype)
    return nats / math.log(2) / len(text.text)


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
    max_blocks: int | None = 256,
    num_samples: int = 4,
    max_new_tokens: int = 48,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "auto",
) -> EvalResult:
    """Bits per byte and loss of the trained weights on the first `max_blocks` validation blocks' text (every
    block when None), and of the initial ones, for contrast, and of the earlier checkpoints kept in the run
    directory; xz's bits per byte on the same bytes, and samples."""
    dev = resolve_device(device)
    dtype = resolve_dtype(dev, dtype)
    text = validation_text(dataset, tokenizer, max_blocks)
    kwargs = {"seq_len": dataset.seq_len, "device": dev, "dtype": dtype}
    initial_loss = initial_bpb = None
    if initial_model is not None:
        initial_loss, initial_bpb = score_text(
            load_pretrained(initial_model.path, device=dev), text, **kwargs
        )
    # A sharded run's checkpoints hold slices: the whole model.safetensors is written here, once.
    model = load_pretrained(checkpoint.path, whole_weights(Path(checkpoint.path)), device=dev).eval()
    val_loss, bits_per_byte = score_text(model, text, **kwargs)
    scores = [
        CheckpointScore(
            step=checkpoint.step, path=checkpoint.path, val_loss=val_loss, bits_per_byte=bits_per_byte
        )
    ]
    for step, path in earlier_checkpoints(checkpoint):
        loss, bpb = score_text(load_pretrained(path, whole_weights(path), device=dev), text, **kwargs)
        scores.append(CheckpointScore(step=step, path=str(path), val_loss=loss, bits_per_byte=bpb))
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
        bits_per_byte=bits_per_byte,
        xz_bits_per_byte=xz_bits_per_byte(text),
        scored_tokens=len(text.tokens),
        scored_bytes=len(text.text),
        text_fingerprint=text.fingerprint,
        dataset_fingerprint=dataset.fingerprint,
        max_blocks=max_blocks,
        dtype=dtype,
        initial_val_loss=initial_loss,
        initial_bits_per_byte=initial_bpb,
        samples=tuple(samples),
        checkpoints=tuple(sorted(scores, key=lambda score: score.step)),
    )


def earlier_checkpoints(checkpoint: CheckpointRef) -> list[tuple[int, Path]]:
    """The valid checkpoints kept in the run directory before the final one (`keep_checkpoints`)."""
    return [
        (step, path)
        for step, path in checkpoint_dirs(Path(checkpoint.run_dir))
        if step < checkpoint.step and is_valid(path)
    ]


evaluate_task = task(evaluate, name="evaluate")
