"""What a sharded checkpoint costs under FSDP2, and whether DCP's asynchronous save would hide it.

    .venv/bin/python benchmarks/checkpoint_save.py [--preset small] [--nproc 2] [--rounds 3]

The ranks (torchrun, gloo, 127.0.0.1) build the preset through `parallelize` (FSDP2) and `build_optimizer`
(AdamW), take one optimizer step (so the state exists), then in rounds time: the engine's whole
`write_checkpoint` (every rank's model slices + optimizer shards + RNG + checksums + publication); its
parts: the model slices (`save_model_shards`), the streamed consolidation into model.safetensors that
evaluation or registration runs once (`consolidate_weights`, one process), and for comparison what the
slices replaced at every checkpoint (the whole state dict gathered into rank 0's memory and written with
`save_weights`); the optimizer shards through DCP synchronously (`save_optimizer_state`); and the same
optimizer shards through
`dcp.async_save`: the time until it returns (what training would wait) and until its writes finish.
Writes results/checkpoint_save[_TAG].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import HuggingFaceStorageWriter  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa: E402

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, run_ranks, write_json  # noqa: E402
from model import LlamaConfig, get_preset, save_weights  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.training import checkpoint as ckpt  # noqa: E402
from tasks.training.checkpoint_weights import consolidate_weights, save_model_shards  # noqa: E402
from tasks.training.distributed import context_from_env, leave_process_group  # noqa: E402
from tasks.training.optim import build_optimizer  # noqa: E402
from tasks.training.optimizer_state import save_optimizer_state  # noqa: E402
from tasks.training.parallelize import parallelize  # noqa: E402
from tasks.training.settings import TrainSettings  # noqa: E402


def rank_side(weights: Path, rounds: int, out: Path) -> None:
    dist.init_process_group("gloo")
    context = context_from_env()
    config = LlamaConfig.from_dict(json.loads((weights / "config.json").read_text()))
    cpu = torch.device("cpu")
    settings = TrainSettings(data_parallel="fsdp", compile=False, dtype="fp32", device="cpu")  # type: ignore[arg-type]
    parallel = parallelize(config, weights, settings, cpu, eos_id=None)
    optimizer = build_optimizer(parallel.plain, settings, cpu)
    tokens = torch.randint(0, config.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0))
    with parallel.micro_batch(last=True):
        parallel.model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    scratch = out / "scratch"
    # async_save's background thread runs its collectives on a group of its own: on the default group they
    # interleave with the main thread's barriers and both ranks hang (seen with gloo).
    async_group = dist.new_group(backend="gloo")
    times: dict[str, list[float]] = {}

    def timed(name: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        dist.barrier()
        start = time.perf_counter()
        result = function(*args, **kwargs)
        dist.barrier()
        times.setdefault(name, []).append(time.perf_counter() - start)
        return result

    for round_ in range(rounds):
        timed(
            "write_checkpoint",
            ckpt.write_checkpoint,
            scratch / "run",
            round_ + 1,
            parallel=parallel,
            optimizer=optimizer,
            trainer_state={"step": round_ + 1},
            model_config=config.to_dict(),
            settings=settings.model_dump(mode="json"),
            device=cpu,
            keep=1,
            dist=context,
        )
        # The weights as write_checkpoint writes them (each rank its slices), and their consolidation.
        timed("model_shards", save_model_shards, scratch / f"shards{round_}", parallel.plain)
        if context.is_main:
            start = time.perf_counter()
            consolidate_weights(scratch / f"shards{round_}", scratch / f"streamed{round_}.safetensors", {})
            times.setdefault("consolidate_model_safetensors_rank0", []).append(time.perf_counter() - start)
        # What it replaced: the whole state dict gathered into rank 0's memory and written from there.
        whole = timed("gather_whole_state_dict", parallel.full_state_dict)
        if context.is_main:
            start = time.perf_counter()
            save_weights(parallel.plain, scratch / f"model{round_}.safetensors", state=whole)
            times.setdefault("write_model_safetensors_rank0", []).append(time.perf_counter() - start)
        del whole
        timed(
            "optimizer_shards_sync",
            save_optimizer_state,
            scratch / f"sync{round_}",
            parallel.plain,
            optimizer,
        )
        state = get_optimizer_state_dict(parallel.plain, optimizer.optimizers)
        flat = {f"{n}.{k}": v for n, entry in state["state"].items() for k, v in entry.items()}
        writer = HuggingFaceStorageWriter(str(scratch / f"async{round_}"), save_distributed=True)
        future = timed(
            "optimizer_shards_async_return",
            dcp.async_save,
            flat,
            storage_writer=writer,
            process_group=async_group,
        )
        timed("optimizer_shards_async_finish", future.result)
    (out / f"rank{context.rank}.json").write_text(json.dumps(times))
    leave_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tag", default="")
    parser.add_argument("--rank-side", nargs=2, metavar=("WEIGHTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        rank_side(Path(args.rank_side[0]), args.rounds, Path(args.rank_side[1]))
        return
    config = get_preset(args.preset)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        weights, out = Path(build_model(config, seed=0).path), Path(tmp) / "out"
        out.mkdir()
        run_ranks(
            Path(__file__), args.nproc, ["--rounds", str(args.rounds), "--rank-side", str(weights), str(out)]
        )
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    median_s = {name: max(statistics.median(r[name]) for r in ranks if name in r) for name in ranks[0]}
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_info(torch.device("cpu")),
        "load_average": {"before": load_before, "after": load_average()},
        "preset": args.preset,
        "nproc": args.nproc,
        "median_s": median_s,
        "per_rank": ranks,
    }
    name = f"checkpoint_save_{args.tag}.json" if args.tag else "checkpoint_save.json"
    write_json(RESULTS_DIR / name, result)
    for key, value in median_s.items():
        print(f"{key:>32}: {value * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
