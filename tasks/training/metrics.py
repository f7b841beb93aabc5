"""Where per-step metrics go (a sink, `metrics.jsonl`), and the numbers behind MFU and peak memory."""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from model.atomic import write_text_atomic
from tasks.home import cache_dir

METRICS_FILE = "metrics.jsonl"

# Dense bf16 tensor-core peaks (FLOP/s) by a substring of torch.cuda.get_device_name().
GPU_PEAK_BF16: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 125e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


@runtime_checkable
class MetricSink(Protocol):
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...


class JsonlMetrics:
    """Appends one JSON line per logged step; readers take the LAST line of a step (a resumed run
    repeats the steps after its checkpoint)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / METRICS_FILE
        # A line cut short by a kill must not swallow the first record appended after it.
        if self.path.is_file() and self.path.stat().st_size:
            with self.path.open("rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "metrics": dict(metrics)}) + "\n")
            f.flush()

    def log_event(self, **event: object) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event}) + "\n")


def read_metrics(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """Per-step metrics of `run_dir/metrics.jsonl`, the last record of each step winning."""
    by_step: dict[int, dict[str, float]] = {}
    path = Path(run_dir) / METRICS_FILE
    if path.is_file():
        for line in path.read_text().splitlines():
            record = _parse(line)
            if record is not None:
                by_step[record[0]] = record[1]
    return by_step


def _parse(line: str) -> tuple[int, dict[str, float]] | None:
    try:
        record = json.loads(line)
    except ValueError:  # a line cut short by a kill
        return None
    if "step" not in record:
        return None
    return int(record["step"]), record["metrics"]


def tail_metrics(path: Path, offset: int) -> tuple[list[tuple[int, dict[str, float]]], int]:
    """Complete records appended to `path` after byte `offset`, and the offset after them."""
    if not path.is_file():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    records = [r for line in data[:end].decode().splitlines() if (r := _parse(line)) is not None]
    return records, offset + end


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak FLOP/s for MFU: a table for known GPUs, else a measured matmul peak cached on disk (trusted for
    PEAK_MAX_AGE_S when it was measured at low load; re-measured otherwise, keeping the best)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak if dtype == torch.bfloat16 else peak / 2  # TF32 dense is half of bf16
    return _measured_peak(device, dtype)


# A cached CPU matmul peak is trusted this long, and only when it was measured on a quiet machine: a peak
# measured under load (0.9 instead of 2.1 TFLOP/s was seen) would inflate every MFU after it.
PEAK_MAX_AGE_S = 7 * 24 * 3600


def _measured_peak(device: torch.device, dtype: torch.dtype) -> float:
    key = f"{device.type}|{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.get_num_threads()}|{dtype}"
    cache = cache_dir() / "device_peak.json"
    known: dict[str, object] = {}
    if cache.is_file():
        try:
            known = json.loads(cache.read_text())
        except ValueError:
            known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and _trusted(entry):
        return float(entry["flops"])
    load = os.getloadavg()[0]
    peak = _time_matmul(device, dtype)
    if (
        isinstance(entry, dict)
        and float(entry.get("flops", 0.0)) > peak
        and time.time() - float(entry.get("measured_at", 0.0)) < PEAK_MAX_AGE_S
    ):
        peak = float(entry["flops"])  # keep the better of an untrusted earlier measure and this one
    known[key] = {"flops": peak, "measured_at": time.time(), "load_1min": load, "cores": os.cpu_count()}
    write_text_atomic(cache, json.dumps(known, indent=2))
    return peak


def _trusted(entry: dict) -> bool:
    fresh = time.time() - float(entry.get("measured_at", 0.0)) < PEAK_MAX_AGE_S
    quiet = float(entry.get("load_1min", float("inf"))) < 0.5 * float(entry.get("cores") or 1)
    return fresh and quiet and float(entry.get("flops", 0.0)) > 0


def _time_matmul(
    device: torch.device, dtype: torch.dtype, max_n: int = 2048, repeats: int = 5, enough_s: float = 0.05
) -> float:
    """Best FLOP/s of an n x n matmul, n doubled from 256 until one product takes `enough_s` (or n reaches
    `max_n`): big enough for a fast device's peak, yet seconds, not a quarter hour, where the dtype has no
    fast kernel (bf16 on a CPU without AVX-512: 0.1 GFLOP/s measured, 15 minutes at n=2048)."""
    n, flops = 256, 0.0
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(0))
        b = torch.randn(n, n, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(1))
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            a @ b
            _sync(device)
            best = min(best, time.perf_counter() - start)
        flops = max(flops, 2 * n**3 / best)
        if best >= enough_s or n >= max_n:
            return flops
        n *= 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
