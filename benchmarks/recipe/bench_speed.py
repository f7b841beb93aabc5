"""Tokens/s of recipe variants measured side by side: all built and compiled in one process, then timed
in interleaved rounds (each round runs `--steps` optimizer steps of every variant in turn).

usage: bench_speed.py --variants 'NAME:harness args;NAME:harness args' --rounds 4 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import harness as H
import numpy as np
import torch
from exp_model import ExpConfig, ExpLlama

from tasks.training.loader import IGNORE_INDEX, BlockLoader


class Variant:
    def __init__(self, name: str, argv: list[str]) -> None:
        a = H.parse(["--name", name, *argv])
        data = json.loads((H.HERE / "data.json").read_text())[a.data]
        ds = Path(data["dataset"])
        meta = json.loads((ds / "meta.json").read_text())
        train = np.load(ds / "train.npy", mmap_mode="r")
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
            mlp=a.mlp,
            logit_softcap=a.softcap,
            document_mask=a.doc_mask,
            eos_id=data["eos_id"],
            value_embeds=a.ve,
            embed_norm=a.embed_norm,
            max_position_embeddings=max(1024, meta["seq_len"]),
        )
        if a.opt == "muon" and not a.embed_lr:
            a.embed_lr = a.scalar_lr = 4e-3
        self.name, self.a = name, a
        self.model = ExpLlama(cfg)
        self.params = [p for p in self.model.parameters()]
        self.opts = H.build_optimizers(self.model, a)
        self.loader = BlockLoader(
            train, pad_id=data["pad_id"], micro_batch_size=a.micro, accumulate_steps=a.accum, seed=a.seed
        )
        self.step_model = torch.compile(H.LossHead(self.model), dynamic=False)
        self.times: list[float] = []
        self.tokens_per_step = 0

    def step(self) -> float:
        t0 = time.perf_counter()
        batch = self.loader.next_step()
        n_tok = int(sum((t != IGNORE_INDEX).sum() for _, t in batch.micro_batches))
        for inputs, targets in batch.micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.step_model(inputs, targets)
            (loss / n_tok).backward()
            float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        for o in self.opts:
            o.step()
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        self.tokens_per_step = n_tok
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tag", default="speed")
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    variants = []
    compile_s = {}
    for spec in args.variants.split(";"):
        name, _, rest = spec.partition(":")
        v = Variant(name.strip(), rest.split())
        t0 = time.perf_counter()
        v.step()
        v.step()  # warm-up (compile + lazy optimizer state)
        compile_s[v.name] = round(time.perf_counter() - t0, 1)
        variants.append(v)
    load_before = H.load_avg()
    for _ in range(args.rounds):
        for v in variants:
            for _ in range(args.steps):
                v.times.append(v.step())
    load_after = H.load_avg()
    rows = []
    base = None
    for v in variants:
        med = statistics.median(v.times)
        tps = v.tokens_per_step / med
        base = base or tps
        rows.append(
            dict(
                name=v.name,
                args=" ".join(v.a.__dict__.get("_argv", [])),
                tokens_per_step=v.tokens_per_step,
                median_step_s=round(med, 4),
                best_step_s=round(min(v.times), 4),
                tokens_per_s=round(tps),
                ratio_to_first=round(tps / base, 3),
                warmup_s=compile_s[v.name],
            )
        )
        print(
            f"{v.name:24s} {tps:8.0f} tok/s  ratio {tps / base:.3f}  median {med * 1e3:.0f} ms  best "
            f"{min(v.times) * 1e3:.0f} ms  warm-up {compile_s[v.name]} s",
            flush=True,
        )
    print(f"load {load_before} -> {load_after}")
    out = dict(
        variants=args.variants,
        rounds=args.rounds,
        steps=args.steps,
        rows=rows,
        load_before=load_before,
        load_after=load_after,
        threads=torch.get_num_threads(),
    )
    (H.HERE / "results" / f"{args.tag}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
