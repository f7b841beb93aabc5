"""Recipe-study harness: train at a fixed wall-clock budget, evaluate exact validation bits per byte.

Data: the main job's packed stdlib blocks (tasks/dataset.py), read in the engine's order (BlockLoader).
Step: like the engine: model + summed fp32 token loss compiled as one module, bf16 autocast, exact
accumulation (sum / step tokens), grad clipping, deterministic algorithms.
Clock: starts after a compile warm-up (forward+backward of the first batch, gradients discarded), stops
during evaluation. The LR schedule runs on progress = training seconds / budget (or steps / max_steps
with --steps), so every variant spends exactly the budget.
Bits per byte: summed token cross-entropy (nats) / ln 2 / UTF-8 bytes of the scored targets, where a
target's bytes are its token's byte length (byte-level BPE: one character per byte; special tokens 0).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from exp_model import ExpConfig, ExpLlama
from muon_split import SplitMuon
from tokenizers import Tokenizer

from tasks.training.loader import IGNORE_INDEX, BlockLoader

HERE = Path(__file__).resolve().parent


def load_avg() -> list[float]:
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def token_byte_lengths(tokenizer_path: str) -> np.ndarray:
    tok = Tokenizer.from_file(tokenizer_path)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    n = tok.get_vocab_size(with_added_tokens=True)
    lengths = np.zeros(n, dtype=np.int64)
    for i in range(n):
        s = tok.id_to_token(i)
        lengths[i] = 0 if (s is None or s in special) else len(s)
    return lengths


class Evaluator:
    """Exact bits per byte on fixed validation blocks (PAD targets ignored)."""

    def __init__(
        self, val: np.ndarray, byte_len: np.ndarray, pad_id: int, indices: np.ndarray, batch: int = 16
    ):
        self.blocks = torch.from_numpy(np.asarray(val[indices]).astype(np.int64))
        targets = self.blocks[:, 1:]
        self.n_bytes = int(torch.from_numpy(byte_len)[targets].masked_fill(targets == pad_id, 0).sum())
        self.n_tokens = int((targets != pad_id).sum())
        self.pad_id = pad_id
        self.batch = batch

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        was = model.training
        model.eval()
        total = 0.0
        for s in range(0, len(self.blocks), self.batch):
            b = self.blocks[s : s + self.batch]
            inputs, targets = b[:, :-1], b[:, 1:].clone()
            targets[targets == self.pad_id] = IGNORE_INDEX
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(inputs)
            total += float(
                F.cross_entropy(
                    logits.float().flatten(0, 1),
                    targets.flatten(),
                    reduction="sum",
                    ignore_index=IGNORE_INDEX,
                )
            )
        model.train(was)
        return {"loss": total / self.n_tokens, "bpb": total / math.log(2) / self.n_bytes}


class LossHead(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs)
        with torch.autocast("cpu", enabled=False):
            return F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
            )


def lr_mult(p: float, a: argparse.Namespace) -> float:
    """LR multiplier at progress p in [0, 1)."""
    if p < a.warmup:
        return (p + 1e-9) / a.warmup if a.warmup_shape == "linear" else 1.0
    if a.schedule == "cosine":
        q = min(1.0, (p - a.warmup) / max(1e-9, 1 - a.warmup))
        return a.min_lr + (1 - a.min_lr) * 0.5 * (1 + math.cos(math.pi * q))
    if a.schedule == "wsd":
        start = 1 - a.decay
        if p < start:
            return 1.0
        return 1.0 + (a.min_lr - 1.0) * min(1.0, (p - start) / a.decay)
    if a.schedule == "constant":
        return 1.0
    raise ValueError(a.schedule)


def build_optimizers(model: ExpLlama, a: argparse.Namespace) -> list[torch.optim.Optimizer]:
    c = model.config
    embed = [model.model.embed_tokens.weight] + (
        [p for e in model.value_embeds for p in e.parameters()] if c.value_embeds else []
    )
    head = [] if c.tie_word_embeddings else [model.lm_head.weight]
    hidden = [p for n, p in model.model.layers.named_parameters() if p.ndim == 2]
    seen = {id(p) for p in embed + head + hidden}
    scalars = [p for p in model.parameters() if id(p) not in seen]
    if a.opt == "adamw":
        # the engine's groups: weight decay on matmul weights only (a tied head counts as embedding)
        decay = hidden + head
        groups = [
            dict(params=decay, weight_decay=a.wd, lr=a.lr),
            dict(params=embed + scalars, weight_decay=0.0, lr=a.lr),
        ]
        if a.embed_lr:  # separate LRs even for AdamW
            groups = [
                dict(params=hidden, weight_decay=a.wd, lr=a.lr),
                dict(params=embed, weight_decay=0.0, lr=a.embed_lr),
            ]
            if head:
                groups.append(dict(params=head, weight_decay=a.wd, lr=a.head_lr or a.lr))
            groups.append(dict(params=scalars, weight_decay=0.0, lr=a.scalar_lr or a.lr))
        for g in groups:
            g["base_lr"] = g["lr"]
        return [torch.optim.AdamW(groups, betas=(a.beta1, a.beta2), eps=1e-8, fused=True)]
    adam_groups = [dict(params=embed, lr=a.embed_lr, weight_decay=0.0)]
    if head:
        adam_groups.append(dict(params=head, lr=a.head_lr, weight_decay=0.0))
    adam_groups.append(dict(params=scalars, lr=a.scalar_lr, weight_decay=0.0))
    for g in adam_groups:
        g["base_lr"] = g["lr"]
    adam = torch.optim.AdamW(adam_groups, betas=(a.beta1, a.beta2), eps=1e-8, fused=True)
    if a.muon_impl == "torch":
        muon = torch.optim.Muon(
            hidden,
            lr=a.muon_lr,
            momentum=a.momentum,
            nesterov=True,
            ns_steps=a.ns_steps,
            weight_decay=a.muon_wd,
            adjust_lr_fn=a.adjust,
        )
    else:
        splits = {}
        if a.muon_impl == "split":
            for layer in model.model.layers:
                at = layer.self_attn
                splits[id(at.qkv_proj.weight)] = [at.nh * at.hd, at.nkv * at.hd, at.nkv * at.hd]
                if c.mlp == "swiglu":
                    splits[id(layer.mlp.gate_up_proj.weight)] = [c.intermediate_size] * 2
        muon = SplitMuon(
            hidden,
            lr=a.muon_lr,
            momentum=a.momentum,
            ns_steps=a.ns_steps,
            weight_decay=a.muon_wd,
            adjust=a.adjust or "original",
            splits=splits,
            compiled=False,
        )
    for g in muon.param_groups:
        g["base_lr"] = g["lr"]
    return [adam, muon]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--lever", default="")
    p.add_argument("--budget", type=float, default=120.0, help="training seconds")
    p.add_argument("--steps", type=int, default=0, help="step-based schedule instead of the time budget")
    p.add_argument("--data", default="v8192_s256")
    p.add_argument("--seed", type=int, default=1337)
    # model
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=688)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv", type=int, default=4)
    p.add_argument("--untie", action="store_true")
    p.add_argument("--qk-norm", action="store_true")
    p.add_argument("--zero-init", action="store_true")
    p.add_argument("--zero-head", action="store_true")
    p.add_argument("--mlp", default="swiglu")
    p.add_argument("--softcap", type=float, default=0.0)
    p.add_argument("--doc-mask", action="store_true")
    p.add_argument("--ve", type=int, default=0)
    p.add_argument("--embed-norm", action="store_true")
    p.add_argument("--init-std", type=float, default=0.02)
    # optimisation
    p.add_argument("--opt", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--embed-lr", type=float, default=0.0)
    p.add_argument("--head-lr", type=float, default=0.0)
    p.add_argument("--scalar-lr", type=float, default=0.0)
    p.add_argument("--muon-wd", type=float, default=0.0)
    p.add_argument("--momentum", type=float, default=0.95)
    p.add_argument(
        "--momentum-warmup", type=float, default=0.0, help="fraction of progress from 0.85 to momentum"
    )
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--adjust", default=None)
    p.add_argument("--muon-impl", default="torch", choices=["torch", "own", "split"])
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--schedule", default="cosine")
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the budget")
    p.add_argument("--warmup-shape", default="linear")
    p.add_argument("--min-lr", type=float, default=0.1)
    p.add_argument("--decay", type=float, default=0.2, help="wsd: decay fraction")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument(
        "--eval-every", type=float, default=0.1, help="fraction of the budget between subset evals"
    )
    p.add_argument("--eval-blocks", type=int, default=64)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--threads", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    data = json.loads((HERE / "data.json").read_text())[a.data]
    ds = Path(data["dataset"])
    meta = json.loads((ds / "meta.json").read_text())
    train = np.load(ds / "train.npy", mmap_mode="r")
    val = np.load(ds / "val.npy", mmap_mode="r")
    byte_len = token_byte_lengths(data["tokenizer"])
    pad, eos = data["pad_id"], data["eos_id"]
    subset = np.unique(np.linspace(0, len(val) - 1, a.eval_blocks).round().astype(int))
    eval_subset = Evaluator(val, byte_len, pad, subset)
    eval_full = Evaluator(val, byte_len, pad, np.arange(len(val)))

    cfg = ExpConfig(
        vocab_size=meta["vocab_size"],
        hidden_size=a.hidden,
        intermediate_size=a.inter,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv,
        tie_word_embeddings=not a.untie,
        qk_norm=a.qk_norm,
        zero_init_out=a.zero_init,
        zero_init_head=a.zero_head,
        mlp=a.mlp,
        logit_softcap=a.softcap,
        document_mask=a.doc_mask,
        eos_id=eos,
        value_embeds=a.ve,
        embed_norm=a.embed_norm,
        initializer_range=a.init_std,
        max_position_embeddings=max(1024, meta["seq_len"]),
    )
    model = ExpLlama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    optimizers = build_optimizers(model, a)
    params = [p for p in model.parameters() if p.requires_grad]
    loader = BlockLoader(train, pad_id=pad, micro_batch_size=a.micro, accumulate_steps=a.accum, seed=a.seed)
    step_model = LossHead(model)
    if not a.no_compile:
        step_model = torch.compile(step_model, dynamic=False)

    load_before = load_avg()
    # compile warm-up on the first batch; the gradients are thrown away
    t0 = time.perf_counter()
    inputs, targets = loader.next_step().micro_batches[0]
    loader.load_state_dict({"epoch": 0, "index": 0, "seed": a.seed, "n_blocks": len(train)})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step_model(inputs, targets).backward()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    compile_s = time.perf_counter() - t0

    curve = []
    train_time, tokens, step = 0.0, 0, 0
    evals_done = 0  # subset evaluations after step 0; counted, since progress % eval_every drifts
    losses = []
    ev = eval_subset(model)
    curve.append(dict(t=0.0, tokens=0, step=0, **ev))
    loads = [load_avg()]
    while True:
        progress = step / a.steps if a.steps else train_time / a.budget
        if progress >= 1.0:
            break
        t_start = time.perf_counter()
        mult = lr_mult(progress, a)
        for opt in optimizers:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * mult
        if a.opt == "muon" and a.momentum_warmup:
            f = min(1.0, progress / a.momentum_warmup)
            for g in optimizers[1].param_groups:
                g["momentum"] = (1 - f) * 0.85 + f * a.momentum
        batch = loader.next_step()
        n_tok = int(sum((t != IGNORE_INDEX).sum() for _, t in batch.micro_batches))
        loss_sum = 0.0
        for inputs, targets in batch.micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = step_model(inputs, targets)
            (loss / n_tok).backward()
            loss_sum += float(loss.detach())
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, a.clip if a.clip > 0 else float("inf")))
        if not math.isfinite(loss_sum) or not math.isfinite(gnorm):
            print(f"non-finite at step {step}: loss {loss_sum} gnorm {gnorm}", flush=True)
            break
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t_start
        tokens += n_tok
        step += 1
        losses.append(loss_sum / n_tok)
        progress = step / a.steps if a.steps else train_time / a.budget
        if progress >= (evals_done + 1) * a.eval_every - 1e-9 or progress >= 1.0:
            evals_done = int(progress / a.eval_every + 1e-9)
            ev = eval_subset(model)
            curve.append(
                dict(
                    t=round(train_time, 2),
                    tokens=tokens,
                    step=step,
                    train_loss=float(np.mean(losses[-10:])),
                    **ev,
                )
            )
            loads.append(load_avg())
            print(
                f"[{a.name}] t={train_time:6.1f}s step={step} tok={tokens} train={np.mean(losses[-10:]):.3f} "
                f"val_subset_bpb={ev['bpb']:.4f} load={loads[-1][0]}",
                flush=True,
            )
    final = eval_full(model)
    result = dict(
        name=a.name,
        lever=a.lever,
        args=vars(a),
        n_params=n_params,
        steps=step,
        tokens=tokens,
        train_time_s=round(train_time, 2),
        tokens_per_s=round(tokens / max(train_time, 1e-9), 1),
        compile_s=round(compile_s, 1),
        final_full_val=final,
        final_subset_val=curve[-1],
        eval_tokens=eval_full.n_tokens,
        eval_bytes=eval_full.n_bytes,
        curve=curve,
        load_before=load_before,
        load_during=loads,
        load_after=load_avg(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
    )
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    print(
        f"RESULT {a.name}: full-val bpb {final['bpb']:.4f} (loss {final['loss']:.4f}) steps {step} "
        f"tokens {tokens} tok/s {result['tokens_per_s']:.0f} compile {compile_s:.1f}s "
        f"load {load_before[0]}->{result['load_after'][0]}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
