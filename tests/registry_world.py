"""The small but real world of the registry tests: BPE tokenizers trained on a few KB of stdlib source,
packed datasets built by the dataset stage, `tiny` Llamas at random init and after 10 and 40 AdamW steps.

A test module builds it once in a module fixture: `build_world(tmp_path_factory.mktemp("world"))`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model import LlamaConfig, LlamaForPretraining, get_preset, save_weights
from stdlib_corpus import stdlib_text
from tasks.dataset import build_dataset
from tasks.evaluate import evaluate
from tasks.refs import CheckpointRef, DatasetRef, EvalResult, TokenizerRef
from tasks.tokenize import train_tokenizer
from tasks.tracking import store as tracking_store

SEQ_LEN = 64
VOCAB = 384
OTHER_VOCAB = 320
PAD_ID, BOS_ID, EOS_ID = 2, 0, 1


def corpus(root: Path, name: str, texts: list[str]) -> str:
    directory = root / name
    directory.mkdir(parents=True)
    for i, text in enumerate(texts):
        (directory / f"doc{i}.py").write_text(text, encoding="utf-8")
    return str(directory)


def save_checkpoint(directory: Path, model: LlamaForPretraining) -> CheckpointRef:
    directory.mkdir(parents=True)
    save_weights(model, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    return CheckpointRef(path=str(directory), run_dir=str(directory.parent), step=0, tokens_seen=0)


def tiny_config(vocab_size: int = VOCAB) -> LlamaConfig:
    return get_preset("tiny", vocab_size=vocab_size, max_position_embeddings=128)


def train_steps(model: LlamaForPretraining, dataset: DatasetRef, steps: int, seed: int = 0) -> None:
    blocks = torch.from_numpy(np.load(Path(dataset.path) / "train.npy").astype(np.int64))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = blocks[torch.randint(len(blocks), (8,), generator=generator)]
        targets = batch[:, 1:].masked_fill(batch[:, 1:] == PAD_ID, -100)
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), targets.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def score(
    checkpoint: CheckpointRef, dataset: DatasetRef, tokenizer: TokenizerRef, max_blocks: int = 256
) -> EvalResult:
    """What the evaluate stage reports for `checkpoint` (no samples), on CPU."""
    return evaluate(checkpoint, dataset, tokenizer, max_blocks=max_blocks, num_samples=0, device="cpu")


@dataclass(frozen=True)
class World:
    tokenizer: TokenizerRef
    dataset: DatasetRef
    other_dataset: DatasetRef
    random_init: CheckpointRef
    other_init: CheckpointRef
    half_trained: CheckpointRef
    trained: CheckpointRef
    # Another vocabulary on the same text: its dataset's validation split is `dataset`'s validation text.
    other_tokenizer: TokenizerRef
    other_vocab_dataset: DatasetRef
    other_vocab_init: CheckpointRef


@contextmanager
def one_thread() -> Iterator[None]:
    # The tiny model runs ~20x slower on 2 threads than on 1 when other processes share the 2 cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_world(root: Path) -> World:
    texts = stdlib_text(("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "bisect.py"), 6000)
    a_train, a_val = corpus(root, "a-train", texts[:4]), corpus(root, "a-val", texts[4:])
    tokenizer = train_tokenizer(a_train, VOCAB, val_data=a_val)
    dataset = build_dataset(a_train, tokenizer, SEQ_LEN, val_data=a_val, keep_remainder=True)
    b_train, b_val = corpus(root, "b-train", texts[1:]), corpus(root, "b-val", texts[:1])
    other = build_dataset(b_train, tokenizer, SEQ_LEN, val_data=b_val, keep_remainder=True)
    other_tokenizer = train_tokenizer(a_train, OTHER_VOCAB, val_data=a_val)
    other_vocab_dataset = build_dataset(
        a_train, other_tokenizer, SEQ_LEN, val_data=a_val, keep_remainder=True
    )
    torch.manual_seed(0)
    model = LlamaForPretraining(tiny_config())
    random_init = save_checkpoint(root / "random-init", model)
    torch.manual_seed(1)
    other_init = save_checkpoint(root / "other-init", LlamaForPretraining(tiny_config()))
    train_steps(model, dataset, steps=10)
    half_trained = save_checkpoint(root / "half-trained", model)
    train_steps(model, dataset, steps=30, seed=1)
    trained = save_checkpoint(root / "trained", model)
    torch.manual_seed(2)
    other_vocab_init = save_checkpoint(
        root / "other-vocab-init", LlamaForPretraining(tiny_config(OTHER_VOCAB))
    )
    return World(
        tokenizer,
        dataset,
        other,
        random_init,
        other_init,
        half_trained,
        trained,
        other_tokenizer,
        other_vocab_dataset,
        other_vocab_init,
    )


@contextmanager
def sqlite_store(root: Path) -> Iterator[str]:
    """A SQLite store under `root`, the embedded default while the context lasts."""
    uri = f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLAMAFLOW_MLRUNS", str(root / "mlruns"))
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


def mlmodel_absolute_paths(mlmodel: dict, roots: list[str]) -> list[str]:
    """Every string in a parsed MLmodel that names a place on some machine."""
    found: list[str] = []

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str) and (value.startswith(("/", "file:")) or any(r in value for r in roots)):
            found.append(value)

    walk(mlmodel)
    return found


def new_run(name: str, uri: str | None = None) -> str:
    return tracking_store.start_run("register-tests", run_name=name, uri=uri)
