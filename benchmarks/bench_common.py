"""Shared pieces of the benchmark scripts: machine description, matmul peak, load average, result files.

Benchmarks are scripts, not a package API: run them from the repository root as
`.venv/bin/python benchmarks/<name>.py`; each puts the repository root on `sys.path` itself.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from model.atomic import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Dense bf16 tensor-core peaks (FLOP/s) of data-centre GPUs, from the vendors' spec sheets. TF32 is half.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def ensure_repo_on_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def set_threads(threads: int | None) -> int:
    """Apply a torch intra-op thread count (None keeps torch's choice); returns the count in effect."""
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"--threads must be positive, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa_flags() -> list[str]:
    """The vector/matrix extensions that decide CPU matmul speed (AVX-512 bf16, AMX)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(
                    f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
                )
    except OSError:
        pass
    return []


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_isa_flags(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 3) -> dict[str, float]:
    """Measured n×n×n matmul FLOP/s: best of `repeats` timed calls after one warm-up (best, since peak)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
    # On CUDA one call of a 4096³ matmul is ~0.1 ms: time a batch of calls so launch gaps do not count.
    calls = 20 if device.type == "cuda" else 1
    torch.matmul(a, b)
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            torch.matmul(a, b)
        synchronize(device)
        times.append((time.perf_counter() - start) / calls)
    best = min(times)
    return {"n": n, "flops_per_s": 2 * n**3 / best, "best_s": best, "median_s": statistics.median(times)}


def gpu_spec_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """Spec-sheet dense peak for a known GPU (bf16, or TF32 for float32), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_PEAK_BF16.items():
        if key in name:
            return peak if dtype == torch.bfloat16 else peak / 2
    return None


def write_json(path: Path, data: dict[str, Any]) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-quantile (0 ≤ q ≤ 1) of a non-empty list."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def run_ranks(script: Path, nproc: int, args: list[str], timeout_s: float = 1800) -> None:
    """Run `script` as `nproc` torchrun ranks on this machine (gloo on CPU), rendezvous on 127.0.0.1."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        "--local-addr=127.0.0.1",
        str(script),
        *args,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run(command, env=env, check=True, timeout=timeout_s)
