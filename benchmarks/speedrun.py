"""Speedrun: how fast llamaflow's recipe reaches quality, against transformers + torch.compile + AdamW.

    .venv/bin/python benchmarks/speedrun.py [--steps 150] [--recipe-steps 0] [--preset demo] [--tag speedrun]
    .venv/bin/python benchmarks/speedrun.py --steps 300 --sweep benchmarks/sweeps/speedrun.yaml --tag speedrun_tuned

Both sides train the same architecture size (the preset's model) on the main job's data (the stdlib corpus,
tokenized and packed by the data stages), in the same block order, in one process, one after the other:
  baseline   transformers' LlamaForCausalLM (attn_implementation="sdpa") of the preset's size as Hugging Face
             can hold it (no QK-norm; normal(0, 0.02) initialisation of every matrix, through `export_hf`),
             the loss inside the compiled module, the run's precision (bf16 autocast where the hardware has it, as `dtype: auto` decides for both sides), 8 x 256-token sequences x 4 accumulated
             (the AdamW demo preset's batch), fused AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1 on
             matmul weights, linear warmup over 10% of the steps, cosine to 10%), gradient clipping at 1.0,
             a plain loop;
  llamaflow  the real engine (`tasks.training.fit`) with the preset's recipe (its optimizer, LRs, schedule),
             `--recipe-steps` steps (default: the baseline's token budget).
With `--sweep SPEC` both recipes are tuned with the same budget: llamaflow's side takes the best trial of
that sweep (`python -m flows.sweep SPEC` first), and the baseline's learning rate is searched here with the
spec's number of trials, sampler, seed and pruner at the same number of steps (an Optuna study of its own,
`<name>.baseline`, in the sweep's storage: a rerun continues it), scored by the speedrun's own bits per byte
at every `eval_every` steps of the spec's base (what the pruner compares).
Validation bits per byte (summed token loss in bits over the UTF-8 bytes of the scored text) is measured on
a fixed, evenly spaced subset of the validation blocks at `--evals` points of each run, off the clock: the
baseline evaluates in its loop, llamaflow's checkpoints are evaluated after training. Wall time is the sum
of the optimizer steps' times (each side's own step timer), with the first step (compilation) replaced by
the median step. Output: benchmarks/results/<tag>.json and <tag>.png (bits per byte against wall time),
and the time llamaflow needs to reach the baseline's final bits per byte as a fraction of the baseline's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_common import RESULTS_DIR, load_average, machine_info, write_json  # noqa: E402
from flows.pretrain_config import PretrainConfig  # noqa: E402
from model import export_hf, load_pretrained  # noqa: E402
from tasks.build import build_model  # noqa: E402
from tasks.data.packed import open_blocks  # noqa: E402
from tasks.dataset import build_dataset  # noqa: E402
from tasks.tokenize import train_tokenizer  # noqa: E402
from tasks.training import TrainSettings, fit, read_metrics  # noqa: E402
from tasks.training.loader import IGNORE_INDEX, BlockLoader  # noqa: E402
from tasks.training.precision import autocast, resolve_dtype  # noqa: E402
from tasks.training.schedule import lr_at  # noqa: E402


def token_byte_lengths(tokenizer_path: str) -> np.ndarray:
    """UTF-8 bytes of each token id: a byte-level BPE writes one alphabet character per byte; special tokens 0."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token_id in range(len(lengths)):
        token = tokenizer.id_to_token(token_id)
        lengths[token_id] = 0 if token is None or token in special else len(token)
    return lengths


class BitsPerByte:
    """Exact validation bits per byte on fixed blocks; eager bf16 (or fp32) forward, PAD targets ignored."""

    def __init__(self, val: np.ndarray, byte_len: np.ndarray, pad_id: int, n_blocks: int, dtype: str) -> None:
        rows = np.unique(np.linspace(0, len(val) - 1, min(n_blocks, len(val))).round().astype(int))
        self.blocks = torch.from_numpy(np.asarray(val[rows]).astype(np.int64))
        targets = self.blocks[:, 1:]
        self.n_bytes = int(torch.from_numpy(byte_len)[targets].masked_fill(targets == pad_id, 0).sum())
        self.pad_id, self.dtype = pad_id, dtype

    @torch.no_grad()
    def __call__(self, logits_fn: Any) -> float:
        total = 0.0
        for start in range(0, len(self.blocks), 16):
            batch = self.blocks[start : start + 16]
            targets = batch[:, 1:].masked_fill(batch[:, 1:] == self.pad_id, IGNORE_INDEX)
            with autocast(CPU, self.dtype):
                logits = logits_fn(batch[:, :-1])
            total += float(
                F.cross_entropy(
                    logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100
                )
            )
        return total / math.log(2) / self.n_bytes


class HFLoss(torch.nn.Module):
    """transformers' model and its summed token loss, one module for torch.compile (how HF trains)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=inputs).logits
        with torch.autocast("cpu", enabled=False):
            return F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100
            )


def wall_curve(step_times: list[float]) -> list[float]:
    """Cumulative wall time after each step, the first (compiling) step counted as the median step."""
    steady = statistics.median(step_times[1:]) if len(step_times) > 1 else step_times[0]
    return list(np.cumsum([steady, *step_times[1:]]))


BASELINE_MICRO_BATCH, BASELINE_ACCUMULATE = 8, 4
CPU = torch.device("cpu")


def run_baseline(
    config: PretrainConfig,
    model_dir: Path,
    blocks: np.ndarray,
    pad_id: int,
    steps: int,
    eval_at: set[int],
    bpb: BitsPerByte,
    lr: float,
    on_eval: Any = None,
) -> dict[str, Any]:
    """The baseline's run; `on_eval(step, bits_per_byte)` is called at each evaluation (a pruner raises)."""
    from transformers import LlamaForCausalLM

    # The same initial weights as llamaflow's run, through the project's Hugging Face export.
    with tempfile.TemporaryDirectory() as hf_dir:
        export_hf(load_pretrained(model_dir), hf_dir)
        hf = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    hf.train()
    decay = [p for n, p in hf.named_parameters() if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in hf.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=True,
    )
    step_fn = torch.compile(HFLoss(hf), dynamic=False)
    loader = BlockLoader(
        blocks,
        pad_id=pad_id,
        micro_batch_size=BASELINE_MICRO_BATCH,
        accumulate_steps=BASELINE_ACCUMULATE,
        seed=config.seed,
    )
    warmup = max(1, round(0.1 * steps))
    precision = resolve_dtype(CPU, config.dtype)  # the same rule as llamaflow's side: `auto` is fp32 on AVX2
    params = list(hf.parameters())
    times, points = [], [(0, bpb(lambda x: hf(input_ids=x).logits))]
    for step in range(steps):
        batch = loader.next_step()
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=lr, total_steps=steps, warmup_steps=warmup, min_lr_ratio=0.1)
        n_tokens = int(sum((t != IGNORE_INDEX).sum() for _, t in batch.micro_batches))
        for inputs, targets in batch.micro_batches:
            with autocast(CPU, precision):
                loss = step_fn(inputs, targets)
            (loss / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if step + 1 in eval_at:
            hf.eval()
            points.append((step + 1, bpb(lambda x: hf(input_ids=x).logits)))
            hf.train()
            if on_eval is not None:
                on_eval(step + 1, points[-1][1])
    return {"step_times": times, "points": points, "tokens_per_step": n_tokens}


def tune_baseline_lr(
    spec: Any,
    config: PretrainConfig,
    baseline_dir: Path,
    blocks: np.ndarray,
    pad_id: int,
    steps: int,
    bpb: BitsPerByte,
    lr_range: tuple[float, float],
) -> dict[str, Any]:
    """The baseline's learning rate searched with the sweep's budget: its trials, sampler, seed and pruner."""
    import optuna

    from flows.sweep.study import open_storage, pruner_of, storage_url

    if spec.sampler == "grid":
        raise SystemExit(
            "--sweep: the baseline's learning rate is a range; give the sweep a tpe or random sampler"
        )
    sampler = (
        optuna.samplers.RandomSampler(seed=spec.seed)
        if spec.sampler == "random"
        else optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=max(2, min(10, spec.n_trials // 3)))
    )
    study = optuna.create_study(
        study_name=f"{spec.name}.baseline",
        storage=open_storage(storage_url(spec)),
        sampler=sampler,
        pruner=pruner_of(spec),
        direction="minimize",
        load_if_exists=True,
    )
    every = spec.base_config().eval_every or max(1, steps // 10)
    eval_at = set(range(every, steps + 1, every)) | {steps}

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", *lr_range, log=True)

        def report(step: int, value: float) -> None:
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned(f"step {step}: {value:.4f}")

        run = run_baseline(config, baseline_dir, blocks, pad_id, steps, eval_at, bpb, lr, on_eval=report)
        print(f"baseline lr {lr:.3g}: {run['points'][-1][1]:.4f} bits/byte")
        return run["points"][-1][1]

    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    left = spec.n_trials - len(study.get_trials(deepcopy=False, states=done))
    if left > 0:
        study.optimize(objective, n_trials=left)
    trials = study.get_trials(deepcopy=False, states=done)
    return {
        "study": study.study_name,
        "best_lr": study.best_params["lr"],
        "best_bpb": study.best_value,
        "trials": [{"lr": t.params["lr"], "state": t.state.name, "bpb": t.value} for t in trials],
    }


def swept_recipe(spec: Any) -> tuple[PretrainConfig, dict[str, Any]]:
    """llamaflow's side from the sweep's best trial (its values on the spec's base)."""
    from flows.sweep.spec import trial_values
    from flows.sweep.study import existing_study

    study = existing_study(spec)
    if study is None or not any(t.state.name == "COMPLETE" for t in study.get_trials(deepcopy=False)):
        raise SystemExit(
            f"--sweep: no finished trial of {spec.name}: run `python -m flows.sweep` on it first"
        )
    best = study.best_trial
    return PretrainConfig(**trial_values(spec, best.params)), {"params": best.params, "value": best.value}


def run_llamaflow(
    config: PretrainConfig,
    model_ref: Any,
    dataset_ref: Any,
    steps: int,
    eval_at: set[int],
    bpb: BitsPerByte,
    work: Path,
) -> dict[str, Any]:
    every = math.gcd(*sorted(eval_at))
    warmup = round(config.warmup_steps * steps / (config.max_steps or steps))
    settings = TrainSettings.model_validate(
        {
            **config.train_settings().model_dump(),
            "max_steps": steps,
            "warmup_steps": warmup,
            "checkpoint_every": every,
            "keep_checkpoints": len(eval_at) + 1,
            "device": "cpu",
        }
    )
    run_dir = work / "llamaflow"
    fit(model_ref, dataset_ref, settings, run_dir, progress=False)
    logged = read_metrics(run_dir)
    times = [logged[s]["train/step_time_s"] for s in sorted(logged)]
    initial = load_pretrained(model_ref.path).eval()
    points = [(0, bpb(initial))]
    for step in sorted(eval_at):
        model = load_pretrained(run_dir / f"step_{step:06d}").eval()
        points.append((step, bpb(model)))
    return {
        "step_times": times,
        "points": points,
        "tokens_per_step": logged[steps]["train/tokens_seen"] / steps,
    }


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First wall time at which the curve (time, bpb) reaches `target`, interpolating between points."""
    for (t0, b0), (t1, b1) in zip(curve, curve[1:], strict=False):
        if b1 <= target:
            return t1 if b0 == b1 else t0 + (b0 - target) / (b0 - b1) * (t1 - t0)
    return None


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for side in result["sides"].values():
        curve = side["curve"][1:]
        ax.plot([t for t, _ in curve], [b for _, b in curve], marker="o", ms=3, label=side["label"])
    ax.axhline(result["target_bpb"], color="grey", ls="--", lw=0.8, label="baseline's final bits per byte")
    if result["llamaflow_time_to_target_s"] is not None:
        ax.axvline(result["llamaflow_time_to_target_s"], color="grey", ls=":", lw=0.8)
        ax.set_title(
            f"llamaflow reaches the baseline's final quality in {result['fraction_of_baseline_time']:.2f}× its time"
        )
    ax.set_xlabel("training wall time, s (compilation and evaluation excluded)")
    ax.set_ylabel("validation bits per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=int, default=150, help="baseline optimizer steps (its token budget)")
    parser.add_argument(
        "--recipe-steps", type=int, default=0, help="llamaflow's steps (default: the same tokens)"
    )
    parser.add_argument("--evals", type=int, default=10, help="evaluation points per side")
    parser.add_argument("--eval-blocks", type=int, default=96)
    parser.add_argument("--baseline-lr", type=float, default=2e-3)
    parser.add_argument(
        "--sweep", type=Path, default=None, help="tune both sides with this sweep spec's budget (see above)"
    )
    parser.add_argument("--baseline-lr-range", type=float, nargs=2, default=(2.5e-4, 1.6e-2))
    parser.add_argument("--tag", default="speedrun")
    args = parser.parse_args()

    config = PretrainConfig(preset=args.preset)
    spec, tuned = None, {}
    if args.sweep is not None:
        from flows.sweep.spec import load_spec

        spec = load_spec(args.sweep)
        config, tuned["llamaflow"] = swept_recipe(spec)
    tokenizer = train_tokenizer(config.data, config.vocab_size, val_fraction=config.val_fraction)
    dataset = build_dataset(config.data, tokenizer, config.seq_len, val_fraction=config.val_fraction)
    model_ref = build_model(config.llama_config(), seed=config.seed)
    plain_llama = replace(
        config.llama_config(), qk_norm=False, zero_init_output_projections=False, value_embeds=0
    )
    baseline_ref = build_model(plain_llama, seed=config.seed)
    blocks, val = open_blocks(dataset.path, "train"), open_blocks(dataset.path, "val")
    bpb = BitsPerByte(
        val,
        token_byte_lengths(tokenizer.path),
        tokenizer.pad_id,
        args.eval_blocks,
        resolve_dtype(CPU, config.dtype),
    )
    recipe_steps = args.recipe_steps or args.steps * BASELINE_MICRO_BATCH * BASELINE_ACCUMULATE // (
        config.micro_batch_size * config.accumulate_steps
    )

    def points(steps: int) -> set[int]:
        return {max(1, round(steps * (i + 1) / args.evals)) for i in range(args.evals)}

    load_before = load_average()
    torch.use_deterministic_algorithms(True)
    if spec is not None:
        tuned["baseline"] = tune_baseline_lr(
            spec,
            config,
            Path(baseline_ref.path),
            blocks,
            tokenizer.pad_id,
            args.steps,
            bpb,
            args.baseline_lr_range,
        )
        args.baseline_lr = tuned["baseline"]["best_lr"]
        load_before = load_average()
    baseline = run_baseline(
        config,
        Path(baseline_ref.path),
        blocks,
        tokenizer.pad_id,
        args.steps,
        points(args.steps),
        bpb,
        args.baseline_lr,
    )
    load_between = load_average()
    with tempfile.TemporaryDirectory() as work:
        ours = run_llamaflow(config, model_ref, dataset, recipe_steps, points(recipe_steps), bpb, Path(work))
    model_note = f", `{config.model}` model" if config.model != config.preset else ""
    sides = {}
    for name, side, label in (
        ("baseline", baseline, "transformers LlamaForCausalLM + compile, AdamW"),
        ("llamaflow", ours, f"llamaflow `{config.preset}` recipe" + model_note),
    ):
        wall = wall_curve(side["step_times"])
        curve = [(0.0 if step == 0 else float(wall[step - 1]), b) for step, b in side["points"]]
        sides[name] = {
            "label": label,
            "curve": curve,
            "train_time_s": float(wall[-1]),
            "tokens_per_s": side["tokens_per_step"] * len(wall) / float(wall[-1]),
            "compile_step_s": side["step_times"][0],
            "final_bpb": curve[-1][1],
            "steps": len(wall),
        }
    target = sides["baseline"]["final_bpb"]
    reach = time_to_reach(sides["llamaflow"]["curve"], target)
    result = {
        "command": " ".join(sys.argv),
        "preset": config.preset,
        "model": config.model,
        "recipe": config.train_settings().model_dump(),
        "baseline_lr": args.baseline_lr,
        "tuned": tuned or None,
        "sides": sides,
        "target_bpb": target,
        "llamaflow_time_to_target_s": reach,
        "fraction_of_baseline_time": None if reach is None else reach / sides["baseline"]["train_time_s"],
        "eval_blocks": len(bpb.blocks),
        "eval_bytes": bpb.n_bytes,
        "load_average": {"before": load_before, "between": load_between, "after": load_average()},
        "machine": machine_info(torch.device("cpu")),
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    write_json(RESULTS_DIR / f"{args.tag}.json", result)
    plot(result, RESULTS_DIR / f"{args.tag}.png")
    for name, side in sides.items():
        print(
            f"{name:10s} {side['steps']} steps  {side['train_time_s']:.0f} s  {side['tokens_per_s']:,.0f} tokens/s  "
            f"final {side['final_bpb']:.4f} bits/byte"
        )
    fraction = result["fraction_of_baseline_time"]
    print(
        f"llamaflow reaches {target:.4f} bits/byte after {reach if reach is None else round(reach, 1)} s: "
        f"{'never' if fraction is None else f'{fraction:.2f}x'} the baseline's time"
    )


if __name__ == "__main__":
    main()
