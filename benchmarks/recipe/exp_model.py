"""Experimental Llama for the recipe study: the project's model (model/llama.py) plus switchable levers.

With every lever off it computes exactly what `model.LlamaForPretraining` computes (same parameter names,
same init), which `check_equivalence()` verifies on shared weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ExpConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    # levers
    qk_norm: bool = False
    zero_init_out: bool = False  # o_proj and down_proj start at zero
    zero_init_head: bool = False  # untied head starts at zero
    mlp: str = "swiglu"  # swiglu | relu2
    logit_softcap: float = 0.0  # 0 = off
    document_mask: bool = False
    eos_id: int = 1
    value_embeds: int = 0  # number of value-embedding tables (first and last layers), 0 = off
    embed_norm: bool = False  # RMS-normalise the embedding output (modded-nanogpt)
    extra: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


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


def document_causal_mask(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, 1, T, T) bool: query i may see key j iff j <= i and both lie in the same document.

    A document ends with its EOS (the EOS belongs to the document it closes); the next token starts a new one.
    """
    is_eos = (input_ids == eos_id).to(torch.int32)
    doc = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens before position i
    seq = input_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
    same = doc[:, :, None] == doc[:, None, :]
    return (same & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, c: ExpConfig, layer_idx: int) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.qk_norm = c.qk_norm
        self.eps = c.rms_norm_eps
        self.has_ve = False
        if c.value_embeds and (
            layer_idx < c.value_embeds or layer_idx >= c.num_hidden_layers - c.value_embeds
        ):
            self.has_ve = True
            self.ve_gate = nn.Parameter(torch.tensor([1.0, 0.5]))

    def forward(self, x, cos, sin, mask, ve=None):
        b, t, _ = x.shape
        qkv = self.qkv_proj(x).view(b, t, self.nh + 2 * self.nkv, self.hd)
        q, k, v = qkv.split([self.nh, self.nkv, self.nkv], dim=2)
        if self.qk_norm:
            q = F.rms_norm(q, (self.hd,), eps=self.eps)
            k = F.rms_norm(k, (self.hd,), eps=self.eps)
        if self.has_ve and ve is not None:
            v = self.ve_gate[0].to(v.dtype) * v + self.ve_gate[1].to(v.dtype) * ve.view_as(v)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = (q * cos + rotate_half(q) * sin).transpose(1, 2)
        k = (k * cos + rotate_half(k) * sin).transpose(1, 2)
        v = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.nh != self.nkv
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c: ExpConfig) -> None:
        super().__init__()
        self.kind = c.mlp
        if c.mlp == "swiglu":
            self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        else:
            self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        if self.kind == "swiglu":
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.relu(self.up_proj(x)).square())


class DecoderLayer(nn.Module):
    def __init__(self, c: ExpConfig, i: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, i)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask, ve=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, ve)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c: ExpConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class ExpLlama(nn.Module):
    def __init__(self, c: ExpConfig) -> None:
        super().__init__()
        self.config = c
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if c.value_embeds:
            self.value_embeds = nn.ModuleList(
                nn.Embedding(c.vocab_size, c.num_key_value_heads * c.head_dim) for _ in range(c.value_embeds)
            )
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
        pos = torch.arange(c.max_position_embeddings, dtype=torch.int64).float()
        ang = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], dim=-1)
        self.register_buffer("rope_cos", ang.cos(), persistent=False)
        self.register_buffer("rope_sin", ang.sin(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        c = self.config
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if module is self.lm_head and c.tie_word_embeddings:
                    continue
                nn.init.normal_(module.weight, mean=0.0, std=c.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if c.zero_init_out:
            for layer in self.model.layers:
                nn.init.zeros_(layer.self_attn.o_proj.weight)
                nn.init.zeros_(layer.mlp.down_proj.weight)
        if c.zero_init_head and not c.tie_word_embeddings:
            nn.init.zeros_(self.lm_head.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        t = input_ids.shape[1]
        mask = document_causal_mask(input_ids, c.eos_id) if c.document_mask else None
        cos = self.rope_cos[:t].view(1, t, 1, -1)
        sin = self.rope_sin[:t].view(1, t, 1, -1)
        h = self.model.embed_tokens(input_ids)
        if c.embed_norm:
            h = F.rms_norm(h, (h.shape[-1],), eps=c.rms_norm_eps)
        ves = [emb(input_ids) for emb in self.value_embeds] if c.value_embeds else []
        n = c.num_hidden_layers
        for i, layer in enumerate(self.model.layers):
            ve = None
            if ves:
                if i < c.value_embeds:
                    ve = ves[i]
                elif i >= n - c.value_embeds:
                    ve = ves[i - (n - c.value_embeds)]
            h = layer(h, cos, sin, mask, ve)
        logits = self.lm_head(self.model.norm(h))
        if c.logit_softcap:
            logits = c.logit_softcap * torch.tanh(logits / c.logit_softcap)
        return logits


def check_equivalence() -> float:
    """Max |logit difference| between ExpLlama (levers off) and the project's model on the same weights."""
    from model import LlamaForPretraining, get_preset

    torch.manual_seed(0)
    c = ExpConfig()  # the round-2 demo shape the lever table was measured on
    shape = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    ref = LlamaForPretraining(get_preset("demo", **{name: getattr(c, name) for name in shape}))
    exp = ExpLlama(c)
    missing, unexpected = exp.load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(0, 8192, (2, 64))
    with torch.no_grad():
        return float((ref(ids) - exp(ids)).abs().max())


if __name__ == "__main__":
    print("max |diff| vs model.LlamaForPretraining:", check_equivalence())
