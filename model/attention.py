"""Attention kernels of the decoder and the plan that picks one per forward pass.

Three forms compute the same causal (optionally document-masked) grouped-query attention:

* `sdpa`: `F.scaled_dot_product_attention`. The CUDA training path (flash kernel, `is_causal`), and every
  path with padding or a KV cache.
* `matmul`: softmax(q kᵀ·scale + bias) v as two batched matmuls around one fused softmax, with the
  FlashAttention backward written as matmuls (`_MatmulAttention`). The CPU training path: torch 2.13's CPU
  flash-attention backward reaches ~100 GFLOP/s at head_dim 32 and took 29-38% of a demo step; this form
  is 2.2-2.8x faster fwd+bwd and 1.3x faster per step (benchmarks/README.md, "Attention on CPU").
  The T×T scores are materialised, so it is used up to `MATMUL_MAX_SEQ` tokens only.
* `flex`: `flex_attention` with a block mask, for document masking on CUDA (it has no backward on CPU).

Document masking: `document_ids` (batch, seq) give each position's document; a query attends to keys at or
before it in the same document. `document_ids_from_eos` derives them from packed blocks, where EOS closes
each document.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

AttentionBackend = Literal["auto", "sdpa", "matmul"]
# Longest sequence for the matmul form: its (batch, heads, T, T) scores and saved probabilities grow as T².
MATMUL_MAX_SEQ = 1024


class AttentionPlan(NamedTuple):
    """How every layer of one forward pass attends (built once per forward, shared by the layers)."""

    kind: Literal["sdpa", "matmul", "flex"]
    mask: torch.Tensor | None = None  # sdpa: boolean (batch or 1, 1, q, k), True = may attend
    is_causal: bool = False  # sdpa
    bias: torch.Tensor | None = None  # matmul: float32 additive bias (…, q, k), 0 or -inf
    block_mask: Any = None  # flex: a BlockMask


def document_ids_from_eos(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of every position of packed blocks: the number of EOS strictly before it, so an EOS
    belongs to the document it closes and the next token starts a new one."""
    eos = (input_ids == eos_id).to(torch.int32)
    return torch.cumsum(eos, dim=-1) - eos


def causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(seq, device=device)
    return pos[None, :] <= pos[:, None]


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean: causal and inside one document."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal_mask(document_ids.shape[-1], document_ids.device))[:, None]


def _bias(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, float("-inf"))


def make_plan(
    backend: AttentionBackend, device: torch.device, seq: int, document_ids: torch.Tensor | None
) -> AttentionPlan:
    """The training/scoring plan for a whole causal sequence (no padding, no KV cache)."""
    if backend == "auto":
        backend = "matmul" if device.type == "cpu" and seq <= MATMUL_MAX_SEQ else "sdpa"
    if backend == "matmul":
        allowed = causal_mask(seq, device) if document_ids is None else document_causal_mask(document_ids)
        return AttentionPlan("matmul", bias=_bias(allowed))
    if document_ids is None:
        return AttentionPlan("sdpa", is_causal=True)
    if device.type == "cuda":
        return AttentionPlan("flex", block_mask=_document_block_mask(document_ids))
    return AttentionPlan("sdpa", mask=document_causal_mask(document_ids))


def _document_block_mask(document_ids: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (q >= k) & (document_ids[b, q] == document_ids[b, k])

    batch, seq = document_ids.shape
    return create_block_mask(same_document_causal, batch, None, seq, seq, device=document_ids.device)


class _MatmulAttention(torch.autograd.Function):
    """out = softmax(q kᵀ·scale + bias) v, with the FlashAttention backward as matmuls:
    dS = P ⊙ (dP − rowsum(dO ⊙ O)). Saves P in the input dtype; nothing is recomputed, no float32 T×T
    tensor is kept. Under torch.compile both directions are traced and the softmax and dS are fused."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
    ):
        scores = (q * scale) @ k.transpose(-2, -1)
        probs = torch.softmax(scores.float() + bias, dim=-1).to(v.dtype)
        out = probs @ v
        ctx.save_for_backward(q, k, v, probs, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, probs, out = ctx.saved_tensors
        grad_v = probs.transpose(-2, -1) @ grad_out
        grad_probs = grad_out @ v.transpose(-2, -1)
        row = (grad_out.float() * out.float()).sum(-1, keepdim=True)
        grad_scores = (probs.float() * (grad_probs.float() - row)).to(q.dtype)
        grad_q = (grad_scores @ k) * ctx.scale
        grad_k = (grad_scores.transpose(-2, -1) @ q) * ctx.scale
        return grad_q, grad_k, grad_v, None, None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, kv_seq, head_dim). Each key/value head
    serves `heads // kv_heads` consecutive query heads (the layout of Hugging Face's repeat_kv)."""
    groups = q.shape[1] // k.shape[1]
    if plan.kind == "matmul":
        if groups > 1:  # copying k/v is cheap here (a few hundred KB) and keeps every matmul 3-D
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return _MatmulAttention.apply(q, k, v, plan.bias, 1.0 / math.sqrt(q.shape[-1]))
    if plan.kind == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=plan.block_mask, enable_gqa=groups > 1)
    # SDPA's native GQA skips copying k/v on CPU; on CUDA only the flash kernel has it (no mask, half
    # precision), elsewhere it would fall back to the O(T²) math path.
    native_gqa = groups > 1 and (
        q.device.type == "cpu" or (plan.mask is None and q.dtype in (torch.float16, torch.bfloat16))
    )
    if groups > 1 and not native_gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=plan.mask, is_causal=plan.is_causal, enable_gqa=native_gqa
    )
