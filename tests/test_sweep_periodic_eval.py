"""The engine's periodic validation score (what a sweep prunes on): evaluation's own number for the first
`eval_bytes` bytes of the validation text, at exactly every `eval_every` steps, training unchanged by it,
and the same bytes for runs with another tokenizer and seq_len (issue 42 item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from model import load_pretrained
from registry_world import corpus, one_thread, stdlib_text, tiny_config
from synthetic import model_ref as build_model_ref
from tasks.dataset import build_dataset
from tasks.evaluate import rescore
from tasks.refs import DatasetRef, ModelRef, TokenizerRef
from tasks.tokenize import train_tokenizer
from tasks.training import TrainingInputError, TrainSettings, fit, read_metrics
from tasks.training.checkpoint import checkpoint_dirs
from tasks.training.loss import score_text
from tasks.training.periodic_eval import BITS_PER_BYTE, LOSS, SECONDS, dataset_tokenizer, subset_text

VOCAB = 320
EVAL_BYTES = 2000  # into the second validation document: the EOS between them is in the scored text
VAL_TEXTS = stdlib_text(("colorsys.py", "bisect.py"), 1500)


def _world(root: Path, vocab: int, seq_len: int) -> tuple[TokenizerRef, DatasetRef]:
    """A tokenizer of `vocab` tokens and a dataset of `seq_len` blocks, from the same train and val text."""
    texts = stdlib_text(("textwrap.py", "shlex.py", "fnmatch.py"), 6000)
    with one_thread():
        train, val = corpus(root, "train", texts), corpus(root, "val", VAL_TEXTS)
        tokenizer = train_tokenizer(train, vocab, val_data=val)
        return tokenizer, build_dataset(train, tokenizer, seq_len, val_data=val)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenizerRef, DatasetRef, ModelRef]:
    tokenizer, dataset = _world(tmp_path_factory.mktemp("periodic-eval"), VOCAB, 32)
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
            _settings(eval_every=3, eval_bytes=EVAL_BYTES, checkpoint_every=3),
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

    # Each number is what evaluation's scorer gives the checkpoint of that step on the first bytes' text.
    text = subset_text(dataset, EVAL_BYTES)
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


def test_runs_with_another_tokenizer_and_seq_len_are_scored_on_the_same_bytes(
    world: tuple, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _, dataset, _ = world
    other_tokenizer, other = _world(tmp_path_factory.mktemp("other-world"), 384, 48)
    mine, theirs = subset_text(dataset, EVAL_BYTES), subset_text(other, EVAL_BYTES)

    # The first EVAL_BYTES bytes of the validation documents (ASCII sources: no character to cut back to),
    # with the EOS that ends the first; in each run's own tokens, of which the two runs have different counts.
    first, second = (text.encode() for text in VAL_TEXTS)
    assert mine.text == theirs.text == (first + second)[:EVAL_BYTES]
    assert (
        mine.pieces
        == theirs.pieces
        == (("text", first), ("eos", b""), ("text", second[: EVAL_BYTES - len(first)]))
    )
    assert mine.fingerprint == theirs.fingerprint and len(mine.tokens) != len(theirs.tokens)

    # Comparable bits per byte: the other run's periodic score is what evaluation's cross-tokenizer scorer
    # (how a champion with another tokenizer is compared) gives its model on the text of this run's subset.
    with one_thread():
        run = fit(
            build_model_ref(tiny_config(384), seed=0),
            other,
            _settings(max_steps=2, eval_every=2, eval_bytes=EVAL_BYTES),
            tmp_path_factory.mktemp("other-run"),
            progress=False,
        )
        ids = {"bos_id": other_tokenizer.bos_id, "eos_id": other_tokenizer.eos_id}
        model = load_pretrained(run.path)
        on_mine = rescore(
            model,
            Tokenizer.from_file(other_tokenizer.path),
            ids,
            mine,
            seq_len=48,
            device="cpu",
            dtype="fp32",
        )
    assert read_metrics(run.run_dir)[2][BITS_PER_BYTE] == pytest.approx(on_mine, rel=1e-6)


def test_a_subset_longer_than_the_validation_text_or_counted_in_blocks_is_refused(world: tuple) -> None:
    _, dataset, _ = world
    with pytest.raises(
        TrainingInputError, match=r"eval_bytes=100000, but the validation text .* holds \d+ bytes"
    ):
        subset_text(dataset, 100_000)
    with pytest.raises(ValueError, match="eval_blocks is gone.*set eval_bytes instead"):
        TrainSettings(eval_every=4, eval_blocks=64)  # type: ignore[call-arg]
