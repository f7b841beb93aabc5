"""Muon variants for the study: torch.optim.Muon, and one that orthogonalises fused matrices piece by piece.

The project's model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`. torch.optim.Muon
orthogonalises each parameter as one matrix; `SplitMuon` orthogonalises the row blocks (q, k, v; gate, up)
separately, as if they were separate parameters, with the same Newton-Schulz iteration and LR scaling.
"""

from __future__ import annotations

import math

import torch

A, B, C = 3.4445, -4.7750, 2.0315


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    x = g.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x.T if tall else x


_ns_compiled = None


def _ns(g: torch.Tensor, steps: int, compiled: bool) -> torch.Tensor:
    global _ns_compiled
    if not compiled:
        return newton_schulz(g, steps)
    if _ns_compiled is None:
        _ns_compiled = torch.compile(newton_schulz, dynamic=False)
    return _ns_compiled(g, steps)


class SplitMuon(torch.optim.Optimizer):
    """Muon with optional row splits per parameter (`splits[id(p)] = [rows, ...]`)."""

    def __init__(
        self,
        params,
        lr=0.02,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        weight_decay=0.0,
        adjust="original",
        splits=None,
        compiled=True,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                weight_decay=weight_decay,
                adjust=adjust,
            ),
        )
        self.splits = splits or {}
        self.compiled = compiled

    @staticmethod
    def _scale(shape, adjust: str) -> float:
        rows, cols = shape
        if adjust == "match_rms_adamw":
            return 0.2 * math.sqrt(max(rows, cols))
        return math.sqrt(max(1.0, rows / cols))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mom = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                upd = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                rows = self.splits.get(id(p), [p.shape[0]])
                start = 0
                for r in rows:
                    piece = upd[start : start + r]
                    o = _ns(piece, group["ns_steps"], self.compiled)
                    p[start : start + r].add_(
                        o.to(p.dtype), alpha=-lr * self._scale(piece.shape, group["adjust"])
                    )
                    start += r
        return None
