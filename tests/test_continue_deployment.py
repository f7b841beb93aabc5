"""The `continue` deployment of prefect.yaml, end to end: a real Prefect server, the repository's deployments on
a process work pool, a real worker. A first champion is registered in the MLflow store; the deployment, run
twice as its schedule would, continues from the champion each time, and the lineage grows by one per night:
version 2's parent is version 1, version 3's is the champion it started from. The corpus grows between the
nights (a new file, as a nightly corpus does), and each night's decision is the one expected: a few steps
from a randomly initialised first champion score better, so each night's version is promoted.

The deployments run from this checkout (as in tests/test_deployment.py); each run keeps the deployment's own
config (preset, init_from) and only makes it short and points it at a small corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prefect.client.orchestration import get_client

from model import LlamaForPretraining, get_preset, save_weights
from prefect_server import POOL, deploy_from_checkout, pool_server, prefect_worker, tail, wait_for_flow_run
from stdlib_corpus import copy_modules
from tasks.refs import CheckpointRef
from tasks.registry import lineage
from tasks.registry.decision import TAG_PROMOTED
from tasks.registry.publish import log_version
from tasks.tokenize import train_tokenizer
from tasks.tracking import store

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
NAME = "llamaflow-demo"  # the deployment's init_from: models:/llamaflow-demo@champion
SHORT = {
    "max_steps": 3,
    "warmup_steps": 1,
    "checkpoint_every": 0,
    "seq_len": 64,
    "micro_batch_size": 4,
    "accumulate_steps": 1,
    "compile": False,
    "dtype": "fp32",
    "eval_max_blocks": 4,
    "num_samples": 0,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """(tracking URI, worker log, corpus): server, pool, prefect.yaml's deployments, one process worker."""
    root = tmp_path_factory.mktemp("continue-stack")
    corpus = root / "corpus"
    copy_modules(corpus, ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "colorsys.py"))
    with pool_server(root) as server:
        deploy_from_checkout(root, server.env, "continue")
        with prefect_worker(POOL, server.env, root, root / "worker.log"):
            yield server.tracking_uri, root / "worker.log", corpus


def _first_champion(uri: str, corpus: Path, root: Path) -> str:
    """Version 1: a tiny llamaflow model with a tokenizer trained on the corpus, holding @champion."""
    tokenizer = train_tokenizer(str(corpus), 384)
    torch.manual_seed(0)
    model = LlamaForPretraining(get_preset("tiny", vocab_size=384, max_position_embeddings=128))
    checkpoint = root / "first"
    checkpoint.mkdir()
    save_weights(model, checkpoint / "model.safetensors")
    (checkpoint / "config.json").write_text(json.dumps(model.config.to_dict()))
    client = store.get_client(uri)
    run_id = store.start_run("continue-bootstrap", uri=uri)
    version = log_version(
        client,
        run_id=run_id,
        checkpoint=CheckpointRef(path=str(checkpoint), run_dir=str(root), step=0, tokens_seen=0),
        tokenizer=tokenizer,
        model_name=NAME,
        tags=lineage.version_tags(None, tokens_seen=0, tokenizer=tokenizer, parent_bits_per_byte=None),
        via_server=False,
    )
    client.set_registered_model_alias(NAME, "champion", version.version)
    return str(version.version)


def test_the_continue_deployment_grows_the_lineage_by_one_each_night(
    stack: tuple[str, Path, Path], tmp_path: Path
) -> None:
    uri, worker_log, corpus = stack
    assert _first_champion(uri, corpus, tmp_path) == "1"
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("pretrain/continue")
    assert [(s.schedule.cron, s.active) for s in deployment.schedules] == [("0 4 * * *", True)]
    config = deployment.parameters["config"]
    assert config["init_from"] == f"models:/{NAME}@champion"

    mlflow = store.get_client(uri)
    digests = []
    for night in (1, 2):
        if night == 2:  # the corpus grew overnight
            copy_modules(corpus, ("heapq.py",))
        champion = str(mlflow.get_model_version_by_alias(NAME, "champion").version)
        with get_client(sync_client=True) as client:
            run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"config": {**config, **SHORT, "data": str(corpus)}}
            )
        run = wait_for_flow_run(run.id, 600, worker_log)
        assert run.state.type.value == "COMPLETED", f"night {night}: {run.state.message}\n{tail(worker_log)}"
        version = mlflow.get_model_version(NAME, str(night + 1))
        assert version.tags[lineage.TAG_PARENT] == f"models:/{NAME}/{champion}"
        assert version.tags[lineage.TAG_PARENT_VERSION] == champion
        parent_depth = int(mlflow.get_model_version(NAME, champion).tags[lineage.TAG_DEPTH])
        assert version.tags[lineage.TAG_DEPTH] == str(parent_depth + 1)
        assert f"|{NAME}/1|" in version.tags[lineage.TAG_LINEAGE]
        if night == 1:
            assert champion == "1"  # version 2's parent is version 1
        # The decision expected: better than the champion it started from, so it holds @champion now.
        assert version.tags[TAG_PROMOTED] == "true", version.tags
        assert str(mlflow.get_model_version_by_alias(NAME, "champion").version) == str(night + 1)
        inputs = mlflow.get_run(version.run_id).inputs.dataset_inputs
        digests.append({i.dataset.name.rsplit("/", 1)[-1]: i.dataset.digest for i in inputs}["train"])
    assert digests[0] != digests[1]  # night 2 trained on the grown corpus
    descendants = [str(v.version) for v in lineage.descendants(NAME, 1, uri)]
    assert descendants == ["2", "3"]
