"""document_mask in the engine: the loss of a packed block is the sum of its documents' losses scored alone,
accumulation stays exact, and a dataset without EOS is refused before any work."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from model import get_preset, load_pretrained
from synthetic import eager_settings, pattern_blocks, write_packed_dataset
from synthetic import model_ref as build_model_ref
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainingError, fit, read_metrics
from tasks.training.engine import validate_inputs
from tasks.training.loss import LossHead, token_loss_sum

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
VOCAB, SEQ, EOS, PAD = 96, 16, 2, 0


def blocks_with_documents(n: int, seed: int) -> np.ndarray:
    blocks = pattern_blocks(n, SEQ, VOCAB, seed)
    blocks[blocks == EOS] = 3
    rng = np.random.default_rng(seed)
    for row in blocks:
        row[rng.choice(np.arange(1, SEQ), size=2, replace=False)] = EOS
    return blocks


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    directory = tmp_path_factory.mktemp("packed-docs")
    return write_packed_dataset(
        directory, blocks_with_documents(24, 0), blocks_with_documents(4, 1), vocab_size=VOCAB, eos_id=EOS
    )


@pytest.fixture(scope="module")
def model_ref() -> ModelRef:
    return build_model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ), seed=0)


settings = partial(eager_settings, max_steps=3)


def test_loss_of_a_packed_block_is_the_sum_of_its_documents_scored_alone(model_ref: ModelRef) -> None:
    model = load_pretrained(model_ref.path)
    block = torch.from_numpy(blocks_with_documents(1, 5)[0].astype(np.int64))
    inputs, targets = block[None, :-1], block[None, 1:]
    with torch.no_grad():
        masked = LossHead(model, eos_id=EOS)(inputs, targets)
        plain = LossHead(model)(inputs, targets)
        ends = [int(i) + 1 for i in torch.nonzero(inputs[0] == EOS)] + [SEQ]
        alone, start = torch.zeros(()), 0
        for end in ends:
            if end > start:
                alone += token_loss_sum(model(inputs[:, start:end]), targets[:, start:end])
            start = end
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(masked, plain, rtol=1e-4)


def test_document_masked_training_accumulates_exactly(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    split = fit(model_ref, dataset, settings(document_mask=True), tmp_path / "split", progress=False)
    whole = fit(
        model_ref,
        dataset,
        settings(document_mask=True, micro_batch_size=8, accumulate_steps=1),
        tmp_path / "whole",
        progress=False,
    )
    plain = fit(model_ref, dataset, settings(), tmp_path / "plain", progress=False)
    losses = {
        name: [m["train/loss"] for _, m in sorted(read_metrics(ref.run_dir).items())]
        for name, ref in (("split", split), ("whole", whole), ("plain", plain))
    }
    np.testing.assert_allclose(losses["split"], losses["whole"], rtol=1e-5)
    assert not np.allclose(losses["split"], losses["plain"], rtol=1e-4)


def test_document_mask_without_an_eos_id_is_refused_before_training(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    meta = json.loads((Path(dataset.path) / "meta.json").read_text())
    meta["eos_id"] = None
    no_eos = tmp_path / "no-eos"
    no_eos.mkdir()
    for name in ("train.npy", "val.npy"):
        (no_eos / name).symlink_to(Path(dataset.path) / name)
    (no_eos / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TrainingError, match="document_mask needs the dataset's EOS id"):
        validate_inputs(
            model_ref, dataset.model_copy(update={"path": str(no_eos)}), settings(document_mask=True)
        )
