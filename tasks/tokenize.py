"""Byte-level BPE tokenizers: trained on the corpus's train split, cached by content fingerprint.

Special tokens of a trained tokenizer have fixed ids: `<|bos|>` = 0, `<|eos|>` = 1, `<|pad|>` = 2.
An existing `tokenizer.json` can be given instead; its special tokens are looked up by their usual
names, a missing pad token is added (PAD must never occur in real text, the trainer ignores it),
and a missing BOS falls back to EOS.

`train_tokenizer` is a plain function that returns at once when its output is already on disk;
`train_tokenizer_task` is the Prefect task around it, cached on the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.atomic import atomic_dir
from tasks import home
from tasks.data.cache import build_lock, prefect_cache_key
from tasks.data.corpus import (
    CorpusSplit,
    DataError,
    DataSettings,
    blake,
    corpus_of_parameters,
    resolve_corpus,
)
from tasks.data.errors import data_logger
from tasks.data.progress import Progress, counted_bytes
from tasks.data.slot import is_complete, touch
from tasks.refs import TokenizerRef

ALGORITHM_VERSION = "bytelevel-bpe-v1"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
# The tokenizer trains on at most this much of the train split (a deterministic sample spread over it): BPE
# statistics settle long before a large corpus ends, and training time and memory grow with the text.
SAMPLE_BYTES = 1 << 28
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB_SIZE = 2**32 - 1
_BOS_NAMES = (BOS, "<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
_EOS_NAMES = (EOS, "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
_PAD_NAMES = (PAD, "<pad>", "[PAD]", "<|padding|>")
_UNK_NAMES = ("<unk>", "[UNK]", "<|unk|>")


def tokenizers_dir() -> Path:
    return home.cache_dir() / "tokenizers"


def _check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise DataError(
            f"vocab_size={vocab_size} is out of range: a byte-level BPE needs at least {MIN_VOCAB_SIZE} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens); 4096 suits the default corpus."
        )


def tokenizer_fingerprint(
    train_fingerprint: str, vocab_size: int, min_frequency: int, sample: str = ""
) -> str:
    """`sample`: what a bounded sample of the train split adds ("" when the tokenizer saw all of it)."""
    extra = (sample,) if sample else ()
    return blake(ALGORITHM_VERSION, train_fingerprint, str(vocab_size), str(min_frequency), *extra)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_tokenizer_ref(directory: Path) -> TokenizerRef:
    meta = json.loads((directory / "meta.json").read_text())
    touch(directory)  # taken by a run: its last use
    path = directory / "tokenizer.json"
    ref = {"sha256": None, **meta["ref"]}
    if ref["sha256"] is None:  # written before the hash was recorded
        ref["sha256"] = file_sha256(path)
    return TokenizerRef(path=str(path), **ref)


def _write(
    directory: Path, tokenizer: Tokenizer, fingerprint: str, ids: dict[str, int], stats: dict[str, Any]
) -> None:
    with atomic_dir(directory) as staged:
        tokenizer.save(str(staged.path / "tokenizer.json"))
        ref = {
            "fingerprint": fingerprint,
            "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
            "sha256": file_sha256(staged.path / "tokenizer.json"),
            **ids,
        }
        (staged.path / "meta.json").write_text(json.dumps({"ref": ref, "stats": stats}, indent=2))


def train_tokenizer(
    data: str | DataSettings | None = None,
    vocab_size: int = 8192,
    *,
    val_fraction: float | None = None,
    val_data: str | None = None,
    text_field: str | None = None,
    hf_split: str | None = None,
    hf_val_split: str | None = None,
    min_frequency: int = 2,
    sample_bytes: int | None = SAMPLE_BYTES,
    tokenizer_path: str | Path | None = None,
    seed: int | None = None,
) -> TokenizerRef:
    """A byte-level BPE trained on the train split of `data`, or the tokenizer at `tokenizer_path`.

    Returns at once when the tokenizer for these inputs is already in the cache. With
    `tokenizer_path`, `data` and `vocab_size` are ignored: the file's own vocabulary decides (check
    it against the model with `check_vocab_fits`). `seed` is accepted for a uniform stage interface
    and unused: BPE training is deterministic.
    """
    del seed
    if tokenizer_path is not None:
        return import_tokenizer(tokenizer_path)
    _check_vocab_size(vocab_size)
    corpus = resolve_corpus(
        data,
        val_fraction=val_fraction,
        val_data=val_data,
        text_field=text_field,
        hf_split=hf_split,
        hf_val_split=hf_val_split,
    )
    texts, sample = corpus.train.sample(sample_bytes)
    fingerprint = tokenizer_fingerprint(corpus.train.fingerprint, vocab_size, min_frequency, sample)
    directory = tokenizers_dir() / fingerprint
    if is_complete(directory):
        data_logger().info(f"tokenizer {fingerprint}: cached at {directory}")
        return load_tokenizer_ref(directory)

    with build_lock(directory):
        if is_complete(directory):
            data_logger().info(f"tokenizer {fingerprint}: trained by another run while this one waited")
            return load_tokenizer_ref(directory)
        started = time.perf_counter()
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=sys.stderr.isatty(),
        )
        sizes = [size for size in (sample_bytes, _text_bound(corpus.train)) if size is not None]
        # Counts the text read; BPE's merges after the last text are not counted (its own bar shows them).
        with Progress("tokenizer training: reading text", min(sizes) if sizes else None) as progress:
            tokenizer.train_from_iterator(counted_bytes(texts, progress), trainer=trainer)
        ids = {
            "bos_id": tokenizer.token_to_id(BOS),
            "eos_id": tokenizer.token_to_id(EOS),
            "pad_id": tokenizer.token_to_id(PAD),
        }
        assert ids == {"bos_id": 0, "eos_id": 1, "pad_id": 2}, ids
        stats = {
            "seconds": round(time.perf_counter() - started, 3),
            "corpus": corpus.train.description,
            "train_fingerprint": corpus.train.fingerprint,
            "requested_vocab_size": vocab_size,
            "sample": sample or "whole train split",
        }
        _write(directory, tokenizer, fingerprint, ids, stats)
        data_logger().info(
            f"tokenizer {fingerprint}: trained vocab {vocab_size} on {corpus.train.description} "
            f"in {stats['seconds']:.1f} s"
        )
    return load_tokenizer_ref(directory)


def _text_bound(split: CorpusSplit) -> int | None:
    """About the text of a split: its files' bytes (JSON escapes make records' a little more; a file split
    by documents counts whole), None where unknown (a table, a compressed file)."""
    sizes: dict[str, int] = {}
    for leaf in split.leaves():
        if leaf.table is not None or any(part.file.codec for part in leaf.parts):
            return None
        sizes.update((part.file.path, part.file.size) for part in leaf.parts)
    return sum(sizes.values())


def _find(vocab: dict[str, int], names: tuple[str, ...]) -> int | None:
    return next((vocab[name] for name in names if name in vocab), None)


def import_tokenizer(
    path: str | Path, *, special_tokens: dict[str, str] | None = None, embedding_rows: int | None = None
) -> TokenizerRef:
    """Validate an existing `tokenizer.json`, find its special tokens, and cache a copy.

    `special_tokens` names the bos/eos/pad tokens where the source declares them (a Hugging Face
    checkpoint's tokenizer_config.json); otherwise they are found by their usual names. A tokenizer without
    a pad token gets one added, unless that would give it more tokens than `embedding_rows` (the model it
    comes with): then an existing special token that never occurs in text stands in (`<unk>`, else BOS
    when it is not EOS), as padding is never a training target.
    """
    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise DataError(f"Tokenizer file {source} does not exist; give the path of a tokenizer.json.")
    raw = source.read_bytes()
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise DataError(
            f"{source} is not a valid Hugging Face tokenizer.json ({err}); "
            "save one with tokenizers' Tokenizer.save()."
        ) from err
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    declared = {role: vocab.get(name) for role, name in (special_tokens or {}).items() if name}
    eos_id = declared.get("eos", _find(vocab, _EOS_NAMES))
    if eos_id is None:
        raise DataError(
            f"{source} has no end-of-text token (looked for {list(_EOS_NAMES)}); documents are "
            "joined with EOS, so add one with tokenizer.add_special_tokens()."
        )
    bos_id = declared.get("bos", _find(vocab, _BOS_NAMES))
    pad_id = declared.get("pad", _find(vocab, _PAD_NAMES))
    added_pad = False
    if pad_id is None:
        full = embedding_rows is not None and len(vocab) >= embedding_rows
        stand_in = _find(vocab, _UNK_NAMES) if full else None
        if stand_in is None and full and bos_id is not None and bos_id != eos_id:
            stand_in = bos_id
        if stand_in is not None:
            pad_id = stand_in
        else:
            tokenizer.add_special_tokens([PAD])
            pad_id, added_pad = tokenizer.token_to_id(PAD), True
    ids = {"bos_id": eos_id if bos_id is None else bos_id, "eos_id": eos_id, "pad_id": pad_id}
    fingerprint = blake(ALGORITHM_VERSION, "imported", raw, json.dumps(ids, sort_keys=True))
    directory = tokenizers_dir() / fingerprint
    if not is_complete(directory):
        with build_lock(directory):
            if not is_complete(directory):
                stats = {"imported_from": str(source), "added_pad_token": added_pad}
                _write(directory, tokenizer, fingerprint, ids, stats)
    return load_tokenizer_ref(directory)


def check_vocab_fits(tokenizer: TokenizerRef, model_vocab_size: int) -> None:
    """Raise DataError when the tokenizer emits ids the model's embedding has no row for."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"The tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model_vocab_size}; "
            f"set the model's vocab_size to at least {tokenizer.vocab_size} (e.g. rounded up to a multiple of 64: "
            f"{-(-tokenizer.vocab_size // 64) * 64}) or train a smaller tokenizer."
        )


def _tokenizer_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str | None:
    """The output's fingerprint; None (no caching) for an imported tokenizer."""
    args = dict(parameters)
    if args.get("tokenizer_path") is not None:
        return None  # importing is cheap and the file may change in place
    corpus = corpus_of_parameters(args)
    _, sample = corpus.train.sample(
        args.get("sample_bytes", SAMPLE_BYTES)
    )  # the choice only: nothing is read
    fingerprint = tokenizer_fingerprint(
        corpus.train.fingerprint, args.get("vocab_size", 8192), args.get("min_frequency", 2), sample
    )
    return prefect_cache_key("train_tokenizer", fingerprint, tokenizers_dir() / fingerprint)


train_tokenizer_task = task(
    train_tokenizer,
    name="train_tokenizer",
    cache_key_fn=_tokenizer_cache_key,
    persist_result=True,
    result_serializer="json",
)
