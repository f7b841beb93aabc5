"""Peak host memory of consolidating a sharded checkpoint's weights into one model.safetensors.

    .venv/bin/python benchmarks/consolidate_memory.py [--preset 1b] [--nproc 2]

The preset's initial weights (tasks.build, cached) are loaded by `--nproc` FSDP2 ranks (torchrun, gloo,
127.0.0.1, `parallelize`: each rank reads only its own slices), which write their slices as a checkpoint
does (`save_model_shards`, DCP's safetensors format). A fresh process then runs `consolidate_weights` alone
(what the main rank does at a checkpoint) and reports its resident-set high-water mark (VmHWM, which the
page cache of the files it reads and writes does not count) and its RSS before consolidating (torch
imported). The goal: the high-water mark at most 1.2x one fp32 copy of the model (issue 39). The file
written is then checked tensor by tensor against the initial weights (it must equal them: no training).
Writes results/consolidate_memory[_TAG].json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors import safe_open  # noqa: E402

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, run_ranks, write_json  # noqa: E402
from model import LlamaConfig, count_params, get_preset  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.training.checkpoint_weights import SHARDS_DIR, consolidate_weights, save_model_shards  # noqa: E402
from tasks.training.distributed import leave_process_group  # noqa: E402
from tasks.training.parallelize import parallelize  # noqa: E402
from tasks.training.settings import TrainSettings  # noqa: E402

GOAL = 1.2  # peak RSS of consolidation over one fp32 copy of the model


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rank_side(weights: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    config = LlamaConfig.from_dict(json.loads((weights / "config.json").read_text()))
    settings = TrainSettings(data_parallel="fsdp", compile=False, dtype="fp32", device="cpu")
    parallel = parallelize(config, weights, settings, torch.device("cpu"), eos_id=None)
    save_model_shards(out / SHARDS_DIR, parallel.plain)
    leave_process_group()


def consolidate_side(shards: Path, target: Path) -> None:
    before = status_kib("VmRSS")
    started = time.perf_counter()
    consolidate_weights(shards, target, {"format": "pt"})
    seconds = time.perf_counter() - started
    print(json.dumps({"rss_before_kib": before, "vm_hwm_kib": status_kib("VmHWM"), "seconds": seconds}))


def same_tensors(a: Path, b: Path) -> bool:
    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        names = list(fa.keys())
        if set(names) != set(fb.keys()):
            return False
        return all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tag", default="")
    parser.add_argument("--rank-side", nargs=2, metavar=("WEIGHTS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--consolidate", nargs=2, metavar=("SHARDS", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        rank_side(*map(Path, args.rank_side))
        return
    if args.consolidate:
        consolidate_side(*map(Path, args.consolidate))
        return

    config = get_preset(args.preset)
    load_before = load_average()
    weights = Path(build_model(config, seed=0).path)
    with tempfile.TemporaryDirectory(dir=weights.parent) as tmp:
        out = Path(tmp)
        run_ranks(Path(__file__), args.nproc, ["--rank-side", str(weights), str(out)])
        target = out / "model.safetensors"
        child = subprocess.run(
            [sys.executable, __file__, "--consolidate", str(out / SHARDS_DIR), str(target)],
            check=True,
            capture_output=True,
            text=True,
        )
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        equal = same_tensors(target, weights / "model.safetensors")
    fp32_copy = 4 * count_params(config)
    peak = measured["vm_hwm_kib"] * 1024
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_info(torch.device("cpu")),
        "load_average": {"before": load_before, "after": load_average()},
        "preset": args.preset,
        "params": count_params(config),
        "nproc": args.nproc,
        "fp32_copy_bytes": fp32_copy,
        "peak_rss_bytes": peak,
        "rss_before_bytes": measured["rss_before_kib"] * 1024,
        "peak_over_fp32_copy": peak / fp32_copy,
        "seconds": measured["seconds"],
        "equal_to_initial_weights": equal,
        "goal": GOAL,
        "goal_met": peak / fp32_copy <= GOAL and equal,
    }
    write_json(
        RESULTS_DIR / (f"consolidate_memory_{args.tag}.json" if args.tag else "consolidate_memory.json"),
        result,
    )
    print(
        f"consolidation of {args.preset} ({fp32_copy / 2**30:.2f} GiB in fp32): peak RSS "
        f"{peak / 2**30:.2f} GiB = {peak / fp32_copy:.3f}x (goal <= {GOAL}), RSS before "
        f"{result['rss_before_bytes'] / 2**30:.2f} GiB, {measured['seconds']:.1f} s, equal to the initial "
        f"weights: {equal}"
    )


if __name__ == "__main__":
    main()
