"""Muon under FSDP2 gives Muon's update: each hidden matrix orthogonalised whole (`ShardedMuon`), not the
block of rows each rank holds.

Run by pytest, the tests launch 2 gloo ranks with torchrun. Run by torchrun, this file is the ranks' side
(`python -m torch.distributed.run --nproc_per_node 2 tests/test_training_fsdp_muon.py MODEL_DIR OUT.json`):
one optimizer step on a global batch split over the ranks, once with ShardedMuon and once with
`PerShardMuon`, a deliberately broken variant that orthogonalises each rank's rows alone; rank 0 repeats
the step in one process with torch.optim.Muon and writes how far each variant landed from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from model import LlamaConfig, get_preset, load_pretrained
from tasks.training import TrainSettings, fit, read_metrics
from tasks.training import optim as optim_module
from tasks.training.distributed import leave_process_group
from tasks.training.loss import LossHead, count_targets
from tasks.training.muon import ShardedMuon, adjusted_lr, newton_schulz
from tasks.training.optim import build_optimizer, parameter_roles
from tasks.training.parallelize import parallelize

VOCAB = 96
SEQ = 16
SETTINGS = dict(optimizer="muon", lr=3e-3, muon_lr=0.04, compile=False, dtype="fp32", device="cpu")


class PerShardMuon(ShardedMuon):
    """BROKEN ON PURPOSE: torch.optim.Muon applied to each rank's rows of each matrix, as if the shard were
    the matrix (what stepping torch.optim.Muon on the local tensors of FSDP2 parameters gives). The test
    below must tell it apart from ShardedMuon."""

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        group = self.param_groups[0]
        for param in group["params"]:
            local, grad = param.to_local(), param.grad.to_local()
            buf = self.state[param].setdefault("momentum_buffer", torch.zeros_like(grad))
            buf.lerp_(grad, 1 - group["momentum"])
            update = newton_schulz(
                grad.lerp(buf, group["momentum"]), group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(update, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], param.shape))


def one_step_on_ranks(model_dir: Path, out: Path) -> None:
    """The ranks' side (under torchrun)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    config = LlamaConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    settings = TrainSettings(data_parallel="fsdp", **SETTINGS)  # type: ignore[arg-type]
    cpu = torch.device("cpu")
    batch = torch.randint(3, VOCAB, (2 * world, SEQ + 1), generator=torch.Generator().manual_seed(0))
    halves = [batch[2 * r : 2 * r + 2] for r in range(world)]
    n_tokens = count_targets([b[:, 1:] for b in halves])
    stepped = {}
    for name, muon in (("sharded", ShardedMuon), ("per_shard", PerShardMuon)):
        optim_module.ShardedMuon = muon  # what build_optimizer picks for DTensor parameters
        parallel = parallelize(config, model_dir, settings, cpu, eos_id=None)
        optimizer = build_optimizer(parallel.plain, settings, cpu)
        assert type(optimizer.parts["muon"]) is muon
        with parallel.micro_batch(last=True):
            (parallel.model(halves[rank][:, :-1], halves[rank][:, 1:]) / n_tokens).backward()
        optimizer.step()
        stepped[name] = parallel.full_state_dict()
    if rank == 0:
        plain = load_pretrained(config, model_dir)
        initial = {k: v.clone() for k, v in plain.state_dict().items()}
        optimizer = build_optimizer(plain, TrainSettings(**SETTINGS), cpu)  # type: ignore[arg-type]
        hidden = {
            n for n, p in plain.named_parameters() if any(p is h for h in parameter_roles(plain)["hidden"])
        }
        for half in halves:  # accumulated in rank order: the sum the reduce-scatter forms
            (LossHead(plain)(half[:, :-1], half[:, 1:]) / n_tokens).backward()
        optimizer.step()
        whole = plain.state_dict()
        report = {
            name: {
                k: float((state[k] - whole[k]).norm() / (whole[k] - initial[k]).norm())
                for k in sorted(hidden)
            }
            for name, state in stepped.items()
        }
        out.write_text(json.dumps(report, indent=2))
    leave_process_group()


def test_sharded_muon_step_equals_one_process_and_a_per_shard_muon_does_not(tmp_path: Path) -> None:
    from synthetic import model_ref  # here: the ranks' side does without the build stage's imports

    model = model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ), seed=0)
    out = tmp_path / "report.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)]),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    subprocess.run([*command, __file__, model.path, str(out)], env=env, check=True, timeout=600)
    report = json.loads(out.read_text())
    # Same gradients (the same sums), so each whole matrix's update is the one-process update.
    assert max(report["sharded"].values()) < 1e-6, report["sharded"]
    # Orthogonalising each rank's rows alone moves every matrix elsewhere: the check above catches it.
    assert min(report["per_shard"].values()) > 1e-2, report["per_shard"]


def test_muon_through_fit_on_two_fsdp_ranks_equals_one_process(tmp_path: Path) -> None:
    from synthetic import model_ref, pattern_blocks, write_packed_dataset

    blocks = pattern_blocks(24, SEQ, VOCAB, 3)
    dataset = write_packed_dataset(
        tmp_path / "packed", blocks, pattern_blocks(4, SEQ, VOCAB, 4), vocab_size=VOCAB
    )
    model = model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ), seed=0)

    def settings(nproc: int) -> TrainSettings:
        # One micro-batch per rank: the reduce-scatter adds the same two gradients one process accumulates,
        # so Muon (whose bf16 Newton-Schulz magnifies float32 rounding) sees the same gradient. The clip
        # threshold is never reached: clipping with the norm of a different summation would differ.
        return TrainSettings(
            **SETTINGS,  # type: ignore[arg-type]
            micro_batch_size=4,
            accumulate_steps=2 // nproc,
            nproc_per_node=nproc,
            data_parallel="fsdp",
            max_steps=3,
            grad_clip=100.0,
        )

    fsdp = fit(model, dataset, settings(2), tmp_path / "fsdp", progress=False)
    single = fit(model, dataset, settings(1), tmp_path / "single", progress=False)
    assert fsdp.step == single.step == 3
    for name in ("train/loss", "train/grad_norm"):
        a = [m[name] for _, m in sorted(read_metrics(fsdp.run_dir).items())]
        b = [m[name] for _, m in sorted(read_metrics(single.run_dir).items())]
        np.testing.assert_allclose(a, b, rtol=1e-5, err_msg=name)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(
            "usage: torchrun --nproc_per_node 2 tests/test_training_fsdp_muon.py MODEL_DIR OUT.json"
        )
    one_step_on_ranks(Path(sys.argv[1]), Path(sys.argv[2]))
