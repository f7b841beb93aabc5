"""The data stages of the `pretrain` flow: the tokenizer (trained on the corpus, or the one that came with
the parent's weights), its checks against the model before any work, the corpus tokenized as mapped
`tokenize_shard` runs (only files whose tokens are not cached), then the packed dataset.

The shards run on the flow's task runner: threads by default; a Dask or Ray cluster when the flow is given
`DaskTaskRunner` / `RayTaskRunner` (prefect-dask, prefect-ray; docs/continued-pretraining.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flows.pretrain_config import PretrainConfig
from model import LlamaConfig
from tasks.build import parent_config
from tasks.data.errors import data_logger
from tasks.dataset import build_dataset_task, plan_tokenization_task, tokenize_shard_task
from tasks.init_from import InitFromError
from tasks.init_from.vocab import check_extends, check_positions, embedding_rows
from tasks.refs import DatasetRef, ParentRef, TokenizerRef
from tasks.scoring import check_byte_level
from tasks.tokenize import import_tokenizer, train_tokenizer_task


def tokenizer_for(config: PretrainConfig, parent: ParentRef | None) -> tuple[TokenizerRef, LlamaConfig]:
    """The run's tokenizer and model architecture, checked against each other before any data work.

    From a parent: its own tokenizer (never a new one), or `config.tokenizer` when that extends it; the
    tokenizer must fit the embedding (or `resize_embeddings` grows it)."""
    if parent is None:
        tokenizer = train_tokenizer_task(
            config.data,
            config.vocab_size,
            val_fraction=config.val_fraction,
            val_data=config.val_data,
            text_field=config.text_field,
            tokenizer_path=config.tokenizer,
        )
        model_config = config.llama_config()
    else:
        base = parent_config(parent)
        path = config.tokenizer or parent.tokenizer_path
        if path is None:
            raise InitFromError(
                f"init_from={parent.source!r} ({parent.pinned}) came without a tokenizer.json, and a run "
                "from a model uses that model's tokenizer: give the one it was trained with as tokenizer=PATH"
            )
        own = path == parent.tokenizer_path
        tokenizer = import_tokenizer(
            path,
            special_tokens=parent.special_tokens if own else None,
            embedding_rows=base.vocab_size,  # a pad token is added only into a spare row
        )
        if not own:
            check_extends(tokenizer, parent)
        rows = embedding_rows(tokenizer, parent, base, config.resize_embeddings)
        model_config = config.llama_config(parent=base, vocab_size=rows)
        check_positions(config.seq_len, model_config, parent.source)
        if rows != base.vocab_size:
            data_logger().info(
                f"embedding grows from {base.vocab_size} to {rows} rows for the tokenizer's added tokens "
                "(resize_embeddings): new rows start as the mean of the parent's"
            )
    check_byte_level(tokenizer)  # bits per byte counts the tokens' bytes: refuse before any training
    return tokenizer, model_config


def build_data(config: PretrainConfig, tokenizer: TokenizerRef) -> DatasetRef:
    """Tokenize what is not cached as mapped shard runs, then pack (cached by content fingerprint)."""
    options = {
        "val_fraction": config.val_fraction,
        "val_data": config.val_data,
        "text_field": config.text_field,
    }
    shards = plan_tokenization_task(config.data, tokenizer, config.seq_len, **options)
    if shards:
        tokenize_shard_task.map(shards).result()  # raises the first shard's error
    return build_dataset_task(config.data, tokenizer, config.seq_len, seed=config.seed, **options)


def keep_tokenizer(run_dir: str, tokenizer: TokenizerRef) -> None:
    """A copy of the tokenizer in the run directory: `init_from=<run dir>/step_N` then finds it."""
    target = Path(run_dir) / "tokenizer.json"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer.path, target)
