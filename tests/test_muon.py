"""Our Newton-Schulz orthogonalisation and per-matrix learning rate (tasks/training/muon.py, in place of
torch's private `torch.optim._muon`): a step of `ShardedMuon` on whole matrices equals `torch.optim.Muon`'s."""

from __future__ import annotations

import pytest
import torch

from tasks.training import optim
from tasks.training.muon import ShardedMuon, newton_schulz
from tasks.training.settings import TrainSettings

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_our_muon_steps_equal_torch_optim_muon(adjust_lr_fn: str | None) -> None:
    torch.manual_seed(0)
    shapes = [(48, 16), (16, 40), (24, 24)]  # tall (its transpose is orthogonalised), wide, square
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    options = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "adjust_lr_fn": adjust_lr_fn}
    mine, reference = ShardedMuon(ours, **options), torch.optim.Muon(theirs, **options)
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("native", [True, False])
def test_newton_schulz_runs_in_fp32_where_bf16_matmuls_are_emulated(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With native bf16, build_optimizer keeps torch.optim.Muon (bf16, results unchanged); without it (an AVX2
    CPU, where bf16 matmuls are emulated and slower than fp32), ShardedMuon orthogonalises in fp32, which
    also lands closer to the exact iteration (float64) than bf16 does."""
    monkeypatch.setattr(optim, "native_bf16", lambda device_type: native)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(16, 24, bias=False)])  # a decoder block: Muon
    model.norm = torch.nn.RMSNorm(24)  # a gain: AdamW
    settings = TrainSettings(optimizer="muon", muon_ns_steps=4)
    muon = optim.build_optimizer(model, settings, torch.device("cpu")).parts["muon"]
    if native:
        assert type(muon) is torch.optim.Muon
        return
    assert type(muon) is ShardedMuon and muon.ns_dtype == torch.float32
    torch.manual_seed(0)
    update = torch.randn(24, 16)
    exact = newton_schulz(update.double(), NS_COEFFICIENTS, 4, 1e-7, torch.float64)
    fp32, bf16 = (newton_schulz(update, NS_COEFFICIENTS, 4, 1e-7, d) for d in (torch.float32, torch.bfloat16))
    assert fp32.dtype == torch.float32
    assert (fp32.double() - exact).abs().max() < 1e-5 < (bf16.double() - exact).abs().max()
