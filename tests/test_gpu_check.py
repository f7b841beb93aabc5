"""benchmarks/gpu_check.py runs on the GPU machines' image as it is: Python with torch, transformers,
tokenizers, safetensors and numpy, plus the pydantic wheels `make gpu-wheels` brings; no Prefect, MLflow,
psutil. Here those are hidden from the script and every process it starts (its torchrun ranks included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Not installed on the GPU image (or, for flows/, not the engine's to import). Hidden as if absent:
# `import` raises ModuleNotFoundError and `importlib.util.find_spec` / `importlib.metadata` find nothing, as
# optional-dependency probes (transformers' among them) expect of a package that is not there.
HIDDEN = ["prefect", "mlflow", "optuna", "datasets", "sqlalchemy", "psutil", "scipy", "matplotlib", "flows"]
SITECUSTOMIZE = f"""
import sys
from importlib.machinery import PathFinder

HIDDEN = {set(HIDDEN)!r}


def _hidden(name):
    return name.partition(".")[0].lower().replace("-", "_") in HIDDEN


class _WithoutHidden:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if _hidden(name) else PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        return (d for d in PathFinder.find_distributions(*args, **kwargs) if not _hidden(d.metadata["Name"] or ""))

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()


sys.meta_path[:] = [_WithoutHidden if f is PathFinder else f for f in sys.meta_path]
"""


def _without(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "gpu-image"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}


def test_gpu_check_cpu_smoke_runs_without_prefect_mlflow_or_psutil(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
        env=_without(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["cpu_smoke"] is True
    sections = {"hf_parity", "compiled_bf16_step", "attention", "engine_torchrun_1_process"}
    assert sections | {"fsdp_2_ranks_one_device_resume"} <= set(report)
    assert report["checks"] and all(check["ok"] for check in report["checks"].values()), report["checks"]
    assert report["fsdp_2_ranks_one_device_resume"]["killed_and_restarted"] is True
