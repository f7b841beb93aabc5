"""Llama decoder in plain PyTorch: RMSNorm, rotary embeddings (rotate-half, as in Hugging Face),
grouped-query attention (`model/attention.py`), SwiGLU MLP.

Speed choices: the q/k/v projections are one matmul (`qkv_proj`) and so are gate/up (`gate_up_proj`);
`model/hf.py` splits and joins them for Hugging Face interchange. A whole causal sequence (training,
scoring) attends through the fastest kernel for its device (`attention_backend="auto"`: matmul attention on
CPU, SDPA's causal flash kernel on CUDA); padding masks and KV caches go through SDPA. Optional document
masking keeps attention inside each packed document. Optional value embeddings (`config.value_embeds`) mix
a per-token table into the attention values of the first and last layers. Nothing in `forward` syncs with
the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionBackend, AttentionPlan, attend, make_plan
from model.config import LlamaConfig, rope_inverse_frequencies
from model.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, heads, head_dim); cos/sin broadcastable as (B or 1, T, 1, head_dim)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.groups = config.num_key_value_groups
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qk_norm_eps = config.rms_norm_eps if config.qk_norm else None
        # Weights of (own values, value embedding) when a value-embedding table feeds this layer.
        self.value_embed_gate = (
            nn.Parameter(torch.empty(2)) if config.value_embed_index(layer_idx) is not None else None
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv_cache: KVCache | None,
        value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if self.qk_norm_eps is not None:
            q = F.rms_norm(q, (self.head_dim,), eps=self.qk_norm_eps)
            k = F.rms_norm(k, (self.head_dim,), eps=self.qk_norm_eps)
        if self.value_embed_gate is not None and value_embed is not None:
            gate = self.value_embed_gate.to(v.dtype)
            v = gate[0] * v + gate[1] * value_embed.to(v.dtype).view_as(v)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = apply_rotary(q, cos, sin).transpose(1, 2)
        k = apply_rotary(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = attend(q, k, v, plan)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv_cache: KVCache | None,
        value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan, kv_cache, value_embed)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack without the output head (named like Hugging Face's `LlamaModel`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        value_width = config.num_key_value_heads * config.head_dim
        self.value_embeds = nn.ModuleList(
            nn.Embedding(config.vocab_size, value_width) for _ in range(config.value_embeds)
        )


class LlamaForPretraining(nn.Module):
    """Llama decoder with a language-model head. `forward` returns logits; the trainer computes the loss."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # Kernel for whole causal sequences: "auto" (matmul attention on CPU up to MATMUL_MAX_SEQ tokens,
        # else SDPA), or "sdpa" / "matmul" to force one. Not part of the config: the math is the same.
        self.attention_backend: AttentionBackend = "auto"
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._register_rope_tables()
        self.reset_parameters()

    def _register_rope_tables(self, device: torch.device | None = None) -> None:
        inv_freq = rope_inverse_frequencies(self.config).to(device)
        positions = torch.arange(
            self.config.max_position_embeddings, device=device, dtype=torch.int64
        ).float()
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        # Derived from the config, so not saved with the weights.
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # .to(dtype) would round the RoPE tables to bf16, to_empty would leave garbage: rebuild them in float32.
        super()._apply(fn, recurse)
        if self.config.tie_word_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight  # to_empty unties them
        if self.rope_cos.device.type != "meta":
            self._register_rope_tables(self.rope_cos.device)
        return self

    def reset_parameters(self) -> None:
        """normal(0, initializer_range) for every matmul and embedding weight, ones for the norms; zeros for
        o_proj and down_proj with `zero_init_output_projections` (each block starts as the identity);
        value-embedding gates (1, 0.5): the layer's own values at full weight, the table's at half."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, Attention) and module.value_embed_gate is not None:
                with torch.no_grad():
                    module.value_embed_gate.copy_(torch.tensor([1.0, 0.5]))
        if self.config.zero_init_output_projections:
            for layer in self.model.layers:
                nn.init.zeros_(layer.self_attn.o_proj.weight)
                nn.init.zeros_(layer.mlp.down_proj.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab): the head applied to `hidden_states` (same arguments)."""
        return self.lm_head(
            self.hidden_states(
                input_ids, attn_mask, position_ids=position_ids, kv_cache=kv_cache, document_ids=document_ids
            )
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states (batch, seq, hidden) that the head turns into logits.

        attn_mask: optional (batch, past + seq) with 1/True for real tokens and 0/False for padding (past is
        the length already in `kv_cache`). With a mask, positions count real tokens only (left padding works)
        and padded positions get all-zero states (so all-zero logits). Without a mask, no mask tensor is built.
        position_ids: optional (batch, seq) explicit positions. kv_cache: a `KVCache` for incremental decoding.
        document_ids: optional (batch, seq) integers (`model.attention.document_ids_from_eos` for packed
        blocks): a position attends only to positions of the same document. Not with attn_mask or kv_cache.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        batch, seq = input_ids.shape
        past = 0 if kv_cache is None else kv_cache.length
        total = past + seq
        if total > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {total} tokens exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}; shorten the input or raise max_position_embeddings"
            )

        if document_ids is not None and (attn_mask is not None or kv_cache is not None):
            raise ValueError(
                "document_ids masks whole packed sequences; it cannot be combined with attn_mask or kv_cache "
                "(pad or decode without document_ids)"
            )
        if document_ids is not None and document_ids.shape != (batch, seq):
            raise ValueError(
                f"document_ids must have the shape of input_ids {(batch, seq)}, got {tuple(document_ids.shape)}"
            )
        mask, is_causal = None, False
        if attn_mask is not None:
            if attn_mask.shape != (batch, total):
                raise ValueError(
                    f"attn_mask must have shape (batch, past + seq) = {(batch, total)}, got {tuple(attn_mask.shape)}"
                )
            real = attn_mask.bool()
            mask = _padding_causal_mask(real, past, seq)
            if position_ids is None:
                position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        elif past == 0:
            # Not `seq > 1`: under dynamic shapes that is a SymBool, which SDPA refuses (a graph break).
            is_causal = True
        elif seq > 1:
            mask = _padding_causal_mask(None, past, seq, device=input_ids.device)
        if is_causal:
            plan = make_plan(self.attention_backend, input_ids.device, seq, document_ids)
        else:
            plan = AttentionPlan("sdpa", mask=mask)

        if position_ids is None:
            cos = self.rope_cos[past:total].view(1, seq, 1, -1)
            sin = self.rope_sin[past:total].view(1, seq, 1, -1)
        else:
            cos = self.rope_cos[position_ids].unsqueeze(2)
            sin = self.rope_sin[position_ids].unsqueeze(2)

        h = self.model.embed_tokens(input_ids)
        value_embeds = [table(input_ids) for table in self.model.value_embeds]
        for i, layer in enumerate(self.model.layers):
            table = self.config.value_embed_index(i)
            h = layer(h, cos, sin, plan, kv_cache, None if table is None else value_embeds[table])
        h = self.model.norm(h)
        if attn_mask is not None:
            h = h * attn_mask[:, past:, None].to(h.dtype)
        if kv_cache is not None:
            kv_cache.advance(seq)
        return h


def _padding_causal_mask(
    real: torch.Tensor | None, past: int, seq: int, device: torch.device | None = None
) -> torch.Tensor:
    """Boolean (batch or 1, 1, seq, past + seq) mask, True = may attend.

    Queries attend causally to real keys; every query may also attend itself, so a query with no real key
    before it (a padding position) still has a finite softmax instead of NaN. Its output is zeroed later.
    """
    device = real.device if real is not None else device
    q_pos = torch.arange(past, past + seq, device=device)[:, None]
    k_pos = torch.arange(past + seq, device=device)[None, :]
    allowed = k_pos <= q_pos
    if real is None:
        return allowed[None, None]
    return (allowed[None, None] & real[:, None, None, :]) | (k_pos == q_pos)[None, None]
