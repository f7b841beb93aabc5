"""benchmarks/gpu_check.py runs on the GPU machines' image as it is, the way its header says. Emulated here:
a virtualenv holding only the image's packages (torch, transformers, tokenizers, safetensors, numpy and what
they require, linked from this environment: nothing is downloaded), pydantic's wheels in .whl/ of a fresh
clone, and the header's own command run there (unpack onto .whl/site, PYTHONPATH=.whl/site) with --cpu-smoke.

The wheels are packed from this environment's installed pydantic (a wheel is a zip of its installed files),
not downloaded by `make gpu-wheels`: that target fetches cp312 wheels for the image, which do not import on
this Python 3.11, and packing works offline with exactly the versions the project's install locked."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import venv
import zipfile
from importlib.metadata import Distribution, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
IMAGE = ("torch", "transformers", "tokenizers", "safetensors", "numpy")  # the GPU image's packages
WHEELS = ("pydantic",)  # what `make gpu-wheels` brings
ABSENT = ("pydantic", "prefect", "mlflow", "psutil", "tasks", "flows")  # not importable in the image itself


def _closure(names: tuple[str, ...], without: tuple[str, ...] = ()) -> list[Distribution]:
    """The installed distributions `names` need, their requirements (markers evaluated here, no extras)
    included, except those in `without` and what only they require."""
    found: dict[str, Distribution] = dict.fromkeys(map(canonicalize_name, without))  # type: ignore[arg-type]
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        found[name] = dist = distribution(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return [dist for dist in found.values() if dist is not None]


def _top_level(dist: Distribution) -> set[str]:
    """The entries a distribution put into site-packages (its packages, modules, .dist-info, .libs)."""
    assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD"
    return {f.parts[0] for f in dist.files if ".." not in f.parts and f.parts[0] != "__pycache__"}


def _image() -> Path:
    """A virtualenv with only the image's distributions, symlinked from this environment's site-packages. At
    a path fixed by what it holds, kept: inductor's cache keys hold torch's path, so a rerun finds its
    compiled kernels instead of compiling for minutes again."""
    # Newer transformers require typer, and typer pydantic: the image, which lacks pydantic, is kept as it is.
    dists = _closure(IMAGE, without=WHEELS)
    held = sorted((d.metadata["Name"], d.version, str(d.locate_file(""))) for d in dists)
    root = (
        Path(tempfile.gettempdir())
        / f"llamaflow-gpu-image-{hashlib.sha256(repr(held).encode()).hexdigest()[:12]}"
    )
    if not (root / "bin" / "python3").exists():
        building = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=root.parent))
        venv.EnvBuilder(with_pip=False, symlinks=True).create(building)  # finds itself by its executable
        site = next((building / "lib").glob("python3*/site-packages"))
        for dist in dists:
            for entry in _top_level(dist):
                (site / entry).symlink_to(dist.locate_file(entry))
        try:
            building.rename(root)
        except OSError:  # another process made it first
            shutil.rmtree(building)
    return root / "bin"


def _wheels(directory: Path) -> None:
    """Each distribution pydantic needs, as a wheel: a zip of its installed files."""
    directory.mkdir()
    for dist in _closure(WHEELS):
        name, version = dist.metadata["Name"].replace("-", "_"), dist.version
        with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
            for file in dist.files or []:
                if ".." not in file.parts and "__pycache__" not in file.parts:
                    wheel.write(dist.locate_file(file), str(file))


def _clone(target: Path) -> None:
    """A clone of this checkout's tracked files as they are now (HEAD plus uncommitted edits)."""
    git = ["git", "-C", str(REPO)]
    snapshot = subprocess.run([*git, "stash", "create"], capture_output=True, text=True, check=True).stdout
    commit = snapshot.strip() or "HEAD"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(REPO), str(target)], check=True)
    subprocess.run(["git", "-C", str(target), "checkout", "-q", "--detach", commit], check=True)


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs a git checkout to clone")
def test_gpu_check_cpu_smoke_passes_on_the_gpu_image_as_its_header_says(tmp_path: Path) -> None:
    bin_dir = _image()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    python = str(bin_dir / "python3")
    probe = "import importlib.util as u, json, sys; print(json.dumps([m for m in sys.argv[1:] if u.find_spec(m)]))"
    found = subprocess.run(
        [python, "-c", probe, *ABSENT, *IMAGE], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert json.loads(found.stdout or "null") == list(IMAGE), found.stderr  # the emulation holds

    clone = tmp_path / "clone"
    _clone(clone)
    _wheels(clone / ".whl")
    header = (clone / "benchmarks" / "gpu_check.py").read_text()
    command = re.search(r"^ *(for w in \.whl/.*gpu_check\.py)$", header, re.MULTILINE)
    assert command, "the header of benchmarks/gpu_check.py lost its command for the GPU image"
    out = tmp_path / "report.json"
    done = subprocess.run(
        ["bash", "-c", f"{command.group(1)} --cpu-smoke --out {out}"],
        env=env,
        cwd=clone,
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
