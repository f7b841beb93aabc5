"""Numeric precision of training and evaluation: the one autocast rule, and what `dtype: auto` means."""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from typing import Literal

import torch

Precision = Literal["bf16", "fp32"]

# The numerical recipes a run trains with (recorded in each checkpoint; `precision_recipe`). FSDP2's mixed
# precision on CUDA is not DDP's autocast: its parameters, hence the residual stream and the norms' gains,
# are bf16, where autocast keeps them fp32 and runs only the matmuls in bf16.
FP32 = "fp32"
BF16_AUTOCAST = "bf16 autocast over fp32 weights (fp32 residual stream, bf16 matmuls)"
BF16_FSDP_PARAMS = "FSDP2 bf16 mixed precision (bf16 parameters and residual stream, fp32 gradient reduction)"


@cache
def native_bf16(device_type: str) -> bool:
    """Whether `device_type` runs bf16 matmuls in hardware: CUDA GPUs from Ampere on, CPUs with AVX-512
    BF16 or AMX. Elsewhere (an AVX2 CPU) oneDNN emulates them, 20-50x slower than fp32.

    A CPU whose kernels torch dispatches below AVX-512 counts as without: that is how an AVX2-only host is
    emulated on a newer one (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`: torch and oneDNN then run
    AVX2 kernels), so its timings are the emulation's, not a real AVX2 host's."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            return False
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False


def resolve_dtype(device: torch.device, dtype: str) -> Precision:
    """`auto` is bf16 where the hardware has it and fp32 elsewhere; an explicit bf16 without it warns."""
    if dtype == "auto":
        return "bf16" if native_bf16(device.type) else "fp32"
    if dtype == "bf16" and not native_bf16(device.type):
        warnings.warn(
            f"dtype=bf16 on a {device.type} without bf16 in hardware (no AVX-512 BF16 or AMX here): its bf16 "
            "matmuls are emulated and run 20-50x slower than fp32; use --dtype auto or fp32",
            RuntimeWarning,
            stacklevel=2,
        )
    return "bf16" if dtype == "bf16" else "fp32"


def autocast(device: torch.device, dtype: str) -> AbstractContextManager[object]:
    """bf16 autocast for `dtype="bf16"` (matmuls in bf16, weights and reductions in fp32), else nothing."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def precision_recipe(mode: str, device_type: str, dtype: str) -> str:
    """The numerical recipe of a run with parallel `mode` (none, ddp, fsdp, hsdp) on `device_type` at the concrete
    `dtype`: FSDP2 on CUDA under bf16 gathers bf16 parameters (MixedPrecisionPolicy: half the all-gather
    traffic); everything else autocasts over fp32 weights. `parallelize` applies what this says."""
    if dtype != "bf16":
        return FP32
    return BF16_FSDP_PARAMS if mode in ("fsdp", "hsdp") and device_type == "cuda" else BF16_AUTOCAST
