"""Our Newton-Schulz orthogonalisation and per-matrix learning rate (tasks/training/muon.py, in place of
torch's private `torch.optim._muon`): a step of `ShardedMuon` on whole matrices equals `torch.optim.Muon`'s."""

from __future__ import annotations

import pytest
import torch

from tasks.training.muon import ShardedMuon


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
