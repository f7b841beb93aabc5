"""What the Prefect + MLflow pipeline costs on top of the bare training loop.

    .venv/bin/python benchmarks/pipeline_overhead.py [--preset demo] [--steps 40] [--repeats 2] [--threads N]

Compared, at the same model, data, settings and step count:
  * flow:  `flows.pretrain.pretrain(PretrainConfig(preset=..., max_steps=steps))`: the whole pipeline
           (ephemeral Prefect server, tokenizer and dataset stages, model build, MLflow run, the `train`
           task with its MLflow metric sink, system metrics and Prefect progress artifact, evaluation,
           registration);
  * bare:  `tasks.training.fit(model_ref, dataset_ref, config.train_settings(), run_dir)`
           on the same ModelRef and DatasetRef, no sink, in the same process.
The training-phase overhead is (train task wall time - bare train wall time) / bare train wall time, where
the train task's wall time is its Prefect task run's start-to-end time. Both include loading the initial
weights, compilation (from a warm inductor cache) and the final checkpoint. The other stages are fixed
costs and are reported in seconds, per stage, from their task runs; "server start" is the time from
calling the flow to its flow run entering Running.

Everything goes into a temporary LLAMAFLOW_HOME / MLflow store / PREFECT_HOME (the inductor cache too), so
nothing of the project's own stores is touched. One warm-up flow run first builds the tokenizer and
dataset caches and fills the inductor cache; then `--repeats` times bare, flow, alternating. Writes
benchmarks/results/pipeline_overhead.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAGES = ("train_tokenizer", "build_dataset", "build_model", "train", "evaluate", "register")


def isolate(work: Path) -> None:
    """Point every store at `work` before Prefect, MLflow or the project read their settings."""
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        os.environ.pop(key, None)
    os.environ.update(
        {
            "LLAMAFLOW_HOME": str(work / "home"),
            "LLAMAFLOW_MLRUNS": str(work / "mlruns"),
            "PREFECT_HOME": str(work / "prefect"),
            "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache"),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", default="demo", choices=["tiny", "demo", "125m"], help="PretrainConfig preset"
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of every run")
    parser.add_argument("--repeats", type=int, default=2, help="bare/flow pairs after the warm-up flow run")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary stores (their path is printed)"
    )
    parser.add_argument("--tag", default="", help="suffix of the result file")
    args = parser.parse_args(argv)
    if args.steps <= 0 or args.repeats <= 0:
        parser.error("--steps and --repeats must be positive")
    return args


def _seconds(start: Any, end: Any) -> float | None:
    return (end - start).total_seconds() if start is not None and end is not None else None


def stage_times(flow_run_id: Any) -> tuple[dict[str, float], float | None, Any]:
    """Wall seconds of each task run of the flow run (start to end; a cached task: creation to end),
    the flow run's own start-to-end time and its start time."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    times: dict[str, float] = {}
    for run in task_runs:
        name = run.task_key.rsplit(".", 1)[-1] if run.task_key else run.name
        stage = next((s for s in STAGES if run.name.startswith(s) or name.startswith(s)), run.name)
        end = run.end_time or (run.state.timestamp if run.state else None)
        seconds = _seconds(run.start_time or run.created, end)
        if seconds is not None:
            times[stage] = times.get(stage, 0.0) + seconds
    return times, _seconds(flow_run.start_time, flow_run.end_time), flow_run.start_time


def run_flow(config: Any) -> dict[str, Any]:
    from flows.pretrain import pretrain

    called = time.time()
    started = time.perf_counter()
    state = pretrain(config, return_state=True)
    wall = time.perf_counter() - started
    result = state.result()
    stages, flow_seconds, flow_start = stage_times(state.state_details.flow_run_id)
    server_start = flow_start.timestamp() - called if flow_start is not None else None
    return {
        "wall_s": wall,
        "flow_run_s": flow_seconds,
        "until_running_s": server_start,
        "stages_s": stages,
        "train_tokens_per_s": result.checkpoint.metrics.get("tokens_per_s"),
        "train_loss": result.checkpoint.metrics.get("train_loss"),
        "steps": result.checkpoint.step,
        "dataset": result.dataset,
    }


def run_bare(config: Any, dataset: Any, checkpoint_dir: Path) -> dict[str, Any]:
    from tasks.build import build_model
    from tasks.training import fit

    model_ref = build_model(config.llama_config(), seed=config.seed)
    settings = config.train_settings()
    started = time.perf_counter()
    ref = fit(model_ref, dataset, settings, checkpoint_dir)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "train_tokens_per_s": ref.metrics.get("tokens_per_s"),
        "train_loss": ref.metrics.get("train_loss"),
        "steps": ref.step,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    isolate(work)

    import torch
    from pydantic import ValidationError

    from benchmarks.bench_common import (
        RESULTS_DIR,
        load_average,
        machine_info,
        markdown_table,
        set_threads,
        write_json,
    )
    from flows.pretrain_config import PretrainConfig

    threads = set_threads(args.threads)
    try:
        config = PretrainConfig(preset=args.preset, max_steps=args.steps)
    except ValidationError as err:
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(
            f"--preset {args.preset} --steps {args.steps} is not a valid pretrain config: {err}"
        ) from None
    load_before = load_average()
    print(
        f"preset {args.preset}, {args.steps} steps, {threads} threads, stores under {work}, load {load_before}"
    )

    try:
        warm = run_flow(config)
        print(f"warm-up flow run: {warm['wall_s']:.1f} s (cold server database, data stages, inductor cache)")
        dataset = warm.pop("dataset")
        flows, bares, loads = [], [], []
        for i in range(args.repeats):
            bare = run_bare(config, dataset, work / f"bare-{i}")
            print(f"  bare {i + 1}: train {bare['wall_s']:.2f} s, {bare['train_tokens_per_s']:,.0f} tokens/s")
            flow = run_flow(config)
            flow.pop("dataset")
            print(
                f"  flow {i + 1}: {flow['wall_s']:.2f} s; train task {flow['stages_s'].get('train', float('nan')):.2f} s, "
                f"{flow['train_tokens_per_s']:,.0f} tokens/s; stages { ({k: round(v, 2) for k, v in flow['stages_s'].items()}) }"
            )
            bares.append(bare)
            flows.append(flow)
            loads.append(load_average())
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load_after = load_average()

    bare_train = statistics.median(b["wall_s"] for b in bares)
    flow_train = statistics.median(f["stages_s"]["train"] for f in flows)
    flow_wall = statistics.median(f["wall_s"] for f in flows)
    stage_median = {s: round(statistics.median(f["stages_s"].get(s, 0.0) for f in flows), 3) for s in STAGES}
    glue = flow_wall - sum(stage_median.values())
    result = {
        "benchmark": "pipeline_overhead",
        "command": " ".join(["benchmarks/pipeline_overhead.py", *sys.argv[1:]]),
        "preset": args.preset,
        "steps": args.steps,
        "repeats": args.repeats,
        "compared": "flow: the train task's wall time inside flows.pretrain.pretrain; bare: tasks.training.fit "
        "called directly on the same ModelRef/DatasetRef/TrainSettings, same process, no sink",
        "machine": machine_info(torch.device("cpu")),
        "load_average_1m": {"before": load_before, "after": load_after, "per_repeat": loads},
        "bare_train_s": round(bare_train, 3),
        "flow_train_task_s": round(flow_train, 3),
        "training_overhead_pct": round(100 * (flow_train - bare_train) / bare_train, 2),
        "bare_tokens_per_s": round(statistics.median(b["train_tokens_per_s"] for b in bares), 1),
        "flow_tokens_per_s": round(statistics.median(f["train_tokens_per_s"] for f in flows), 1),
        "flow_wall_s": round(flow_wall, 3),
        "whole_flow_over_bare_train_pct": round(100 * (flow_wall - bare_train) / bare_train, 1),
        "fixed_costs_s": {
            "until_flow_running_first_call": round(warm["until_running_s"] or float("nan"), 3),
            "until_flow_running_later_calls": round(
                statistics.median(f["until_running_s"] for f in flows), 3
            ),
            **{
                f"{s}_cached" if s in ("train_tokenizer", "build_dataset", "build_model") else s: v
                for s, v in stage_median.items()
                if s != "train"
            },
            "flow_glue_outside_tasks": round(glue, 3),
        },
        "warmup_flow": {
            "wall_s": round(warm["wall_s"], 2),
            "stages_s": {k: round(v, 2) for k, v in warm["stages_s"].items()},
        },
        "runs": {"bare": bares, "flow": flows},
    }
    out = write_json(RESULTS_DIR / f"pipeline_overhead{'_' + args.tag if args.tag else ''}.json", result)

    print()
    print(
        markdown_table(
            ["what", "seconds (median)", "tokens/s"],
            [
                ["bare `tasks.training.fit`", f"{bare_train:.2f}", f"{result['bare_tokens_per_s']:,.0f}"],
                ["`train` task inside the flow", f"{flow_train:.2f}", f"{result['flow_tokens_per_s']:,.0f}"],
                ["whole flow (call to return)", f"{flow_wall:.2f}", ""],
            ],
        )
    )
    print(
        f"\ntraining-phase overhead: {result['training_overhead_pct']:+.2f}%  "
        f"(load average {load_before} → {load_after})"
    )
    print("fixed costs (s): " + ", ".join(f"{k} {v}" for k, v in result["fixed_costs_s"].items()))
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
