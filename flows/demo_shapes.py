"""The demo preset's shape: the measured candidates, and the automatic choice by the hardware probe.

Where the CPU (or GPU) has bf16 in hardware the demo trains the preset's own values; on a CPU without it,
which trains fp32 many times slower, `demo_shape: auto` picks a smaller shape with smaller steps, within a
time budget (`tasks.training.budget` plans its steps). Why that shape, and what of it is measured (step
times under an AVX2 emulation; not yet its bits per byte at equal wall clock): benchmarks/README.md.
"""

from __future__ import annotations

from typing import Any

# The demo's candidate model and batch shapes for a CPU without bf16 in hardware, where it trains fp32
# (`benchmarks/budget_shapes.py` compares them at equal wall clock; benchmarks/README.md). Every value is
# explicit: a shape given this way is the user's, never replaced by the automatic choice below.
_DEMO_LAYERS = {"qk_norm": True, "zero_init_output_projections": True, "value_embeds": 1}
DEMO_SHAPES: dict[str, dict[str, Any]] = {
    "2x320-b32": {
        "model_overrides": {**_DEMO_LAYERS, "hidden_size": 320, "intermediate_size": 816},
        "micro_batch_size": 16,
        "accumulate_steps": 2,
    },
    "2x320-b16": {
        "model_overrides": {**_DEMO_LAYERS, "hidden_size": 320, "intermediate_size": 816},
        "micro_batch_size": 16,
        "accumulate_steps": 1,
    },
    "2x256-b16": {
        "model_overrides": {
            **_DEMO_LAYERS,
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
        "micro_batch_size": 16,
        "accumulate_steps": 1,
    },
    "2x192-b16": {
        "model_overrides": {
            **_DEMO_LAYERS,
            "hidden_size": 192,
            "intermediate_size": 512,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
        },
        "micro_batch_size": 16,
        "accumulate_steps": 1,
    },
}
# On a CPU without bf16 in hardware the demo trains this shape within this budget (`demo_shape: auto`); where
# bf16 is native, the preset's own values (1,200 steps) as they are.
FP32_DEMO_SHAPE = "2x256-b16"
FP32_DEMO_BUDGET = "12m"
# Fields that set the model, batch or run length: any one of them given means the user chose, not `auto`.
_SHAPE_FIELDS = ("model", "model_overrides", "micro_batch_size", "accumulate_steps", "seq_len", "vocab_size")


def _fp32_cpu_host(values: dict[str, Any]) -> bool:
    """Whether the run trains fp32 on this machine's CPU because it has no bf16 in hardware."""
    from tasks.training.precision import native_bf16

    device, dtype = values.get("device", "auto"), values.get("dtype", "auto")
    if dtype == "bf16" or values.get("placement", "local") != "local":
        return False
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device == "cpu" and not native_bf16("cpu")


def resolve_demo_shape(values: dict[str, Any], merged: dict[str, Any]) -> None:
    """Resolve `demo_shape` in `merged`: auto becomes `preset` (the preset's values) or, on a CPU without
    bf16 in hardware, FP32_DEMO_SHAPE within FP32_DEMO_BUDGET (unless the user gave a run length)."""
    shape = values.get("demo_shape", "auto")
    if merged.get("preset", "demo") != "demo" or values.get("init_from") is not None:
        if shape not in ("auto", "preset"):
            raise ValueError(
                f"demo_shape={shape!r} shapes the demo preset's model: use preset demo, or drop it"
            )
        merged["demo_shape"] = "preset"
        return
    if shape == "auto":
        chosen = not any(name in values for name in _SHAPE_FIELDS) and _fp32_cpu_host(values)
        shape = FP32_DEMO_SHAPE if chosen else "preset"
        if chosen and not any(name in values for name in ("max_steps", "epochs", "time_budget")):
            merged["max_steps"] = None
            merged["time_budget"] = FP32_DEMO_BUDGET
    merged["demo_shape"] = shape
    if shape != "preset":
        merged.update({k: v for k, v in DEMO_SHAPES[shape].items() if k not in values})
