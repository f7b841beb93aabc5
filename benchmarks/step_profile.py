"""Where one optimizer step of a run preset goes on the CPU, against what its matmul peak allows.

    .venv/bin/python benchmarks/step_profile.py [--preset demo] [--vocab-size N] [--micro-batch-size N]
        [--accumulate-steps N] [--muon-ns-steps N] [--steps 20] [--threads N] [--dtype bf16|fp32] [--tag NAME]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/step_profile.py --dtype fp32 \
        --tag fp32_avx2      # an AVX2 CPU's kernels (what `dtype: auto` trains there) on an AVX-512/AMX host

Builds the preset's model and optimizer exactly as the engine does (`PretrainConfig(preset=...)`,
`build_optimizer`, `LossHead` compiled, bf16 autocast or fp32 (`--dtype`), deterministic algorithms on CPU) and times, per step,
the phases of the engine's step: forward + backward of every micro-batch, gradient clipping, each optimizer
part and zero_grad. Then a torch.profiler pass over a few steps splits forward + backward by kernel: matmuls,
inductor's fused kernels (the cross-entropy ones apart), the rest.

FLOPs: the model's training FLOPs per step (`model.flops_per_token` x tokens) and Muon's Newton-Schulz
matmuls (per matrix and iteration 4·m²·n + 2·m³, m ≤ n its sides). Against the matmul peak (of `--dtype`) measured in
the same run this gives each phase's share of the peak and the **floor**: the time of the preset's whole run
if every FLOP ran at the peak, which bounds what any kernel work can gain. Writes
benchmarks/results/step_profile[_TAG].json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bare_step import PhaseTimes, bare_step, forward_backward  # noqa: E402
from benchmarks.bench_common import (  # noqa: E402
    RESULTS_DIR,
    load_average,
    machine_info,
    markdown_table,
    matmul_peak,
    set_threads,
    write_json,
)
from flows.pretrain_config import PretrainConfig  # noqa: E402
from model import LlamaForPretraining, flops_per_token, get_preset  # noqa: E402
from tasks.training.loss import LossHead  # noqa: E402
from tasks.training.optim import build_optimizer, parameter_roles  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def muon_flops_per_step(model: torch.nn.Module, ns_steps: int) -> float:
    """Newton-Schulz FLOPs of one Muon step: X Xᵀ, A·A and B·X on the m×n orientation (m ≤ n)."""
    total = 0.0
    for param in parameter_roles(model)["hidden"]:
        m, n = sorted(param.shape[-2:])
        total += ns_steps * (4 * m * m * n + 2 * m**3)
    return total


def kernel_split(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int, autocast: bool
) -> dict[str, float]:
    """Self time per step of forward + backward, by kind of kernel."""
    from torch._inductor import config as inductor_config

    assert inductor_config.cpp.enable_kernel_profile  # set before compiling: names inductor's kernels
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            forward_backward(model, batches, autocast=autocast).item()
            for param in model.parameters():
                param.grad = None
    split: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6 / steps
        if event.key in MATMUL_OPS:
            split["matmuls (mm, addmm, bmm)"] += seconds
        elif "log_softmax" in event.key:
            split["fused cross-entropy kernels"] += seconds
        elif event.key.startswith("graph_") and "cpp_fused" in event.key:
            split["other fused kernels (norms, RoPE, SiLU, attention softmax, casts)"] += seconds
        else:
            split["everything else (autograd, wrappers, copies)"] += seconds
    return dict(split)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", default="demo", help="a run preset of flows.pretrain_config (default: demo)"
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="override the preset's micro-batch"
    )
    parser.add_argument(
        "--accumulate-steps", type=int, default=None, help="override the preset's accumulation"
    )
    parser.add_argument(
        "--muon-ns-steps", type=int, default=None, help="override the preset's Newton-Schulz iterations"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps after 3 warm-up steps")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--peak-size", type=int, default=2048, help="n of the n³ matmul peak")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16 autocast, or fp32")
    parser.add_argument(
        "--no-native-bf16",
        action="store_true",
        help="build the optimizer as on a CPU without native bf16 (with AVX2 dispatch emulated on a bf16 host)",
    )
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    from torch._inductor import config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True
    threads = set_threads(args.threads)
    autocast = args.dtype == "bf16"
    peak_dtype = torch.bfloat16 if autocast else torch.float32
    device = torch.device("cpu")
    given = {
        "vocab_size": args.vocab_size,
        "micro_batch_size": args.micro_batch_size,
        "accumulate_steps": args.accumulate_steps,
        "muon_ns_steps": args.muon_ns_steps,
    }
    overrides = {key: value for key, value in given.items() if value is not None}
    config = PretrainConfig(preset=args.preset, **overrides)
    settings = config.train_settings()
    model_config = get_preset(config.model, vocab_size=config.vocab_size, **config.model_overrides)
    load_before = load_average()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    plain = LlamaForPretraining(model_config).train()
    if args.no_native_bf16:
        from tasks.training import optim

        optim.native_bf16 = lambda device_type: False  # type: ignore[assignment]
    optimizer = build_optimizer(plain, settings, device)
    model = torch.compile(LossHead(plain), dynamic=False)
    shape = (settings.micro_batch_size, config.seq_len)
    batches = [
        (torch.randint(0, model_config.vocab_size, shape), torch.randint(0, model_config.vocab_size, shape))
        for _ in range(settings.accumulate_steps)
    ]
    tokens = settings.micro_batch_size * config.seq_len * settings.accumulate_steps

    params = [p for p in plain.parameters() if p.requires_grad]

    def timed_step() -> dict[str, float]:
        times = PhaseTimes()
        with times("step"):
            bare_step(model, params, optimizer, batches, settings.grad_clip, times, autocast=autocast)
        return times.seconds

    start = time.perf_counter()
    timed_step()
    first_step_s = time.perf_counter() - start
    for _ in range(3):
        timed_step()
    runs = [timed_step() for _ in range(args.steps)]
    phases = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    split = kernel_split(model, batches, args.profile_steps, autocast)
    peak = matmul_peak(device, peak_dtype, args.peak_size)["flops_per_s"]
    load_after = load_average()

    model_flops = flops_per_token(model_config, config.seq_len) * tokens
    muon_flops = muon_flops_per_step(plain, settings.muon_ns_steps) if "muon" in optimizer.parts else 0.0
    step_s = phases.pop("step")
    flops = {"forward + backward": model_flops, "optimizer: muon": muon_flops}
    rows, table = [], []
    for name, seconds in phases.items():
        row: dict[str, Any] = {
            "phase": name,
            "ms": round(seconds * 1e3, 1),
            "share": round(seconds / step_s, 3),
        }
        if flops.get(name):
            row["gflop"] = round(flops[name] / 1e9, 1)
            row["of_peak"] = round(flops[name] / seconds / peak, 3)
        rows.append(row)
        of_peak = f"{row['of_peak']:.0%}" if "of_peak" in row else ""
        table.append([name, row["ms"], f"{row['share']:.0%}", row.get("gflop", ""), of_peak])
    fb = phases["forward + backward"]
    kernels = [
        {"kernels": name, "ms": round(s * 1e3, 1), "share_of_forward_backward": round(s / fb, 3)}
        for name, s in sorted(split.items(), key=lambda item: -item[1])
    ]
    run_steps = settings.max_steps or 0
    floor_step_s = (model_flops + muon_flops) / peak
    result = {
        "command": "python benchmarks/step_profile.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(device),
        "threads": threads,
        "load_average_before_after": [load_before, load_after],
        "preset": args.preset,
        "model": model_config.to_dict(),
        "tokens_per_step": tokens,
        "first_step_s": round(first_step_s, 1),
        "step_ms_median": round(step_s * 1e3, 1),
        "tokens_per_s": round(tokens / step_s),
        "dtype": args.dtype,
        "muon": repr(optimizer.parts["muon"].__class__)
        + f" ns_dtype={getattr(optimizer.parts['muon'], 'ns_dtype', torch.bfloat16)}"
        if "muon" in optimizer.parts
        else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "matmul_peak_gflops": round(peak / 1e9),
        "phases": rows,
        "forward_backward_kernels": kernels,
        "flops_per_step_g": round((model_flops + muon_flops) / 1e9, 1),
        "achieved_of_peak": round((model_flops + muon_flops) / step_s / peak, 3),
        "floor_step_ms": round(floor_step_s * 1e3, 1),
        "run_steps": run_steps,
        "run_training_s_measured_rate": round(run_steps * step_s, 1),
        "run_training_s_floor": round(run_steps * floor_step_s, 1),
    }
    print(markdown_table(["phase", "ms / step", "share", "GFLOP", f"of {args.dtype} peak"], table))
    print(
        markdown_table(
            ["forward + backward by kernel", "ms / step", "share"],
            [[k["kernels"], k["ms"], f"{k['share_of_forward_backward']:.0%}"] for k in kernels],
        )
    )
    print(
        f"step {step_s * 1e3:.0f} ms ({tokens / step_s:,.0f} tokens/s), {result['flops_per_step_g']} GFLOP: "
        f"{result['achieved_of_peak']:.0%} of the measured {args.dtype} peak ({peak / 1e9:,.0f} GFLOP/s). At the peak "
        f"the step would take {floor_step_s * 1e3:.0f} ms: {run_steps} steps >= {run_steps * floor_step_s:.0f} s "
        f"(at the measured rate {run_steps * step_s:.0f} s). Load {load_before} -> {load_after}."
    )
    name = f"step_profile_{args.tag}.json" if args.tag else "step_profile.json"
    print(f"wrote {write_json(RESULTS_DIR / name, result)}")


if __name__ == "__main__":
    main()
