"""The engine's periodic validation score (what a sweep prunes on): evaluation's own number for the first
`eval_blocks` held-out blocks, at exactly every `eval_every` steps, and training unchanged by it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import load_pretrained
from registry_world import corpus, one_thread, stdlib_text, tiny_config
from synthetic import model_ref as build_model_ref
from tasks.dataset import build_dataset
from tasks.refs import DatasetRef, ModelRef, TokenizerRef
from tasks.scoring import validation_text
from tasks.tokenize import train_tokenizer
from tasks.training import TrainSettings, fit, read_metrics
from tasks.training.checkpoint import checkpoint_dirs
from tasks.training.loss import score_text
from tasks.training.periodic_eval import BITS_PER_BYTE, LOSS, SECONDS, dataset_tokenizer

VOCAB = 320
EVAL_BLOCKS = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenizerRef, DatasetRef, ModelRef]:
    root = tmp_path_factory.mktemp("periodic-eval")
    texts = stdlib_text(("textwrap.py", "shlex.py", "colorsys.py", "bisect.py"), 6000)
    with one_thread():
        train = corpus(root, "train", texts[:3])
        val = corpus(root, "val", texts[3:])
        tokenizer = train_tokenizer(train, VOCAB, val_data=val)
        dataset = build_dataset(train, tokenizer, 32, val_data=val)
    return tokenizer, dataset, build_model_ref(tiny_config(VOCAB), seed=0)


def _settings(**overrides: object) -> TrainSettings:
    values: dict[str, object] = dict(
        micro_batch_size=4,
        max_steps=9,
        lr=3e-3,
        warmup_steps=1,
        compile=False,
        keep_checkpoints=9,
        dtype="fp32",  # as the other engine tests: a bf16 matmul peak measure takes minutes on a busy host
    )
    return TrainSettings(**{**values, **overrides})  # type: ignore[arg-type]


def test_the_tokenizer_of_a_dataset_is_the_one_that_built_it(world: tuple) -> None:
    tokenizer, dataset, _ = world
    found = dataset_tokenizer(dataset)
    assert Path(found.path).read_bytes() == Path(tokenizer.path).read_bytes()
    assert (found.bos_id, found.eos_id, found.pad_id, found.fingerprint) == (
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.pad_id,
        tokenizer.fingerprint,
    )


def test_the_score_every_n_steps_is_evaluations_score_and_leaves_training_unchanged(
    world: tuple, tmp_path: Path
) -> None:
    tokenizer, dataset, model = world
    with one_thread():
        scored = fit(
            model,
            dataset,
            _settings(eval_every=3, eval_blocks=EVAL_BLOCKS, checkpoint_every=3),
            tmp_path / "scored",
            progress=False,
        )
        plain = fit(model, dataset, _settings(checkpoint_every=3), tmp_path / "plain", progress=False)
    with_eval, without = read_metrics(scored.run_dir), read_metrics(plain.run_dir)

    assert [step for step, m in sorted(with_eval.items()) if BITS_PER_BYTE in m] == [3, 6, 9]
    assert not any(BITS_PER_BYTE in m for m in without.values())
    # Training is the same with the score on: every step's loss and the final weights.
    assert [with_eval[s]["train/loss"] for s in range(1, 10)] == [
        without[s]["train/loss"] for s in range(1, 10)
    ]
    after, reference = (load_file(str(Path(r.path) / "model.safetensors")) for r in (scored, plain))
    assert after.keys() == reference.keys()
    assert all(torch.equal(after[name], reference[name]) for name in after)

    # Each number is what evaluation's scorer gives the checkpoint of that step on the first blocks' text.
    text = validation_text(dataset, tokenizer, EVAL_BLOCKS)
    checkpoints = dict(checkpoint_dirs(Path(scored.run_dir)))
    for step in (3, 6, 9):
        loss, bits_per_byte = score_text(
            load_pretrained(checkpoints[step]), text, seq_len=dataset.seq_len, device="cpu", dtype="fp32"
        )
        assert with_eval[step][BITS_PER_BYTE] == pytest.approx(bits_per_byte, rel=1e-6)
        assert with_eval[step][LOSS] == pytest.approx(loss, rel=1e-6)
        assert with_eval[step][SECONDS] > 0
    assert with_eval[3][BITS_PER_BYTE] > with_eval[9][BITS_PER_BYTE]  # it learns, and the score shows it


def test_the_score_is_logged_with_the_steps_metrics_or_refused() -> None:
    with pytest.raises(ValueError, match="eval_every=10 must be a multiple of log_every=4"):
        TrainSettings(eval_every=10, log_every=4)
    assert TrainSettings(eval_every=8, log_every=4).eval_every == 8
