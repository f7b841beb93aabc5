"""A stand-in for a downloaded Hugging Face Llama checkpoint: a `transformers.LlamaForCausalLM` with a
byte-level BPE tokenizer built by `tokenizers` (Llama 3's kind: `<|begin_of_text|>`, `<|end_of_text|>`, no
pad token, as many tokens as embedding rows), saved with `save_pretrained`, and the same files laid out as
the Hugging Face hub cache keeps a downloaded repository (blobs, a snapshot of symlinks, refs/main)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stdlib_corpus import stdlib_text

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def stdlib_texts(
    names: tuple[str, ...] = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py"),
) -> list[str]:
    return stdlib_text(names)


def byte_level_tokenizer(vocab_size: int = 320) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_texts(), trainer=trainer)
    return tokenizer


def save_hf_llama(directory: Path, *, seed: int = 0, vocab_size: int = 320) -> Path:
    """A tiny Llama as `save_pretrained` writes it (safetensors), with tokenizer.json and its config."""
    tokenizer = byte_level_tokenizer(vocab_size)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS})
    )
    return directory


def put_in_hf_cache(cache: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT) -> Path:
    """The checkpoint's files as the hub cache holds a download of `repo_id` at `commit` (branch main)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
