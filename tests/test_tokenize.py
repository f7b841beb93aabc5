"""Byte-level BPE training, import of existing tokenizers, the on-disk cache (tasks/tokenize.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import tasks.home
from stdlib_corpus import STDLIB, copy_modules
from tasks.data.corpus import DataError, resolve_corpus
from tasks.tokenize import check_vocab_fits, import_tokenizer, train_tokenizer

VOCAB = 400


@pytest.fixture()
def corpus_dir(tmp_path: Path) -> Path:
    """Real Python source; train files repeat ' blorpwidget', validation files ' zqxvmoop'."""
    root = tmp_path / "corpus"
    copy_modules(root)
    corpus = resolve_corpus(str(root), val_fraction=0.2)
    for part in corpus.train.parts:
        Path(part.file.path).write_text(Path(part.file.path).read_text() + " blorpwidget" * 300)
    for part in corpus.val.parts:
        Path(part.file.path).write_text(Path(part.file.path).read_text() + " zqxvmoop" * 3000)
    return root


def test_trains_bytelevel_bpe_on_the_train_split_only(home: Path, corpus_dir: Path) -> None:
    ref = train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2)
    path = Path(ref.path)
    assert path == tasks.home.cache_dir() / "tokenizers" / ref.fingerprint / "tokenizer.json"
    assert (ref.bos_id, ref.eos_id, ref.pad_id) == (0, 1, 2)
    assert ref.vocab_size == VOCAB
    tokenizer = Tokenizer.from_file(str(path))
    assert [tokenizer.id_to_token(i) for i in range(3)] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    text = "def f(x):\n    return x ** 2  # é ✓\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text  # byte level: any text round-trips
    assert len(tokenizer.encode(" blorpwidget").ids) <= 2
    assert len(tokenizer.encode(" zqxvmoop").ids) >= 4  # frequent, but only in validation files


def test_second_call_is_served_from_disk_and_content_changes_retrain(home: Path, corpus_dir: Path) -> None:
    first = train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2)
    stamp = Path(first.path).stat().st_mtime_ns
    assert train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2) == first
    assert Path(first.path).stat().st_mtime_ns == stamp
    assert len(list((home / "cache" / "tokenizers").iterdir())) == 1

    val_part = resolve_corpus(str(corpus_dir), val_fraction=0.2).val.parts[0]
    Path(val_part.file.path).write_text("validation text changed\n" * 50)
    assert train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2) == first  # validation is not trained on

    train_part = resolve_corpus(str(corpus_dir), val_fraction=0.2).train.parts[0]
    Path(train_part.file.path).write_text("training text changed\n" * 50)
    changed = train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2)
    assert changed.fingerprint != first.fingerprint
    assert Path(changed.path).is_file() and Path(first.path).is_file()
    assert train_tokenizer(str(corpus_dir), VOCAB + 64, val_fraction=0.2).fingerprint != changed.fingerprint


def _gpt2_style_tokenizer(path: Path, specials: list[str]) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([(STDLIB / "textwrap.py").read_text()], trainer=trainer)
    tokenizer.save(str(path))
    return path


def test_existing_tokenizer_is_validated_and_gets_a_pad_token(home: Path, tmp_path: Path) -> None:
    path = _gpt2_style_tokenizer(tmp_path / "gpt2ish.json", ["<|endoftext|>"])
    ref = train_tokenizer(tokenizer_path=path)
    assert ref == import_tokenizer(path)
    original = Tokenizer.from_file(str(path))
    eos = original.token_to_id("<|endoftext|>")
    assert (ref.eos_id, ref.bos_id) == (eos, eos)  # no BOS: falls back to EOS
    assert ref.pad_id == original.get_vocab_size()  # PAD added after the existing vocabulary
    assert ref.vocab_size == original.get_vocab_size() + 1
    copy = Tokenizer.from_file(ref.path)
    assert copy.id_to_token(ref.pad_id) == "<|pad|>"
    assert Path(ref.path).parent.parent == home / "cache" / "tokenizers"

    full = import_tokenizer(_gpt2_style_tokenizer(tmp_path / "full.json", ["<s>", "</s>", "<pad>"]))
    assert (full.bos_id, full.eos_id, full.pad_id, full.vocab_size) == (0, 1, 2, 300)


def test_bad_tokenizer_files_are_clear_errors(home: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist"):
        import_tokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(DataError, match=r"not a valid Hugging Face tokenizer\.json"):
        import_tokenizer(tmp_path / "broken.json")
    with pytest.raises(DataError, match=r"no end-of-text token"):
        import_tokenizer(_gpt2_style_tokenizer(tmp_path / "noeos.json", []))


def test_vocab_size_out_of_range_fails_before_reading_the_corpus(home: Path) -> None:
    with pytest.raises(DataError, match=r"vocab_size=100 is out of range.*at least 259"):
        train_tokenizer(str(home / "does-not-exist"), 100)


def test_check_vocab_fits(home: Path, corpus_dir: Path) -> None:
    ref = train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2)
    check_vocab_fits(ref, VOCAB)
    check_vocab_fits(ref, 512)
    with pytest.raises(DataError, match=r"400 tokens but the model's vocab_size is 256.*at least 400.*448"):
        check_vocab_fits(ref, 256)


def test_a_bounded_sample_of_the_train_split_is_deterministic_and_spread_over_it(
    home: Path, corpus_dir: Path
) -> None:
    train = resolve_corpus(str(corpus_dir), val_fraction=0.2).train
    size = sum(part.file.size for part in train.parts)
    whole = train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2)
    assert train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2, sample_bytes=size) == whole  # all of it
    assert train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2, sample_bytes=None) == whole

    texts, tag = train.sample(size // 3)
    sampled = list(texts)
    assert tag == f"sample={size // 3}" and sampled == list(train.sample(size // 3)[0])  # deterministic
    full = list(train.texts())
    assert set(sampled) < set(full) and len(sampled) >= 2
    assert sum(len(t.encode()) for t in sampled[:-1]) < size // 3  # stops once the budget is spent
    assert sampled != full[: len(sampled)]  # chosen over the whole split, not its first files
    small = train_tokenizer(str(corpus_dir), VOCAB, val_fraction=0.2, sample_bytes=size // 3)
    assert small.fingerprint != whole.fingerprint
    assert Path(small.path).read_bytes() != Path(whole.path).read_bytes()  # trained on the sample
    stats = json.loads((Path(small.path).parent / "meta.json").read_text())["stats"]
    assert stats["sample"] == f"sample={size // 3}"
