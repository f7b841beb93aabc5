"""`init_optimizer` (issue 42 item 7): a new run from a parent's checkpoint that starts with the parent's
optimizer state, and the refusals before any step where that state cannot fit.

In-process and eager: the tiny model on 8 synthetic blocks, full-batch steps (every step holds all 8
blocks, so each step sees the same data whatever the run), a constant learning rate.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flows.pretrain_config import PretrainConfig
from hf_checkpoint import save_hf_llama
from model import get_preset
from registry_world import one_thread
from synthetic import eager_settings, pattern_blocks, write_packed_dataset
from tasks.build import build_model
from tasks.init_from import InitFromError, resolve_init_from
from tasks.init_from.optimizer import check_parent_optimizer
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainingInputError, fit, read_metrics
from tasks.training.checkpoint import checkpoint_dirs

VOCAB = 96
SEQ = 16
BLOCKS = 8

# A constant LR (no warmup, no decay) and one global batch = the whole train split: the parent's step 3 and
# a child's step 1 from the parent's step 2 compute the same update, if and only if the child starts with the
# parent's moments and step counts.
settings = partial(
    eager_settings, micro_batch_size=4, accumulate_steps=2, lr=1e-2, warmup_steps=0, min_lr_ratio=1.0
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_packed_dataset(
        tmp_path_factory.mktemp("packed"),
        pattern_blocks(BLOCKS, SEQ, VOCAB, 0),
        pattern_blocks(2, SEQ, VOCAB, 1),
        vocab_size=VOCAB,
    )


def _config(vocab: int = VOCAB):
    return get_preset("tiny", vocab_size=vocab, max_position_embeddings=SEQ)


def _parent_run(root: Path, dataset: DatasetRef, optimizer: str) -> tuple[Path, str]:
    """(run directory, optimizer) of a parent run of 3 steps with a checkpoint after each."""
    run_dir = root / "run"
    model = build_model(_config(), seed=0)
    run = settings(optimizer=optimizer, max_steps=3, checkpoint_every=1, keep_checkpoints=3)
    fit(model, dataset, run, run_dir, progress=False)
    return run_dir, optimizer


@pytest.fixture(scope="module")
def adamw_parent(tmp_path_factory: pytest.TempPathFactory, dataset: DatasetRef) -> tuple[Path, str]:
    return _parent_run(tmp_path_factory.mktemp("adamw"), dataset, "adamw")


@pytest.fixture(scope="module")
def muon_parent(tmp_path_factory: pytest.TempPathFactory, dataset: DatasetRef) -> tuple[Path, str]:
    return _parent_run(tmp_path_factory.mktemp("muon"), dataset, "muon")


def _child(parent_checkpoint: Path, *, carry: bool, vocab: int = VOCAB) -> ModelRef:
    parent = resolve_init_from(str(parent_checkpoint))
    model = build_model(_config(vocab), seed=0, parent=parent)
    return model.model_copy(update={"optimizer_state": str(parent_checkpoint) if carry else None})


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_child_with_the_parents_optimizer_state_takes_the_parents_next_step(
    optimizer: str, request: pytest.FixtureRequest, dataset: DatasetRef, tmp_path: Path
) -> None:
    run_dir, _ = request.getfixturevalue(f"{optimizer}_parent")
    checkpoints = dict(checkpoint_dirs(run_dir))
    found = check_parent_optimizer(
        resolve_init_from(str(checkpoints[2])), _config(), optimizer, tmp_path / "child"
    )
    assert found == str(checkpoints[2])  # a local parent's own checkpoint directory
    # A run directory holding checkpoints resumes with its own optimizer state: nothing to carry over.
    assert (
        check_parent_optimizer(resolve_init_from(str(checkpoints[2])), _config(), optimizer, run_dir) is None
    )

    one_step = settings(optimizer=optimizer, max_steps=1)
    carried = fit(_child(checkpoints[2], carry=True), dataset, one_step, tmp_path / "carried", progress=False)
    fresh = fit(_child(checkpoints[2], carry=False), dataset, one_step, tmp_path / "fresh", progress=False)

    parents_step_3 = _weights(checkpoints[3])
    update = _max_difference(parents_step_3, _weights(checkpoints[2]))  # the parent's step 3, at most
    # torch's Muon orthogonalises in bf16: a summation order of the batch may flip a rounding there.
    tolerance = 1e-6 if optimizer == "adamw" else update / 20
    assert _max_difference(_weights(Path(carried.path)), parents_step_3) < tolerance
    # Without it, the same step from the same weights on the same data is another update (a new optimizer).
    assert _max_difference(_weights(Path(fresh.path)), parents_step_3) > update / 4
    # The child's first loss is the parent's third (the same weights on the same data).
    parent_loss = read_metrics(run_dir)[3]["train/loss"]
    assert read_metrics(carried.run_dir)[1]["train/loss"] == pytest.approx(parent_loss, rel=1e-6)


def test_an_optimizer_state_that_does_not_fit_is_refused_before_any_step(
    adamw_parent: tuple[Path, str], dataset: DatasetRef, tmp_path: Path
) -> None:
    run_dir, optimizer = adamw_parent
    checkpoint = dict(checkpoint_dirs(run_dir))[3]
    other = "adamw" if optimizer == "muon" else "muon"
    parent = resolve_init_from(str(checkpoint))
    # When the flow starts: another optimizer, another shape (a grown embedding), both naming the fix.
    with pytest.raises(
        InitFromError, match=rf"optimizer: parent '{optimizer}', now '{other}'.*init_optimizer: false"
    ):
        check_parent_optimizer(parent, _config(), other, tmp_path / "a")
    with pytest.raises(
        InitFromError,
        match=r"parameter model.embed_tokens.weight: parent \[96, .*now \[128, .*init_optimizer: false",
    ):
        check_parent_optimizer(parent, _config(128), optimizer, tmp_path / "b")

    # In the engine, tensor by tensor, before the first step: nothing is trained or written. Also a
    # checkpoint that is not there on the machine that trains.
    gone = _child(checkpoint, carry=True).model_copy(update={"optimizer_state": str(tmp_path / "elsewhere")})
    fits = r"does not fit this run: .*init_optimizer: false"
    for name, model, run, problem in (
        ("optimizer", _child(checkpoint, carry=True), settings(optimizer=other, max_steps=1), fits),
        (
            "shape",
            _child(checkpoint, carry=True, vocab=128),
            settings(optimizer=optimizer, max_steps=1),
            fits,
        ),
        ("gone", gone, settings(optimizer=optimizer, max_steps=1), r"holds no optimizer state here.*: false"),
    ):
        with pytest.raises(TrainingInputError, match=problem):
            fit(model, dataset, run, tmp_path / name, progress=False)
        assert not checkpoint_dirs(tmp_path / name) and not read_metrics(tmp_path / name)


def test_a_parent_without_optimizer_state_is_refused_naming_the_fix(
    adamw_parent: tuple[Path, str], tmp_path: Path
) -> None:
    run_dir, optimizer = adamw_parent
    hf = resolve_init_from(str(save_hf_llama(tmp_path / "hf")))
    with pytest.raises(
        InitFromError,
        match="Hugging Face checkpoint, which carries no optimizer state.*init_optimizer: false",
    ):
        check_parent_optimizer(hf, _config(), optimizer, tmp_path / "a")

    weights_only = tmp_path / "weights"  # a checkpoint's weights and config, without its optimizer state
    weights_only.mkdir()
    checkpoint = dict(checkpoint_dirs(run_dir))[3]
    for name in ("model.safetensors", "config.json"):
        shutil.copy(checkpoint / name, weights_only / name)
    bare = resolve_init_from(str(weights_only))
    with pytest.raises(InitFromError, match="has no usable optimizer state.*init_optimizer: false"):
        check_parent_optimizer(bare, _config(), optimizer, tmp_path / "b")


def test_init_optimizer_needs_a_parent() -> None:
    with pytest.raises(
        ValueError, match="init_optimizer carries a parent's optimizer state over: it needs init_from"
    ):
        PretrainConfig(preset="tiny", init_optimizer=True)
