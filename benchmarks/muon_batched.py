"""Muon's step as torch.optim.Muon runs it (one matrix at a time) against the same Newton-Schulz batched by shape.

    .venv/bin/python benchmarks/muon_batched.py [--preset demo] [--rounds 6] [--steps 10] [--threads N]

A lever measurement, not a product path: the preset's hidden matrices (exactly the ones `build_optimizer` gives
Muon) get fixed random gradients; variant `torch` is `torch.optim.Muon.step()`; variant `batched` computes the
same update with each group of equal (m ≤ n) shapes stacked and orthogonalised by one `bmm` per product, the
same quintic coefficients and bf16 arithmetic; `batched-compiled` is that function under torch.compile. The
variants take turns, round by round, in one process; the first call of each is not timed. The updates of
`batched` are compared with torch's (max abs difference, bf16 arithmetic in both).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, set_threads, write_json  # noqa: E402
from flows.pretrain_config import PretrainConfig  # noqa: E402
from model import LlamaForPretraining  # noqa: E402
from tasks.training.muon import adjusted_lr  # noqa: E402
from tasks.training.optim import parameter_roles  # noqa: E402

# torch.optim.Muon's own constants and learning-rate rule, so that both variants compute the same update.
_MUON_DEFAULTS = inspect.signature(torch.optim.Muon).parameters
NS_COEFFICIENTS = _MUON_DEFAULTS["ns_coefficients"].default
EPS = _MUON_DEFAULTS["eps"].default


def orthogonalise_batched(updates: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton-Schulz on a (B, m, n) stack with m <= n, per matrix exactly as torch.optim.Muon computes it."""
    a, b, c = NS_COEFFICIENTS
    x = updates.bfloat16()
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + torch.baddbmm(gram, gram, gram, beta=b, alpha=c) @ x
    return x


def batched_muon_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    lr: float,
    momentum: float,
    steps: int,
    adjust_lr_fn: str,
    orthogonalise: Callable[[torch.Tensor, int], torch.Tensor],
) -> None:
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        groups[tuple(sorted(p.shape))].append(i)
    for indices in groups.values():
        stack = []
        for i in indices:
            bufs[i].lerp_(grads[i], 1 - momentum)
            update = grads[i].lerp(bufs[i], momentum)
            stack.append(update.mT if update.size(0) > update.size(1) else update)
        ortho = orthogonalise(torch.stack(stack), steps)
        for k, i in enumerate(indices):
            o = ortho[k].mT if params[i].size(0) > params[i].size(1) else ortho[k]
            params[i].add_(o, alpha=-adjusted_lr(lr, adjust_lr_fn, params[i].shape))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per variant and round")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    config = PretrainConfig(preset=args.preset)
    settings = config.train_settings()
    torch.manual_seed(0)
    model = LlamaForPretraining(config.llama_config())
    hidden = parameter_roles(model)["hidden"]
    grads = [torch.randn_like(p) * 1e-2 for p in hidden]
    load_before = load_average()

    def torch_variant() -> tuple[list[torch.Tensor], Callable[[], None]]:
        params = [p.detach().clone().requires_grad_() for p in hidden]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt = torch.optim.Muon(
            params, lr=settings.muon_lr, momentum=settings.muon_momentum, nesterov=True,
            ns_steps=settings.muon_ns_steps, adjust_lr_fn=settings.muon_adjust_lr, weight_decay=0.0,
        )  # fmt: skip
        return params, opt.step

    def batched_variant(compiled: bool) -> tuple[list[torch.Tensor], Callable[[], None]]:
        params = [p.detach().clone() for p in hidden]
        bufs = [torch.zeros_like(p) for p in hidden]
        fn = torch.compile(orthogonalise_batched, dynamic=False) if compiled else orthogonalise_batched
        return params, lambda: batched_muon_step(
            params, grads, bufs, settings.muon_lr, settings.muon_momentum, settings.muon_ns_steps,
            settings.muon_adjust_lr, fn,
        )  # fmt: skip

    # Agreement: one step of each from the same weights and gradients.
    (ref, ref_step), (mine, mine_step) = torch_variant(), batched_variant(False)
    ref_step()
    mine_step()
    max_diff = max((a.detach() - b).abs().max().item() for a, b in zip(ref, mine, strict=True))
    step_size = max((a.detach() - h.detach()).abs().max().item() for a, h in zip(ref, hidden, strict=True))

    variants = {
        "torch": torch_variant()[1],
        "batched": batched_variant(False)[1],
        "batched-compiled": batched_variant(True)[1],
    }
    for step in variants.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, step in variants.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    load_after = load_average()
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "command": "python benchmarks/muon_batched.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(torch.device("cpu")),
        "threads": threads,
        "load_average_before_after": [load_before, load_after],
        "matrices": [list(p.shape) for p in hidden],
        "ms_per_step_by_round": times,
        "ms_per_step_median": {k: round(v, 2) for k, v in medians.items()},
        "ratio_to_torch": {k: round(v / medians["torch"], 3) for k, v in medians.items()},
        "max_abs_update_difference": max_diff,
        "max_abs_update": step_size,
    }
    for name in variants:
        print(f"{name:18s} {medians[name]:7.2f} ms/step  ({medians[name] / medians['torch']:.2f}x torch)")
    print(
        f"update difference vs torch: {max_diff:.3g} (largest update {step_size:.3g}); load {load_before} -> {load_after}"
    )
    print(f"wrote {write_json(RESULTS_DIR / 'muon_batched.json', result)}")


if __name__ == "__main__":
    main()
