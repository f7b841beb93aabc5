"""What the periodic validation score (`eval_every`, `eval_bytes`: what a sweep prunes on) costs.

    .venv/bin/python benchmarks/periodic_eval_cost.py [--preset demo] [--steps 21] [--eval-bytes 28672] [--every 30 150]

One run of the real engine (`tasks.training.fit`, the preset's recipe and the main job's data) scoring the
first `--eval-bytes` bytes of the validation text every 10 steps; its logged seconds per score
(`val_subset/time_s`) against the median optimizer step give the share of a run's time the score adds at each `--every`:
score / (every x step). Output: benchmarks/results/periodic_eval[_TAG].json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402
from flows.pretrain_config import PretrainConfig  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.dataset import build_dataset  # noqa: E402
from tasks.tokenize import train_tokenizer  # noqa: E402
from tasks.training import TrainSettings, fit, read_metrics  # noqa: E402
from tasks.training.periodic_eval import SECONDS  # noqa: E402
from tasks.training.precision import resolve_dtype  # noqa: E402

SCORE_EVERY = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=int, default=2 * SCORE_EVERY + 1)
    parser.add_argument("--eval-bytes", type=int, default=28672)
    parser.add_argument("--every", type=int, nargs="+", default=[30, 150])
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    config = PretrainConfig(preset=args.preset)
    tokenizer = train_tokenizer(config.data, config.vocab_size, val_fraction=config.val_fraction)
    dataset = build_dataset(config.data, tokenizer, config.seq_len, val_fraction=config.val_fraction)
    model = build_model(config.llama_config(), seed=config.seed)
    settings = TrainSettings.model_validate(
        {
            **config.train_settings().model_dump(),
            "max_steps": args.steps,
            "eval_every": SCORE_EVERY,
            "eval_bytes": args.eval_bytes,
            "checkpoint_every": args.steps,
            "device": "cpu",
        }
    )
    load_before = load_average()
    with tempfile.TemporaryDirectory() as work:
        fit(model, dataset, settings, Path(work) / "run", progress=False)
        logged = read_metrics(Path(work) / "run")
    steps = sorted(logged)
    step_s = statistics.median(logged[s]["train/step_time_s"] for s in steps[1:])
    scores = [logged[s][SECONDS] for s in steps if SECONDS in logged[s]]
    score_s = statistics.median(scores)
    result = {
        "command": " ".join(sys.argv),
        "preset": args.preset,
        "dtype": resolve_dtype(torch.device("cpu"), settings.dtype),
        "eval_bytes": args.eval_bytes,
        "median_step_s": round(step_s, 4),
        "score_s": [round(s, 4) for s in scores],
        "cost_fraction": {str(every): round(score_s / (every * step_s), 5) for every in args.every},
        "load_average": {"before": load_before, "after": load_average()},
        "machine": machine_info(torch.device("cpu")),
    }
    name = f"periodic_eval_{args.tag}.json" if args.tag else "periodic_eval.json"
    write_json(RESULTS_DIR / name, result)
    print(
        f"{args.preset}: step {step_s:.3f} s, score of {args.eval_bytes} bytes {score_s:.3f} s; "
        + ", ".join(f"every {e}: +{100 * f:.2f}%" for e, f in result["cost_fraction"].items())
    )


if __name__ == "__main__":
    main()
