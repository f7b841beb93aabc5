"""The OpenMP wait policy chosen from the load, and the cached matmul peak that MFU divides by."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tasks.training import metrics
from tasks.training.openmp import openmp_env, wait_policy


def test_passive_waiting_only_when_another_process_holds_a_core() -> None:
    assert wait_policy(0.2, 2) is None
    assert wait_policy(1.0, 2) == "PASSIVE"
    assert wait_policy(3.0, 16) is None
    assert openmp_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}  # the user's choice stays


def test_a_cached_peak_is_trusted_only_fresh_and_measured_quiet(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics, "cache_dir", lambda: tmp_path)
    timed = []
    monkeypatch.setattr(metrics, "_time_matmul", lambda d, t: timed.append(1) or 5e11)
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    assert metrics.device_peak_flops(cpu, dtype) == 5e11 and len(timed) == 1
    cache = tmp_path / "device_peak.json"
    ((key, entry),) = json.loads(cache.read_text()).items()
    for stale in ({"load_1min": 9.0, "cores": 2}, {"measured_at": time.time() - metrics.PEAK_MAX_AGE_S - 1}):
        cache.write_text(json.dumps({key: {**entry, "load_1min": 0.0, **stale}}))
        metrics.device_peak_flops(cpu, dtype)
    assert len(timed) == 3
    cache.write_text(json.dumps({key: {**entry, "load_1min": 0.0, "flops": 7e11}}))
    assert metrics.device_peak_flops(cpu, dtype) == 7e11 and len(timed) == 3
