"""The epoch's leftover: which step to take at an epoch's end, measured from the same model state.

    .venv/bin/python benchmarks/epoch_leftover.py [--seeds 3] [--steps 240] [--branch-at 48,96,144,192] \
        [--leftovers 1,4] [--after 10] [--threads 1]

An epoch of n blocks with a global batch of G leaves r = n mod G blocks after its full steps. The run length
is counted in optimizer steps (max_steps, or epochs turned into steps up front), so the question is what the
step at an epoch's end trains on:
  step   the r leftover blocks alone at the scheduled LR (llamaflow's loader before this benchmark): Muon's
         update, orthogonalised, has a full step's size whatever the gradient was averaged over;
  scale  the r blocks, with every param group's LR (AdamW and Muon) scaled by r / G;
  drop   a whole batch of the next epoch (the r blocks are skipped this epoch, other ones the next);
  carry  a whole batch: the r blocks, filled up with the next epoch's first G - r (the loader's order since:
         `check_carry_is_the_loader` asserts it).
drop and carry take the same kind of step, a full batch; they differ in coverage (drop never trains on r
blocks of every epoch), not in the step. So three steps are compared, each taken from the same model and
optimizer state: `full` (G blocks: drop and carry), `step` (r blocks, full LR) and `scale` (r blocks, r/G LR).

Method: one run of the main job's recipe over a single pass of its data (no block is seen twice, so the
held-out loss measures learning, not memorisation): the main job's data (the stdlib corpus, 4,096-token
vocabulary, packed by the data stages; sequences cut to `--seq-len` tokens to halve the cost), the demo
preset's optimizer and schedule (`PretrainConfig(preset="demo")`: Muon for the hidden matrices, AdamW for the
rest, warmup-stable-decay to zero over `--steps`), built by the engine's own `build_optimizer`, `LossHead`
and `lr_at`, the loop's exact token-mean loss and clipping, fp32, deterministic algorithms; the model is the
`tiny` preset with the demo's overrides (QK-norm, zero-initialised output projections, a value-embedding
table), so the whole measurement costs a few CPU-minutes. At each branch step the model and optimizer state
are copied; each variant takes its step from that copy, then the same `--after` full steps (the run's next
batches). Reported: the held-out loss (nats per token, the first 128 validation blocks) after that step and
after the `--after` steps, as the difference to `full`, per seed and branch step and on average; and what a
full step gains at that point, for scale. Results: benchmarks/results/epoch_leftover.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.bench_common import (  # noqa: E402
    RESULTS_DIR,
    load_average,
    machine_info,
    markdown_table,
    set_threads,
    write_json,
)
from flows.pretrain_config import PretrainConfig  # noqa: E402
from model import LlamaForPretraining, get_preset  # noqa: E402
from tasks.data.packed import open_blocks, read_meta  # noqa: E402
from tasks.dataset import build_dataset  # noqa: E402
from tasks.tokenize import train_tokenizer  # noqa: E402
from tasks.training.loader import IGNORE_INDEX, BlockLoader  # noqa: E402
from tasks.training.loss import LossHead  # noqa: E402
from tasks.training.optim import build_optimizer  # noqa: E402
from tasks.training.schedule import lr_at  # noqa: E402

VOCAB, DATA_SEQ_LEN = 4096, 128  # the demo preset's data


def check_carry_is_the_loader(n: int, global_batch: int, seed: int) -> None:
    """`carry` is the engine loader's order: each epoch's permutation, the leftover opening the next step."""
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(4)])
    loader = BlockLoader(
        np.arange(n)[:, None].repeat(2, axis=1),
        pad_id=-1,
        micro_batch_size=global_batch,
        accumulate_steps=1,
        seed=seed,
    )
    for step in range(3 * n // global_batch):
        [(inputs, _)] = loader.next_step().micro_batches
        assert inputs[:, 0].tolist() == stream[step * global_batch : (step + 1) * global_batch].tolist()


def tensors(blocks: np.ndarray, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.from_numpy(blocks.astype(np.int64))
    inputs, targets = rows[:, :-1].clone(), rows[:, 1:].clone()
    targets[targets == pad_id] = IGNORE_INDEX
    return inputs, targets


class Run:
    """The model, optimizer and schedule of one seed, stepped one batch at a time."""

    def __init__(self, seed: int, pad_id: int, a: argparse.Namespace) -> None:
        self.settings = PretrainConfig(preset="demo", seed=seed).train_settings()
        config = get_preset(
            "tiny",
            vocab_size=VOCAB,
            max_position_embeddings=a.seq_len,
            qk_norm=True,
            zero_init_output_projections=True,
            value_embeds=1,
        )
        torch.manual_seed(seed)
        self.plain = LlamaForPretraining(config).train()
        self.optimizer = build_optimizer(self.plain, self.settings, torch.device("cpu"))
        self.head = LossHead(self.plain, eos_id=None)
        self.params = [p for p in self.plain.parameters() if p.requires_grad]
        self.pad_id, self.total_steps = pad_id, a.steps

    def step(self, index: int, blocks: np.ndarray, lr_factor: float = 1.0) -> float:
        s = self.settings
        scale = lr_at(
            index,
            lr=1.0,
            total_steps=self.total_steps,
            warmup_steps=s.warmup_steps,
            min_lr_ratio=s.min_lr_ratio,
            schedule=s.schedule,
            decay_fraction=s.decay_fraction,
        )
        self.optimizer.set_lr_scale(scale * lr_factor)
        inputs, targets = tensors(blocks, self.pad_id)
        loss = self.head(inputs, targets) / int((targets != IGNORE_INDEX).sum())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, s.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    @torch.no_grad()
    def held_out_loss(self, val: np.ndarray, batch: int) -> float:
        self.head.eval()
        total, count = 0.0, 0
        for start in range(0, len(val), batch):
            inputs, targets = tensors(val[start : start + batch], self.pad_id)
            total += float(self.head(inputs, targets))
            count += int((targets != IGNORE_INDEX).sum())
        self.head.train()
        return total / count

    def snapshot(self) -> tuple[dict, dict]:
        return copy.deepcopy(self.plain.state_dict()), copy.deepcopy(self.optimizer.state_dict())

    def restore(self, state: tuple[dict, dict]) -> None:
        self.plain.load_state_dict(state[0])
        self.optimizer.load_state_dict(copy.deepcopy(state[1]))


def branch(run: Run, at: int, batches: np.ndarray, val: np.ndarray, a: argparse.Namespace) -> list[dict]:
    """From the state before step `at`: each variant's step, then the same `a.after` full steps."""
    G = a.global_batch
    saved = run.snapshot()
    before = run.held_out_loss(val, G)
    variants = [("full", None, 1.0)] + [
        (name, r, factor) for r in a.leftovers for name, factor in (("step", 1.0), ("scale", r / G))
    ]
    out = []
    for name, r, factor in variants:
        run.restore(saved)
        run.step(at, batches[at] if r is None else batches[at][:r], factor)
        after_step = run.held_out_loss(val, G)
        for k in range(1, a.after + 1):
            run.step(at + k, batches[at + k])
        out.append(
            {
                "at": at,
                "variant": name,
                "leftover": r,
                "before": before,
                "after_step": after_step,
                "after_more": run.held_out_loss(val, G),
            }
        )
    run.restore(saved)
    return out


def summarize(rows: list[dict], a: argparse.Namespace) -> tuple[list[dict], str]:
    full = {(r["seed"], r["at"]): r for r in rows if r["variant"] == "full"}
    summary, table = [], []
    gains = [f["before"] - f["after_step"] for f in full.values()]
    for r in a.leftovers:
        for name in ("step", "scale"):
            mine = [x for x in rows if x["variant"] == name and x["leftover"] == r]
            d_step = [x["after_step"] - full[x["seed"], x["at"]]["after_step"] for x in mine]
            d_more = [x["after_more"] - full[x["seed"], x["at"]]["after_more"] for x in mine]
            entry = {
                "leftover": r,
                "variant": name,
                "vs_full_after_step": d_step,
                "vs_full_after_more": d_more,
                "mean_after_step": statistics.fmean(d_step),
                "mean_after_more": statistics.fmean(d_more),
                "worse_than_full_after_more": sum(d > 0 for d in d_more),
                "samples": len(mine),
            }
            summary.append(entry)
            table.append(
                [
                    f"{r} of {a.global_batch} blocks, {'full LR' if name == 'step' else f'LR x {r}/{a.global_batch}'}",
                    f"{entry['mean_after_step']:+.4f}",
                    f"{entry['mean_after_more']:+.4f}",
                    f"{entry['worse_than_full_after_more']} of {len(mine)}",
                    f"{min(d_more):+.4f} .. {max(d_more):+.4f}",
                ]
            )
    headers = [
        "the epoch-end step",
        "held-out loss - full, after it",
        f"after {a.after} more steps",
        "worse than full",
        "range",
    ]
    text = markdown_table(headers, table) + (
        f"\n\nA full step lowers the held-out loss by {statistics.fmean(gains):.4f} on average at these points "
        f"({min(gains):.4f} .. {max(gains):.4f})."
    )
    return summary, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=240, help="run length (the schedule's total steps)")
    p.add_argument("--branch-at", default="48,96,144,192", help="steps (0-based) where the variants branch")
    p.add_argument("--leftovers", default="1,4", help="leftover blocks r, comma-separated")
    p.add_argument("--after", type=int, default=10, help="full steps after the branch step")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--val-blocks", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS_DIR / "epoch_leftover.json"))
    a = p.parse_args()
    a.leftovers = [int(x) for x in a.leftovers.split(",")]
    branch_at = [int(x) for x in a.branch_at.split(",")]
    threads = set_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    for r in a.leftovers:
        check_carry_is_the_loader(15 * a.global_batch + r, a.global_batch, seed=0)

    tokenizer = train_tokenizer(None, VOCAB, val_fraction=0.05)
    dataset = build_dataset(None, tokenizer, DATA_SEQ_LEN, val_fraction=0.05, seed=1337)
    pad_id = read_meta(dataset.path)["pad_id"]
    train = np.asarray(open_blocks(dataset.path, "train"))[:, : a.seq_len + 1]
    val = np.asarray(open_blocks(dataset.path, "val"))[: a.val_blocks, : a.seq_len + 1]
    needed = (a.steps + a.after) * a.global_batch
    if needed > len(train):
        raise SystemExit(
            f"a single pass needs {needed} blocks, the train split has {len(train)}: fewer --steps"
        )

    started = {"load_average_before": load_average(), "machine": machine_info(torch.device("cpu"))}
    rows: list[dict] = []
    clock = time.perf_counter()
    for seed in range(a.seeds):
        order = np.random.default_rng([seed, 0]).permutation(len(train))[:needed]
        batches = train[order].reshape(a.steps + a.after, a.global_batch, -1)
        run = Run(seed, pad_id, a)
        for index in range(a.steps):
            if index in branch_at:
                for row in branch(run, index, batches, val, a):
                    rows.append({"seed": seed, **row})
                print(f"seed {seed} step {index}: branched ({time.perf_counter() - clock:.0f} s)", flush=True)
            run.step(index, batches[index])
    summary, table = summarize(rows, a)
    print(table)
    result = {
        "command": " ".join(sys.argv),
        **started,
        "load_average_after": load_average(),
        "seconds": time.perf_counter() - clock,
        "torch_threads": threads,
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "summary": summary,
        "table": table,
        "rows": rows,
    }
    print(f"wrote {write_json(Path(a.out), result)}")


if __name__ == "__main__":
    main()
