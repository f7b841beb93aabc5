"""The data stages of a run, in order: the tokenizer (trained on the corpus, or the one that came with the
parent's weights) checked against the model before any data work, then the corpus tokenized as mapped
`tokenize_shard` runs (only parts whose tokens are not cached) and packed.

The map runs on the flow's task runner (threads), or with `task_runner="dask"` on a Dask cluster through
prefect-dask: the one at `dask_address`, or a local cluster of `dask_workers` processes for this map. Workers
must see the corpus files and LLAMAFLOW_HOME at the same paths (a shared file system).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from prefect.futures import PrefectFutureList
from prefect.task_runners import ThreadPoolTaskRunner

from model import LlamaConfig
from tasks import home
from tasks.data import cache_budget
from tasks.data.cache import build_lock
from tasks.data.corpus import resolve_corpus
from tasks.data.counts import ShardReport
from tasks.data.cpus import usable_cpus
from tasks.data.errors import DataError, data_logger
from tasks.data.progress import Progress
from tasks.data.settings import DataSettings
from tasks.data.split import MANIFEST_NAME
from tasks.data.token_store import tokens_dir
from tasks.data.tokens import TokenShard, lost_parts
from tasks.dataset import (
    build_dataset_task,
    dataset_fingerprint,
    datasets_dir,
    plan_tokenization_task,
    tokenize_shard_task,
)
from tasks.init_from import InitFromError
from tasks.init_from.vocab import check_extends, embedding_rows
from tasks.refs import DatasetRef, ParentRef, TokenizerRef
from tasks.scoring import check_byte_level
from tasks.tokenize import SAMPLE_BYTES, import_tokenizer, train_tokenizer_task


def prepare_tokenizer(
    data: DataSettings,
    *,
    vocab_size: int,
    tokenizer_path: str | None,
    sample_bytes: int | None = SAMPLE_BYTES,
    parent: ParentRef | None = None,
    base: LlamaConfig | None = None,
    resize_embeddings: bool = False,
) -> tuple[TokenizerRef, int | None]:
    """The run's tokenizer, and with a parent (`base` its architecture) the embedding rows the model needs.

    From a parent: its own tokenizer (never a new one), or `tokenizer_path` when that extends it; the
    tokenizer must fit the embedding (or `resize_embeddings` grows it)."""
    rows = None
    if parent is None:
        tokenizer = train_tokenizer_task(
            data, vocab_size, sample_bytes=sample_bytes, tokenizer_path=tokenizer_path
        )
    else:
        assert base is not None, "a parent comes with its architecture"
        path = tokenizer_path or parent.tokenizer_path
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
        rows = embedding_rows(tokenizer, parent, base, resize_embeddings)
        if rows != base.vocab_size:
            data_logger().info(
                f"embedding grows from {base.vocab_size} to {rows} rows for the tokenizer's added tokens "
                "(resize_embeddings): new rows start as the mean of the parent's"
            )
    check_byte_level(tokenizer)  # bits per byte counts the tokens' bytes: refuse before any training
    return tokenizer, rows


def _dask_runner(data: DataSettings) -> Any:
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as err:
        raise DataError(
            "task_runner='dask' needs prefect-dask: pip install 'llamaflow[dask]' (or prefect-dask)"
        ) from err
    if data.dask_address is not None:
        return DaskTaskRunner(address=data.dask_address)
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": data.dask_workers,
            "threads_per_worker": 1,
            "processes": True,
        }
    )


def tokenize_shards(shards: list[TokenShard], data: DataSettings) -> list[ShardReport]:
    """Map `tokenize_shard` over `shards` on the configured task runner; raises the first shard's error."""
    if not shards:
        return []
    if data.task_runner == "threads":
        # A runner of its own: the flow's default starts a thread per shard at once (no bound), a tokenizer
        # and its buffers in each (5.4 GiB peak at 1 GB of JSONL); one per core is as fast.
        with ThreadPoolTaskRunner(max_workers=usable_cpus()) as runner:
            return _await(runner.map(tokenize_shard_task, parameters={"shard": shards}), shards)
    with _dask_runner(data) as runner:
        return _await(runner.map(tokenize_shard_task, parameters={"shard": shards}), shards)


def _await(futures: PrefectFutureList[ShardReport], shards: list[TokenShard]) -> list[ShardReport]:
    """The shards' results, with the progress of their bytes (in map order: shards are similar in size)."""
    with Progress("tokenizing", sum(shard.bytes for shard in shards)) as progress:
        for future, shard in zip(futures, shards, strict=True):
            future.wait()
            progress.update(shard.bytes)
    return futures.result()


def build_data(data: DataSettings, tokenizer: TokenizerRef, seq_len: int, *, seed: int) -> DatasetRef:
    """Tokenize what is not cached as mapped shard runs, then pack (cached by content fingerprint). The
    dataset's build lock is held throughout: a second run building the same dataset waits, then finds it
    built and tokenizes nothing."""
    fingerprint = dataset_fingerprint(resolve_corpus(data), tokenizer, seq_len, False, False)
    with build_lock(datasets_dir() / fingerprint):
        shards = plan_tokenization_task(data, tokenizer, seq_len)
        tokenize_shards(shards, data)
        if lost := lost_parts(shards):
            raise DataError(
                f"{len(lost)} file parts (of {lost[0].path}, ...) that the {data.task_runner} map tokenized are "
                f"not in this process's token cache {tokens_dir()}: the workers' output was lost or written "
                f"elsewhere. Workers must share LLAMAFLOW_HOME={home.home()} (the same path, on a shared file "
                "system)."
            )
        built = build_dataset_task(data, tokenizer, seq_len, seed=seed)
    if data.cache_max_size is not None:
        keep_within_budget(data.cache_max_size, built, tokenizer)
    return built


def keep_within_budget(max_size: str, dataset: DatasetRef, tokenizer: TokenizerRef) -> None:
    """Prune the data caches down to `max_size`, least recently used first, keeping this run's dataset and
    tokenizer; skipped (not waited for) while other runs build."""
    keep = frozenset({Path(dataset.path), Path(tokenizer.path).parent})
    result = cache_budget.prune(max_bytes=cache_budget.parse_size(max_size), keep=keep, wait=False)
    if result is None:
        data_logger().info(
            "cache_max_size: other runs are building datasets; the caches are pruned next time"
        )
        return
    removed, freed = result
    if removed:
        kinds = sorted({item.kind for item in removed})
        data_logger().info(
            f"cache_max_size={max_size}: removed {len(removed)} {'/'.join(kinds)} items ({freed:,} bytes)"
        )


def parent_split(data: DataSettings, parent: ParentRef | None, run_dir: str) -> DataSettings:
    """The data settings of a run continued from `parent`: the split manifest its run logged as
    `split_from` (kept in the run directory, so a retry reads the same), unless `split_from` is given."""
    if parent is None or data.split_from is not None:
        return data
    target = Path(run_dir) / f"parent_{MANIFEST_NAME}"
    if not target.is_file() and (parent.run_id is None or not _download_manifest(parent.run_id, target)):
        data_logger().warning(
            f"init_from={parent.source!r} comes without a split manifest (no MLflow run of ours logged "
            "one): this run's split is decided afresh, and its validation text may be text the parent "
            "trained on. Give split_from=PATH to the parent's split_manifest.json to keep its split."
        )
        return data
    return data.model_copy(update={"split_from": str(target)})


def _download_manifest(run_id: str, target: Path) -> bool:
    import tempfile

    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as scratch:
        try:
            found = download_artifacts(run_id=run_id, artifact_path=MANIFEST_NAME, dst_path=scratch)
        except (MlflowException, OSError):
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found, target)
    return True


def keep_tokenizer(run_dir: str, tokenizer: TokenizerRef) -> None:
    """A copy of the tokenizer in the run directory: `init_from=<run dir>/step_N` then finds it."""
    target = Path(run_dir) / "tokenizer.json"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer.path, target)
