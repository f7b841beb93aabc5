"""Bits per byte: the summed token loss in bits over the exact UTF-8 bytes of the text evaluation scored, and
xz on those same bytes."""

from __future__ import annotations

import json
import lzma
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from model import LlamaForPretraining, load_pretrained
from registry_world import corpus, one_thread, save_checkpoint, stdlib_text, tiny_config
from tasks import home
from tasks.dataset import build_dataset
from tasks.evaluate import evaluate
from tasks.refs import CheckpointRef, DatasetRef, TokenizerRef
from tasks.tokenize import train_tokenizer

SEQ_LEN = 32
# Multi-byte characters a 300-token vocabulary cannot merge: byte-level tokens then split characters.
UNICODE = "# naïve café — ünïcödé ✓ 日本語のテキスト 🐍 ∑ x² ≤ 3\n"


@pytest.fixture(scope="module")
def bpb_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    with one_thread():
        yield _build(tmp_path_factory.mktemp("bpb-world"))


def _build(root: Path) -> tuple:
    texts = stdlib_text(("textwrap.py", "shlex.py", "colorsys.py"), 3000)
    train = corpus(root, "train", [t + UNICODE for t in texts[:2]])
    val = corpus(root, "val", [UNICODE * 3 + texts[2][:700], UNICODE + "def f():\n    return 1\n"])
    tokenizer = train_tokenizer(train, 300, val_data=val)
    dataset = build_dataset(train, tokenizer, SEQ_LEN, val_data=val, keep_remainder=True)
    torch.manual_seed(3)
    checkpoint = save_checkpoint(root / "ckpt", LlamaForPretraining(tiny_config(300)))
    val_text = b"".join(p.read_bytes() for p in sorted(Path(val).iterdir()))
    return tokenizer, dataset, checkpoint, val_text


def _stream(dataset: DatasetRef, pad_id: int) -> np.ndarray:
    flat = np.load(Path(dataset.path) / "val.npy").reshape(-1).astype(np.int64)
    return flat[: np.flatnonzero(flat != pad_id)[-1] + 1]


def test_the_byte_table_gives_the_utf8_bytes_of_any_text(bpb_world: tuple) -> None:
    from tasks.scoring import token_bytes

    tokenizer_ref, *_ = bpb_world
    tokenizer = Tokenizer.from_file(tokenizer_ref.path)
    table = token_bytes(tokenizer)
    for text in (UNICODE, "plain ascii\twith\r\nwhitespace", "".join(chr(c) for c in range(1, 600))):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert b"".join(table[i] for i in ids) == text.encode("utf-8")
    for special in (tokenizer_ref.bos_id, tokenizer_ref.eos_id, tokenizer_ref.pad_id):
        assert table[special] == b""


def _reference_loss_sum(checkpoint: CheckpointRef, tokens: np.ndarray, context_id: int) -> float:
    """Every token is predicted once, each block of SEQ_LEN targets seeing the token before it."""
    model = load_pretrained(checkpoint.path).eval()
    total = 0.0
    sequence = np.concatenate([[context_id], tokens])
    for start in range(0, len(tokens), SEQ_LEN):
        window = torch.from_numpy(sequence[start : start + SEQ_LEN + 1])
        with torch.no_grad():
            logits = model(window[None, :-1])
        total += F.cross_entropy(logits[0], window[1:], reduction="sum").item()
    return total


# The logits are scored a chunk of rows at a time: whole batches at once, and 7 rows at a time (chunks that
# cross block and batch boundaries unevenly) must give the reference's sum.
@pytest.mark.parametrize("chunk_rows", [None, 7])
def test_bits_per_byte_is_the_summed_loss_over_the_exact_bytes_of_the_scored_text(
    bpb_world: tuple, chunk_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.training.loss

    tokenizer, dataset, checkpoint, val_text = bpb_world
    if chunk_rows is not None:
        monkeypatch.setattr(tasks.training.loss, "LOSS_CHUNK_ELEMENTS", chunk_rows * 300)
    stream = _stream(dataset, tokenizer.pad_id)
    result = evaluate(
        checkpoint, dataset, tokenizer, max_blocks=None, num_samples=0, device="cpu", dtype="fp32"
    )
    # max_blocks=None scored the whole validation split: every token once, the separators (EOS) carrying
    # no bytes.
    assert result.scored_tokens == len(stream)
    assert result.scored_bytes == len(val_text)
    expected = _reference_loss_sum(checkpoint, stream, tokenizer.eos_id)
    assert result.val_loss == pytest.approx(expected / len(stream), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(expected / math.log(2) / len(val_text), rel=1e-5)
    # xz -9e on the same bytes, in bits per byte.
    xz = len(lzma.compress(val_text, preset=9 | lzma.PRESET_EXTREME)) * 8 / len(val_text)
    assert result.xz_bits_per_byte == xz


def test_a_cut_inside_a_character_scores_whole_characters_only(bpb_world: tuple) -> None:
    from tasks.scoring import token_bytes, validation_text

    tokenizer, dataset, checkpoint, val_text = bpb_world
    stream = _stream(dataset, tokenizer.pad_id)
    table = token_bytes(Tokenizer.from_file(tokenizer.path))
    # A budget of whole blocks whose last token ends inside a multi-byte character.
    cuts = [
        blocks
        for blocks in range(1, len(stream) // SEQ_LEN)
        if _inside_a_character(b"".join(table[t] for t in stream[: blocks * SEQ_LEN]))
    ]
    assert cuts, "the validation text should have a block boundary inside a character"
    text = validation_text(dataset, tokenizer, max_blocks=cuts[0])
    assert len(text.tokens) < cuts[0] * SEQ_LEN
    assert val_text.startswith(text.text) and text.text.decode("utf-8")
    assert len(text.text) == sum(len(table[t]) for t in text.tokens)


def _inside_a_character(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_xz_is_cached_per_dataset(bpb_world: tuple) -> None:
    from tasks.scoring import validation_text, xz_bits_per_byte

    tokenizer, dataset, _, _ = bpb_world
    text = validation_text(dataset, tokenizer, max_blocks=3)
    first = xz_bits_per_byte(text)
    cached = list((home.cache_dir() / "xz").glob(f"{dataset.fingerprint}-{len(text.tokens)}.json"))
    assert len(cached) == 1, "xz's number is kept per dataset fingerprint (and scored length)"
    record = json.loads(cached[0].read_text())
    assert record["bits_per_byte"] == first and record["text_fingerprint"] == text.fingerprint
    cached[0].write_text(json.dumps({**record, "bits_per_byte": 0.125}))
    assert xz_bits_per_byte(text) == 0.125, "the second call reads the cache instead of compressing again"
    cached[0].write_text(json.dumps({**record, "text_fingerprint": "another text"}))
    assert xz_bits_per_byte(text) == first, "a record of another text is not used"


def test_a_tokenizer_that_is_not_byte_level_is_refused_before_any_work(tmp_path: Path) -> None:
    from tokenizers import models, pre_tokenizers

    from tasks.scoring import ScoringError, check_byte_level

    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "<|eos|>": 2}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    word_level.save(str(path))
    ref = TokenizerRef(path=str(path), fingerprint="w", vocab_size=3, bos_id=2, eos_id=2, pad_id=0)
    with pytest.raises(ScoringError, match="byte-level"):
        check_byte_level(ref)


def test_the_run_summary_leads_with_bits_per_byte_against_xz() -> None:
    from flows.result import summary_lines

    lines = summary_lines(
        bits_per_byte=1.2,
        xz_bits_per_byte=1.764,
        initial_bits_per_byte=4.5,
        val_loss=3.1,
        initial_val_loss=7.6,
    )
    assert lines[0] == "validation: 1.200 bits per byte (xz -9e: 1.764), 32% below xz; 4.500 before training"
    assert "3.100 nats/token" in lines[1]
