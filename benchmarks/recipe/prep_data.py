"""Build the main job's data (stdlib corpus, default val split) for the vocab/seq_len grid of the study."""

import json
from pathlib import Path

from tasks.dataset import build_dataset
from tasks.tokenize import train_tokenizer

out = {}
for vocab in (4096, 8192, 16384):
    tok = train_tokenizer(None, vocab, val_fraction=0.05)
    for seq in (128, 256, 512) if vocab == 8192 else (256,):
        ds = build_dataset(None, tok, seq, val_fraction=0.05, seed=1337)
        out[f"v{vocab}_s{seq}"] = {
            "tokenizer": tok.path,
            "dataset": ds.path,
            "pad_id": tok.pad_id,
            "eos_id": tok.eos_id,
            "train_blocks": ds.train_blocks,
            "val_blocks": ds.val_blocks,
            "train_tokens": ds.train_tokens,
            "val_tokens": ds.val_tokens,
            "stats": ds.stats,
        }
        print(vocab, seq, ds.train_blocks, ds.val_blocks, ds.train_tokens, ds.val_tokens, flush=True)
Path(__file__).with_name("data.json").write_text(json.dumps(out, indent=1))
