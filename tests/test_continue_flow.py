"""Continued pretraining through the whole flow: from a Hugging Face checkout in the HF cache, then from the
registry's champion (its alias moved right after the flow resolved it), with the lineage in MLflow; a
tokenizer that does not fit the embedding refused before any work; and the data stage's files tokenized as
mapped Prefect tasks, only the new ones when the corpus grew.

Real Prefect API, real SQLite MLflow store, real training (tiny model, a few eager fp32 steps).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants as hf_constants
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.context import get_run_context
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.testing.utilities import prefect_test_harness
from tokenizers import Tokenizer

import flows.pretrain as pretrain_module
from flows.pretrain import pretrain
from flows.pretrain_config import PretrainConfig
from flows.result import lineage_lines
from hf_checkpoint import COMMIT, put_in_hf_cache, save_hf_llama
from registry_world import sqlite_store
from stdlib_corpus import copy_modules, stdlib_text
from tasks import home
from tasks.build import parent_config
from tasks.data import tokens
from tasks.data.errors import DataError
from tasks.data.split import MANIFEST_NAME
from tasks.dataset import plan_tokenization
from tasks.export import export_registered
from tasks.init_from import InitFromError, resolve_init_from
from tasks.init_from.optimizer import check_parent_optimizer
from tasks.init_from.parent_cache import weights_sha256
from tasks.lookup import download_model_files
from tasks.prepare_data import build_data
from tasks.refs import CheckpointRef, DatasetRef
from tasks.registry import lineage
from tasks.registry.publish import log_version
from tasks.tokenize import import_tokenizer, train_tokenizer
from tasks.tracking import store

pytestmark = pytest.mark.e2e
NAME = "lineage-e2e"
STEPS = {"max_steps": 4, "warmup_steps": 1, "checkpoint_every": 0, "micro_batch_size": 4}
FAST = {
    "preset": "tiny",
    "seq_len": 64,
    "accumulate_steps": 1,
    "compile": False,
    "dtype": "fp32",
    "eval_max_blocks": 4,
    "num_samples": 0,
    "experiment": "lineage-e2e",
    "model_name": NAME,
    **STEPS,
}


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=180):
        yield


def _corpus(root: Path, names: list[str]) -> str:
    copy_modules(root, names)
    return str(root)


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_any_work(
    prefect_api, tmp_path: Path
) -> None:
    hf_dir = save_hf_llama(tmp_path / "hf")
    bigger = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    bigger.add_tokens(["<extra>"])
    bigger.save(str(tmp_path / "bigger.json"))
    data = _corpus(tmp_path / "corpus", ["textwrap.py", "shlex.py", "bisect.py"])
    tokens = home.cache_dir() / "tokens"
    before = set(tokens.rglob("*")) if tokens.exists() else set()
    with sqlite_store(tmp_path) as uri:
        config = PretrainConfig(
            **FAST, init_from=str(hf_dir), tokenizer=str(tmp_path / "bigger.json"), data=data
        )
        with pytest.raises(
            InitFromError, match=r"has 321 tokens but the model .* has 320 embedding rows.*resize"
        ):
            pretrain(config)
        assert store.get_client(uri).get_experiment_by_name("lineage-e2e") is None  # no run was opened
    assert (set(tokens.rglob("*")) if tokens.exists() else set()) == before  # nothing was tokenized


def test_continue_from_the_hf_cache_then_from_the_champion_records_the_lineage(
    prefect_api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    put_in_hf_cache(tmp_path / "hub", "acme/tiny-llama", save_hf_llama(tmp_path / "hf"))
    corpus = _corpus(
        tmp_path / "corpus", ["textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "colorsys.py"]
    )
    new_docs = _corpus(tmp_path / "new_docs", ["heapq.py", "keyword.py", "glob.py", "sched.py"])
    with sqlite_store(tmp_path) as uri:
        client = store.get_client(uri)
        first = pretrain(PretrainConfig(**FAST, init_from="acme/tiny-llama", data=corpus))
        v1 = client.get_model_version(NAME, first.registered.version)
        assert first.registered.promoted and first.parent.pinned == f"hf:acme/tiny-llama@{COMMIT}"
        assert v1.tags[lineage.TAG_PARENT] == f"hf:acme/tiny-llama@{COMMIT}"
        assert (
            v1.tags[lineage.TAG_ROOT] == f"hf:acme/tiny-llama@{COMMIT}" and v1.tags[lineage.TAG_DEPTH] == "2"
        )
        assert v1.tags[lineage.TAG_TOKENS_SEEN_TOTAL] == str(first.checkpoint.tokens_seen)
        assert lineage.base_model(v1.tags) == "acme/tiny-llama"

        # Another version to move the alias to: the imported weights, untrained.
        other = log_version(
            client,
            run_id=first.run_id,
            checkpoint=CheckpointRef(path=first.model.path, run_dir=str(tmp_path), step=0, tokens_seen=0),
            tokenizer=first.tokenizer,
            model_name=NAME,
            tags={},
            via_server=False,
        )
        resolve = pretrain_module.resolve_for_run_task

        def resolve_then_move_the_alias(source: str | None, run_dir: str):  # noqa: ANN202
            parent = resolve(source, run_dir)
            client.set_registered_model_alias(NAME, "champion", other.version)
            return parent

        monkeypatch.setattr(pretrain_module, "resolve_for_run_task", resolve_then_move_the_alias)
        second = pretrain(
            PretrainConfig(**FAST, init_from=f"models:/{NAME}@champion", init_optimizer=True, data=new_docs)
        )

        # It loaded the version it resolved, not the one the alias points at now.
        assert second.parent.pinned == f"models:/{NAME}/{v1.version}"
        # init_optimizer: it started with the optimizer state of the checkpoint v1 was registered from, found
        # through v1's run, and says so in its run; a version no checkpoint of its run holds is refused.
        assert second.model.optimizer_state == first.checkpoint.path
        run_tags = client.get_run(second.run_id).data.tags
        assert run_tags[lineage.TAG_PARENT_OPTIMIZER] == home.portable(first.checkpoint.path)
        untrained = resolve_init_from(f"models:/{NAME}/{other.version}")
        with pytest.raises(InitFromError, match="kept no checkpoint with its weights.*init_optimizer: false"):
            check_parent_optimizer(untrained, parent_config(untrained), "adamw", tmp_path / "untrained")
        v1_files = download_model_files(f"models:/{NAME}/{v1.version}", tmp_path / "v1", uri)
        assert weights_sha256(Path(second.model.path) / "model.safetensors") == weights_sha256(
            v1_files.weights
        )
        assert second.registered.champion_version == str(other.version)

        v3 = client.get_model_version(NAME, second.registered.version)
        v1_model_id = lineage.logged_model_id(client, v1)
        assert v1_model_id is not None
        assert {k: v3.tags.get(k) for k in (lineage.TAG_PARENT, lineage.TAG_PARENT_VERSION)} == {
            lineage.TAG_PARENT: f"models:/{NAME}/{v1.version}",
            lineage.TAG_PARENT_VERSION: str(v1.version),
        }
        assert (
            v3.tags[lineage.TAG_PARENT_NAME] == NAME and v3.tags[lineage.TAG_PARENT_MODEL_ID] == v1_model_id
        )
        assert v3.tags[lineage.TAG_LINEAGE] == f"|{NAME}/{v1.version}|" and v3.tags[lineage.TAG_DEPTH] == "3"
        assert v3.tags[lineage.TAG_ROOT] == f"hf:acme/tiny-llama@{COMMIT}"
        assert v3.tags[lineage.TAG_TOKENIZER_SHA256] == v1.tags[lineage.TAG_TOKENIZER_SHA256]
        total = first.checkpoint.tokens_seen + second.checkpoint.tokens_seen
        assert v3.tags[lineage.TAG_TOKENS_SEEN_TOTAL] == str(total)
        inputs = client.get_run(second.run_id).inputs.model_inputs
        assert [m.model_id for m in inputs] == [v1_model_id]  # the parent as the run's model input
        assert [(v.name, str(v.version)) for v in lineage.descendants(NAME, v1.version, uri)] == [
            (NAME, str(v3.version))
        ]
        summary = "\n".join(lineage_lines(second))
        assert f"started from: models:/{NAME}/{v1.version}" in summary and "its parent:" in summary
        assert float(v3.tags[lineage.TAG_PARENT_BITS_PER_BYTE]) == second.evaluation.initial_bits_per_byte

        # The Hugging Face export names the base model in its card.
        card = export_registered(f"models:/{NAME}/{v3.version}", tmp_path / "hf-export", uri) / "README.md"
        assert 'base_model: "acme/tiny-llama"' in card.read_text()
        assert f"Continued from `models:/{NAME}/{v1.version}`" in card.read_text()


MAPPED = ["textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "colorsys.py", "heapq.py", "glob.py"]


@flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
def data_stage(config: PretrainConfig, tokenizer_path: str) -> tuple[str, str]:
    dataset = build_data(
        config.data_settings(), import_tokenizer(tokenizer_path), config.seq_len, seed=config.seed
    )
    return str(get_run_context().flow_run.id), dataset.fingerprint


def _shard_runs(flow_run_id: str, expected: int) -> list[str]:
    """The states of the tokenize_shard task runs of a flow run, once the API recorded `expected` of them
    as final (task runs are recorded from events, a moment after the flow returned; 30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
        states = [r.state.type.value for r in runs if r.name.startswith("tokenize_shard") and r.state]
        if (len(states) >= expected and all(s != "RUNNING" for s in states)) or time.monotonic() > deadline:
            return sorted(states)
        time.sleep(0.5)


def test_files_to_tokenize_run_as_mapped_tasks_of_the_flow(
    prefect_api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokens, "SHARD_BYTES", 8_000)  # small shards: several tasks for a small corpus
    corpus = _corpus(tmp_path / "mapped", MAPPED[:-1])
    tokenizer = train_tokenizer(str(corpus), 290)
    config = PretrainConfig(preset="tiny", data=str(corpus), seq_len=32, val_fraction=0.2)
    planned = plan_tokenization(str(corpus), tokenizer, 32, val_fraction=0.2)
    assert len(planned) >= 3

    first_run, first = data_stage(config, tokenizer.path)
    assert _shard_runs(first_run, len(planned)) == ["COMPLETED"] * len(planned)
    assert plan_tokenization(str(corpus), tokenizer, 32, val_fraction=0.2) == []

    _corpus(Path(corpus), MAPPED[-1:])
    second_run, second = data_stage(config, tokenizer.path)
    assert _shard_runs(second_run, 1) == ["COMPLETED"]  # one mapped task, for the one new file
    assert second != first


BOOK = ["argparse.py", "difflib.py", "inspect.py", "pathlib.py", "calendar.py"]  # 6 segments, 3 held out


def _documents(dataset: DatasetRef, split: str) -> list[str]:
    """The documents of a built split, decoded from its blocks (split at EOS; the last one may be cut)."""
    decoder = Tokenizer.from_file(str(Path(dataset.path) / "tokenizer.json"))
    stream = np.load(Path(dataset.path) / f"{split}.npy").reshape(-1).tolist()
    eos = import_tokenizer(str(Path(dataset.path) / "tokenizer.json")).eos_id
    documents, start = [], 0
    for i, token in enumerate([*stream, eos]):
        if token == eos:
            documents.append(decoder.decode(stream[start:i], skip_special_tokens=False))
            start = i + 1
    return [d for d in documents if d]


def test_a_continued_run_on_a_grown_corpus_never_scores_the_champion_on_its_training_text(
    prefect_api, tmp_path: Path
) -> None:
    """Night 1 trains on one long prose file; the corpus grows by a file in a new subdirectory; night 2
    continues from night 1's champion and scores both on its validation text: none of it night 1 trained on."""
    root = tmp_path / "nightly"
    (root / "books").mkdir(parents=True)
    (root / "books" / "guide.txt").write_text("\n".join(stdlib_text(BOOK)))
    pattern = str(root / "**" / "*.txt")
    night = {**FAST, "data": pattern, "val_fraction": 0.3, "model_name": "nightly"}
    with sqlite_store(tmp_path):
        first = pretrain(PretrainConfig(**night, vocab_size=512))
        assert first.registered.promoted
        (root / "new").mkdir()
        (root / "new" / "notes.txt").write_text("\n".join(stdlib_text(["sched.py", "queue.py"])))
        second = pretrain(PretrainConfig(**night, init_from="models:/nightly@champion"))
        logged = {a.path for a in store.get_client().list_artifacts(first.run_id)}
        with pytest.raises(DataError, match=r"val_fraction=0.5 \(the parent's: 0.3\)"):
            pretrain(PretrainConfig(**{**night, "val_fraction": 0.5}, init_from="models:/nightly@champion"))
    assert MANIFEST_NAME in logged  # what night 2 carried forward
    assert second.parent.version == first.registered.version
    assert second.registered.champion_version == first.registered.version  # scored on night 2's text
    trained = "".join(_documents(first.dataset, "train"))
    night1_val = _documents(first.dataset, "val")
    night2_val = _documents(second.dataset, "val")
    seen = [doc[:2000] for doc in night2_val if doc[:2000] in trained]
    assert not seen, f"{len(seen)} of night 2's {len(night2_val)} validation documents were trained on"
    assert any(doc in night1_val for doc in night2_val)  # the first file's held-out text is still held out
