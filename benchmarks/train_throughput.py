"""Training throughput of our Llama against transformers' LlamaForCausalLM, in one process and one run.

    .venv/bin/python benchmarks/train_throughput.py                       # demo preset, batch 8 x 256, CPU
    .venv/bin/python benchmarks/train_throughput.py --preset small --variants ours-compiled-bf16,hf-compiled-bf16
    .venv/bin/python benchmarks/train_throughput.py --device cuda --preset 125m --seq-len 1024

Every variant trains the same weights (ours exported with `export_hf` and loaded by
`LlamaForCausalLM.from_pretrained(attn_implementation="sdpa")`) on the same batches: forward, mean
cross-entropy in float32 outside the model, backward, AdamW step (fused on CUDA). The first step of every
variant runs on the same batch from the same weights; its losses must agree within bf16 noise or the script
fails. The first step (compilation) and `--warmup` more steps are left out and reported as compile time.
Then `--rounds` rounds each run `--steps` steps of every variant in turn, so that machine drift (other
processes, thermal) hits all variants alike; tokens/s comes from the median step time over all rounds.

MFU = flops_per_token(config, seq_len) x tokens/s / peak, where the peak is a measured matmul peak of this
device in the variant's dtype (and, on a known GPU, also the spec-sheet dense peak: 989 TFLOP/s bf16 for
H100/H200). Writes a markdown table to stdout, benchmarks/results/train_throughput.json and a bar chart
benchmarks/results/train_throughput.png (suffixed with `--tag` when given).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_common import (  # noqa: E402
    RESULTS_DIR,
    gpu_spec_peak,
    load_average,
    machine_info,
    markdown_table,
    matmul_peak,
    percentile,
    set_threads,
    synchronize,
    write_json,
)
from model import LlamaConfig, LlamaForPretraining, count_params, export_hf, flops_per_token, get_preset  # noqa: E402

# name -> (implementation, compiled, dtype)
VARIANTS: dict[str, tuple[str, bool, str]] = {
    "ours-eager-fp32": ("ours", False, "fp32"),
    "ours-eager-bf16": ("ours", False, "bf16"),
    "ours-compiled-bf16": ("ours", True, "bf16"),
    "hf-eager-bf16": ("hf", False, "bf16"),
    "hf-compiled-bf16": ("hf", True, "bf16"),
    # Levers, not in the default set: the loss inside the compiled graph; fp32 compiled.
    "ours-compiled-bf16-loss-in-graph": ("ours", True, "bf16"),
    "hf-compiled-bf16-loss-in-graph": ("hf", True, "bf16"),
    "ours-compiled-fp32": ("ours", True, "fp32"),
    # The attention lever: our model forced back onto SDPA (torch's CPU flash kernel), loss in the graph.
    "ours-compiled-bf16-loss-in-graph-sdpa": ("ours", True, "bf16"),
    # fp32 (what `dtype: auto` trains on CPUs without bf16 in hardware), the loss in the graph on both sides.
    "ours-compiled-fp32-loss-in-graph": ("ours", True, "fp32"),
    "hf-compiled-fp32-loss-in-graph": ("hf", True, "fp32"),
}
DEFAULT_VARIANTS = [
    "ours-eager-fp32",
    "ours-eager-bf16",
    "ours-compiled-bf16",
    "hf-eager-bf16",
    "hf-compiled-bf16",
]
# First-step loss tolerance against the float32 reference. Mean CE of ~2k tokens at init is ~ln(vocab);
# bf16 autocast moves it by a few 1e-3, a wrong weight copy or mask by far more than this.
BF16_LOSS_TOLERANCE = 2e-2
# AdamW implementations: "fused" (one kernel over all tensors; CPU and CUDA), "foreach" (multi-tensor ops),
# "for-loop" (a Python loop over the parameters: torch's default for CPU tensors).
OPTIMIZER_IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "for-loop": {"foreach": False},
}
FP32_LOSS_TOLERANCE = 1e-4


@dataclass
class Variant:
    name: str
    impl: str
    compiled: bool
    dtype: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    first_step_s: float = 0.0
    warmup_s: list[float] = field(default_factory=list)
    first_loss: float = float("nan")
    step_s: list[float] = field(default_factory=list)
    round_medians_s: list[float] = field(default_factory=list)


def mean_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_hf(ours: LlamaForPretraining, work: Path) -> nn.Module:
    from transformers import LlamaForCausalLM

    directory = export_hf(ours, work / "hf")
    hf = LlamaForCausalLM.from_pretrained(directory, attn_implementation="sdpa", dtype=torch.float32)
    hf.config.use_cache = False
    hf.train()
    return hf


def make_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    impl: str,
    dtype: str,
    device: torch.device,
    compiled: bool,
    loss_in_graph: bool,
    compile_kwargs: dict[str, Any],
) -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(the module that runs forward, a function doing one full training step and returning the loss)."""
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if dtype == "bf16"
        else contextlib.nullcontext
    )

    def logits_of(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return module(inputs) if impl == "ours" else module(input_ids=inputs, use_cache=False).logits

    if loss_in_graph:

        def forward_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with autocast():
                logits = logits_of(model, inputs)
            return mean_ce(logits, targets)

        loss_fn = torch.compile(forward_loss, dynamic=False, **compile_kwargs)
        runner = model
    else:
        runner = torch.compile(model, dynamic=False, **compile_kwargs) if compiled else model

        def loss_fn(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with autocast():
                logits = logits_of(runner, inputs)
            return mean_ce(logits, targets)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return runner, step


def build_variants(
    names: list[str],
    config: LlamaConfig,
    device: torch.device,
    work: Path,
    compile_kwargs: dict[str, Any],
    lr: float,
    optimizer_impl: str,
) -> list[Variant]:
    torch.manual_seed(0)
    reference = LlamaForPretraining(config)  # every variant starts from these weights
    reference_state = {k: v.clone() for k, v in reference.state_dict().items()}
    hf_template = build_hf(reference, work) if any(VARIANTS[n][0] == "hf" for n in names) else None
    hf_state = (
        {k: v.clone() for k, v in hf_template.state_dict().items()} if hf_template is not None else None
    )
    variants = []
    for name in names:
        impl, compiled, dtype = VARIANTS[name]
        if impl == "ours":
            model: nn.Module = LlamaForPretraining(config)
            model.load_state_dict(reference_state)
            if name.endswith("-sdpa"):
                model.attention_backend = "sdpa"
        else:
            assert hf_template is not None and hf_state is not None
            model = type(hf_template)(hf_template.config)
            model.load_state_dict(hf_state)
            model.config.use_cache = False
        model.to(device).train()
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=lr,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            **OPTIMIZER_IMPLEMENTATIONS[optimizer_impl],
        )
        runner, step = make_step(
            model, optimizer, impl, dtype, device, compiled, "loss-in-graph" in name, compile_kwargs
        )
        variants.append(Variant(name, impl, compiled, dtype, runner, optimizer, step))
    return variants


def timed_step(
    variant: Variant, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> tuple[float, float]:
    synchronize(device)
    start = time.perf_counter()
    loss = variant.step_fn(*batch)
    synchronize(device)
    return time.perf_counter() - start, float(loss)


def profile_step(
    variant: Variant, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device, top: int
) -> list[dict[str, Any]]:
    """The `top` ops of one training step by self time (CPU, or CUDA kernels on a GPU), with their share."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_step(variant, batch, device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [
        {
            "op": e.key,
            "self_ms": round(getattr(e, attr) / 1000, 3),
            "share": round(getattr(e, attr) / total, 4),
            "calls": e.count,
        }
        for e in events[:top]
    ]


def check_first_losses(variants: list[Variant], device: torch.device) -> dict[str, Any]:
    """Every variant's first loss against the float32 reference (ours eager fp32 when present)."""
    reference = next((v for v in variants if v.dtype == "fp32"), variants[0])
    # On CUDA float32 matmuls run in TF32 (10-bit mantissa): bf16-sized noise even between fp32 variants.
    exact_fp32 = device.type == "cpu"
    failures, deltas = [], {}
    for v in variants:
        both_fp32 = v.dtype == reference.dtype == "fp32" and exact_fp32
        tolerance = FP32_LOSS_TOLERANCE if both_fp32 else BF16_LOSS_TOLERANCE
        delta = abs(v.first_loss - reference.first_loss)
        deltas[v.name] = delta
        if not delta <= tolerance:
            failures.append(
                f"{v.name}: {v.first_loss:.5f} vs {reference.name} {reference.first_loss:.5f} "
                f"(|Δ| {delta:.2e} > {tolerance:.0e})"
            )
    if failures:
        raise SystemExit(
            "FIRST-STEP LOSSES DISAGREE: the variants do not compute the same model, so their speeds are not "
            "comparable:\n  " + "\n  ".join(failures)
        )
    return {"reference": reference.name, "abs_delta": deltas}


def make_batches(
    n: int, batch: int, seq_len: int, vocab: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        block = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
        out.append((block[:, :-1].contiguous().to(device), block[:, 1:].contiguous().to(device)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="demo", help="model preset (tiny, demo, small, 125m, 350m, 1b)")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--untied", action="store_true", help="an untied output head")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs every variant in turn")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compile) step")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, from: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: torch's default)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True), as the training engine sets on CPU",
    )
    parser.add_argument("--peak-size", type=int, default=None, help="matmul size for the peak (default 4096)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument(
        "--optimizer",
        default="fused",
        choices=list(OPTIMIZER_IMPLEMENTATIONS),
        help="AdamW implementation, the same for every variant (default: fused)",
    )
    parser.add_argument("--tag", default="", help="suffix of the result files (default: none)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one step of each variant and keep its top N ops by self time",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if len(set(names)) != len(names):
        parser.error("a variant is listed twice in --variants")
    args.variant_names = names
    for flag in ("batch", "seq_len", "steps", "rounds"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch (torch.cuda.is_available() is False)")
    try:
        overrides: dict[str, Any] = {"vocab_size": args.vocab_size} if args.vocab_size else {}
        if args.layers:
            overrides["num_hidden_layers"] = args.layers
        if args.untied:
            overrides["tie_word_embeddings"] = False
        args.config = get_preset(args.preset, **overrides)
    except ValueError as err:
        parser.error(str(err))
    if args.seq_len > args.config.max_position_embeddings:
        parser.error(
            f"--seq-len {args.seq_len} exceeds the preset's max_position_embeddings "
            f"{args.config.max_position_embeddings}"
        )
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    threads = set_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    config: LlamaConfig = args.config
    tokens_per_step = args.batch * args.seq_len
    load_before = load_average()
    print(
        f"{args.preset}: {count_params(config) / 1e6:.1f}M params, vocab {config.vocab_size}, batch "
        f"{args.batch} x {args.seq_len}, {threads} threads, device {device}, load average {load_before}",
        flush=True,
    )

    peak_n = args.peak_size or 4096
    peaks = {
        dt: matmul_peak(device, getattr(torch, name), peak_n)
        for dt, name in (("fp32", "float32"), ("bf16", "bfloat16"))
    }
    spec = {
        dt: gpu_spec_peak(device, getattr(torch, name))
        for dt, name in (("fp32", "float32"), ("bf16", "bfloat16"))
    }
    print(
        f"matmul {peak_n}³: fp32 {peaks['fp32']['flops_per_s'] / 1e9:,.0f} GFLOP/s, "
        f"bf16 {peaks['bf16']['flops_per_s'] / 1e9:,.0f} GFLOP/s",
        flush=True,
    )

    compile_kwargs = {"mode": args.compile_mode} if args.compile_mode else {}
    n_batches = 1 + args.warmup + args.steps
    batches = make_batches(n_batches, args.batch, args.seq_len, config.vocab_size, device)
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        variants = build_variants(
            args.variant_names, config, device, Path(tmp), compile_kwargs, args.lr, args.optimizer
        )

    # First step (compiles) on the same batch from the same weights: its losses must agree.
    for v in variants:
        v.first_step_s, v.first_loss = timed_step(v, batches[0], device)
        for i in range(args.warmup):
            v.warmup_s.append(timed_step(v, batches[1 + i], device)[0])
        print(f"  {v.name}: first step {v.first_step_s:.2f} s, loss {v.first_loss:.5f}", flush=True)
    loss_check = check_first_losses(variants, device)

    round_loads = []
    for r in range(args.rounds):
        for v in variants:
            times = [timed_step(v, batches[1 + args.warmup + i], device)[0] for i in range(args.steps)]
            v.step_s += times
            v.round_medians_s.append(statistics.median(times))
        round_loads.append(load_average())
        print(
            f"  round {r + 1}/{args.rounds}: "
            + ", ".join(f"{v.name} {tokens_per_step / v.round_medians_s[-1]:,.0f}" for v in variants)
            + f" tokens/s; load {round_loads[-1]}",
            flush=True,
        )
    load_after = load_average()
    profiles = (
        {v.name: profile_step(v, batches[1], device, args.profile) for v in variants} if args.profile else {}
    )

    fpt = flops_per_token(config, args.seq_len)
    rows = []
    for v in variants:
        median = statistics.median(v.step_s)
        tps = tokens_per_step / median
        row = {
            "variant": v.name,
            "impl": v.impl,
            "compiled": v.compiled,
            "dtype": v.dtype,
            "tokens_per_s": round(tps, 1),
            "tokens_per_s_p10_p90": [
                round(tokens_per_step / percentile(v.step_s, 0.9), 1),
                round(tokens_per_step / percentile(v.step_s, 0.1), 1),
            ],
            "step_ms_median": round(1000 * median, 2),
            # The fastest step: what the machine does when nothing else runs; robust to contention.
            "tokens_per_s_best": round(tokens_per_step / min(v.step_s), 1),
            "round_tokens_per_s": [round(tokens_per_step / m, 1) for m in v.round_medians_s],
            "first_step_s": round(v.first_step_s, 3),
            "warmup_steps_s": [round(t, 3) for t in v.warmup_s],
            "first_loss": round(v.first_loss, 6),
            "achieved_tflops": round(fpt * tps / 1e12, 4),
            "mfu_measured_peak": round(fpt * tps / peaks[v.dtype]["flops_per_s"], 4),
        }
        if spec[v.dtype] is not None:
            row["mfu_spec_peak"] = round(fpt * tps / spec[v.dtype], 4)
        if v.name in profiles:
            row["profile_top_ops"] = profiles[v.name]
        rows.append(row)
    by_name = {row["variant"]: row for row in rows}

    def ratio(a: str, b: str) -> float | None:
        return (
            round(by_name[a]["tokens_per_s"] / by_name[b]["tokens_per_s"], 3)
            if a in by_name and b in by_name
            else None
        )

    return {
        "benchmark": "train_throughput",
        "command": " ".join(["benchmarks/train_throughput.py", *sys.argv[1:]]),
        "preset": args.preset,
        "model_config": config.to_dict(),
        "params": count_params(config),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_per_step": tokens_per_step,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "warmup_steps": args.warmup,
        "compile_mode": args.compile_mode or "default",
        "deterministic": args.deterministic,
        "optimizer": f"AdamW ({args.optimizer})",
        "device": str(device),
        "machine": machine_info(device),
        "load_average_1m": {"before": load_before, "after": load_after, "per_round": round_loads},
        "flops_per_token": fpt,
        "matmul_peak": {
            dt: {k: round(val, 6) if isinstance(val, float) else val for k, val in p.items()}
            for dt, p in peaks.items()
        },
        "spec_peak_flops": spec,
        "first_loss_check": loss_check,
        "ratios": {
            "ours_compiled_bf16_over_hf_eager_bf16": ratio("ours-compiled-bf16", "hf-eager-bf16"),
            "ours_compiled_bf16_over_hf_compiled_bf16": ratio("ours-compiled-bf16", "hf-compiled-bf16"),
            "ours_eager_bf16_over_hf_eager_bf16": ratio("ours-eager-bf16", "hf-eager-bf16"),
            "ours_compiled_bf16_over_ours_eager_fp32": ratio("ours-compiled-bf16", "ours-eager-fp32"),
            "ours_loss_in_graph_over_hf_loss_in_graph": ratio(
                "ours-compiled-bf16-loss-in-graph", "hf-compiled-bf16-loss-in-graph"
            ),
            "ours_loss_in_graph_over_hf_eager_bf16": ratio(
                "ours-compiled-bf16-loss-in-graph", "hf-eager-bf16"
            ),
            "matmul_attention_over_sdpa": ratio(
                "ours-compiled-bf16-loss-in-graph", "ours-compiled-bf16-loss-in-graph-sdpa"
            ),
        },
        "rows": rows,
    }


def print_report(result: dict[str, Any]) -> None:
    has_spec = any("mfu_spec_peak" in r for r in result["rows"])
    headers = [
        "variant",
        "tokens/s (median)",
        "p10–p90",
        "best",
        "step ms",
        "first step s",
        "first loss",
        "TFLOP/s",
        "MFU (measured peak)",
    ] + (["MFU (spec peak)"] if has_spec else [])
    table = []
    for r in result["rows"]:
        lo, hi = r["tokens_per_s_p10_p90"]
        line = [
            r["variant"],
            f"{r['tokens_per_s']:,.0f}",
            f"{lo:,.0f}–{hi:,.0f}",
            f"{r['tokens_per_s_best']:,.0f}",
            f"{r['step_ms_median']:.1f}",
            f"{r['first_step_s']:.2f}",
            f"{r['first_loss']:.4f}",
            f"{r['achieved_tflops']:.3f}",
            f"{r['mfu_measured_peak']:.1%}",
        ]
        if has_spec:
            line.append(f"{r['mfu_spec_peak']:.1%}" if "mfu_spec_peak" in r else "")
        table.append(line)
    peaks = result["matmul_peak"]
    load = result["load_average_1m"]
    print()
    print(
        f"{result['preset']} ({result['params'] / 1e6:.1f}M params, vocab {result['model_config']['vocab_size']}), "
        f"batch {result['batch']} x {result['seq_len']}, {result['rounds']} rounds x {result['steps_per_round']} "
        f"steps, compile mode {result['compile_mode']}, {result['optimizer']}, {result['machine']['torch_threads']} threads, "
        f"torch {result['machine']['torch']}, {result['device']}"
    )
    print(
        f"matmul peak {peaks['bf16']['n']}³: fp32 {peaks['fp32']['flops_per_s'] / 1e9:,.0f} GFLOP/s, "
        f"bf16 {peaks['bf16']['flops_per_s'] / 1e9:,.0f} GFLOP/s; load average {load['before']} → {load['after']}"
    )
    print()
    print(markdown_table(headers, table))
    for r in result["rows"]:
        if "profile_top_ops" in r:
            print(f"\nprofile of one step, {r['variant']} (self time):")
            for op in r["profile_top_ops"]:
                print(f"  {op['share']:6.1%} {op['self_ms']:9.2f} ms  {op['calls']:5d}x  {op['op']}")
    print()
    for key, value in result["ratios"].items():
        if value is not None:
            print(f"{key}: {value:.2f}x")


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["variant"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    errors = [
        [r["tokens_per_s"] - r["tokens_per_s_p10_p90"][0] for r in rows],
        [r["tokens_per_s_p10_p90"][1] - r["tokens_per_s"] for r in rows],
    ]
    colors = ["tab:blue" if r["impl"] == "ours" else "tab:orange" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.bar(names, values, yerr=errors, color=colors, capsize=4)
    for bar, r in zip(bars, rows, strict=True):
        ax.annotate(
            f"{r['tokens_per_s']:,.0f}\nMFU {r['mfu_measured_peak']:.0%}",
            (bar.get_x() + bar.get_width() / 2, r["tokens_per_s_p10_p90"][1]),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.set_ylabel("training tokens/s (median, p10–p90)")
    load = result["load_average_1m"]
    ax.set_title(
        f"{result['preset']} preset, batch {result['batch']}x{result['seq_len']}, {result['device']} "
        f"({result['machine']['torch_threads']} threads), load avg {load['before']}→{load['after']}",
        fontsize=10,
    )
    ax.tick_params(axis="x", labelrotation=20)
    ax.margins(y=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_report(result)
    suffix = f"_{args.tag}" if args.tag else ""
    json_path = write_json(RESULTS_DIR / f"train_throughput{suffix}.json", result)
    print(f"\nwritten {json_path}")
    if not args.no_plot:
        print(f"written {plot(result, RESULTS_DIR / f'train_throughput{suffix}.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
