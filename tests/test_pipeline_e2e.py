"""The whole flow on the `tiny` preset: real Prefect API, real MLflow SQLite store, real torch.compile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.testing.utilities import prefect_test_harness
from safetensors.torch import load_file

from flows.config import PretrainConfig
from flows.pretrain import PretrainResult, pretrain
from model import LlamaConfig, LlamaForPretraining, load_pretrained, load_weights
from tasks import home
from tasks.evaluate import mean_token_loss

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="module")
def tiny_run(prefect_api, tmp_path_factory) -> PretrainResult:
    ckpt = tmp_path_factory.mktemp("tiny-run")
    return pretrain(PretrainConfig(preset="tiny", checkpoint_dir=str(ckpt), model_name="e2e-tiny"))


def test_flow_registers_a_champion_and_learns(tiny_run: PretrainResult) -> None:
    client = MlflowClient(home.tracking_uri())
    version = client.get_model_version_by_alias("e2e-tiny", "champion")
    assert str(version.version) == tiny_run.registered.version
    assert tiny_run.model_uri.startswith("models:/e2e-tiny")
    assert tiny_run.registered.promoted
    ev = tiny_run.evaluation
    assert ev.initial_val_loss is not None and ev.val_loss < ev.initial_val_loss - 1.0  # 7.6 → ~6.1 measured
    run = client.get_run(tiny_run.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["seq_len"] == "128"
    history = client.get_metric_history(tiny_run.run_id, "train/loss")
    assert len(history) == tiny_run.checkpoint.step == 30


def test_registered_weights_are_the_plain_module_and_reproduce_the_trained_logits(
    tiny_run: PretrainResult, tmp_path: Path
) -> None:
    import mlflow

    mlflow.set_tracking_uri(home.tracking_uri())
    local = Path(
        mlflow.artifacts.download_artifacts(artifact_uri=f"{tiny_run.model_uri}", dst_path=str(tmp_path))
    )
    weights = list(local.rglob("*.safetensors"))
    assert len(weights) == 1
    state = load_file(weights[0])
    assert state and not any(k.startswith("_orig_mod.") for k in state)

    config_file = next(local.rglob("config.json"))
    fresh = LlamaForPretraining(LlamaConfig.from_dict(json.loads(config_file.read_text())))
    load_weights(fresh, weights[0])
    trained = load_pretrained(tiny_run.checkpoint.path)
    batch = torch.randint(
        0, tiny_run.tokenizer.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(batch), trained.eval()(batch), atol=0, rtol=0)
    val_loss = mean_token_loss(
        fresh, Path(tiny_run.dataset.path) / "val.npy", pad_id=tiny_run.tokenizer.pad_id, max_blocks=64
    )
    assert val_loss == pytest.approx(tiny_run.evaluation.val_loss, abs=1e-6)


def test_flow_rejects_an_empty_corpus_before_training(prefect_api, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Exception, match="(?i)empty"):
        pretrain(PretrainConfig(preset="tiny", data=str(empty), checkpoint_dir=str(ckpt)))
    assert not ckpt.exists()
