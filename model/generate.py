"""Autoregressive sampling with a key/value cache, for batches of left-padded prompts."""

from __future__ import annotations

import torch

from model.kv_cache import KVCache
from model.llama import LlamaForPretraining
from model.weights import unwrap


def _check_arguments(
    model: LlamaForPretraining,
    input_ids: torch.Tensor,
    attn_mask: torch.Tensor | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be a non-empty (batch, seq) tensor, got shape {tuple(input_ids.shape)}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be None or >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p}")
    vocab = model.config.vocab_size
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(
            f"input_ids hold ids outside [0, {vocab}); encode with the tokenizer the model was trained with"
        )
    limit = model.config.max_position_embeddings
    if input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds "
            f"max_position_embeddings {limit}; shorten the prompt or generate fewer tokens"
        )
    if attn_mask is not None:
        if attn_mask.shape != input_ids.shape:
            raise ValueError(
                f"attn_mask shape {tuple(attn_mask.shape)} differs from input_ids {tuple(input_ids.shape)}"
            )
        real = attn_mask.bool()
        if not real[:, -1].all() or (real[:, 1:].int() < real[:, :-1].int()).any():
            raise ValueError(
                "prompts must be left-padded (padding first, then the tokens, the last column real in every "
                "row); pad on the left, e.g. tokenizer.padding_side = 'left'"
            )


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (batch,) from last-position logits (batch, vocab); temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens more likely than it already cover top_p; the first always stays.
        drop = probs.cumsum(dim=-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Continue each prompt; returns (batch, prompt_len + new) token ids, prompts included.

    Prompts of different lengths are left-padded, with `attn_mask` 1 for real tokens; positions count real
    tokens only. A row that emits `eos_token_id` is finished: later positions hold `pad_token_id`. Generation
    stops early when every row is finished. A compiled model is run through its plain module (shapes change
    every step). Runs under whatever autocast the caller set.
    """
    plain = unwrap(model)
    if not isinstance(plain, LlamaForPretraining):
        raise TypeError(
            f"generate expects a LlamaForPretraining (possibly compiled), got {type(plain).__name__}"
        )
    _check_arguments(plain, input_ids, attn_mask, max_new_tokens, temperature, top_k, top_p)
    batch, prompt_len = input_ids.shape
    if max_new_tokens == 0:
        return input_ids.clone()

    was_training = plain.training
    plain.eval()
    try:
        tokens = input_ids.long()
        # Without padding, the mask-free causal path is exact and faster.
        mask = None if attn_mask is None or bool(attn_mask.all()) else attn_mask.long()
        cache = KVCache(plain.config, batch, prompt_len + max_new_tokens) if use_cache else None
        step_input = tokens
        finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
        for _ in range(max_new_tokens):
            logits = plain(step_input, mask, kv_cache=cache) if cache is not None else plain(tokens, mask)
            next_token = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
            next_token = torch.where(finished, torch.full_like(next_token, pad_token_id), next_token)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step_input = next_token[:, None]
            if eos_token_id is not None:
                finished |= next_token == eos_token_id
                if bool(finished.all()):
                    break
        return tokens
    finally:
        plain.train(was_training)
