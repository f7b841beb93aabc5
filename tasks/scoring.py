"""What evaluation scores, exactly: the validation text in tokens and in UTF-8 bytes, and xz on those bytes.
How a model is scored on it is the engine's loss (`tasks.training.loss.score_text`): the evaluate task and
the engine's periodic score during training use the same.

Evaluation predicts every token of the first `max_blocks * seq_len` tokens of the validation stream (or of
all of it) once (the first one after an EOS, as a document follows EOS in training). The text those tokens
spell is the *validation text*: its UTF-8 bytes are counted exactly with a per-token byte table of the
byte-level tokenizer (special tokens count 0 bytes), so bits per byte = summed loss in bits / those bytes. A model
with another tokenizer is scored on the same text by encoding its documents with its own tokenizer
(`tasks.evaluate.rescore`); xz compresses the same bytes. The engine's periodic score takes the text's
first N bytes (`first_bytes`): the same bytes whatever the tokenizer and block length that read them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import lzma
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders

from model.atomic import write_text_atomic
from tasks import home
from tasks.data.packed import open_blocks
from tasks.refs import DatasetRef, TokenizerRef

XZ_PRESET = 9 | lzma.PRESET_EXTREME  # xz -9e


class ScoringError(ValueError):
    """The validation text cannot be scored in bytes."""


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The byte-level alphabet: each byte is written as one printable character in a vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return {c: b for b, c in chars.items()}


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The UTF-8 bytes each token id stands for (special tokens: none), for a byte-level BPE."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel) or tokenizer.normalizer is not None:
        raise ScoringError(
            "bits per byte needs a byte-level BPE tokenizer (ByteLevel decoder, no normalizer): its tokens "
            "spell the text's bytes exactly. Train one (leave `tokenizer` unset) or import a byte-level "
            "tokenizer.json (GPT-2, Llama 3 and the like)."
        )
    byte_of = _byte_of_char()
    added = tokenizer.get_added_tokens_decoder()
    table = [b""] * tokenizer.get_vocab_size(with_added_tokens=True)
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in added:
            table[i] = b"" if added[i].special else token.encode("utf-8")
        else:
            table[i] = bytes(byte_of[c] for c in token)
    return table


def check_byte_level(tokenizer: TokenizerRef) -> None:
    """Raise ScoringError before any work when evaluation could not count bytes."""
    token_bytes(Tokenizer.from_file(tokenizer.path))


@dataclass(frozen=True)
class ValidationText:
    dataset_fingerprint: str
    tokens: np.ndarray  # the scored ids (int64), each predicted once
    context_id: int  # what the first one is predicted after (EOS)
    text: bytes  # the UTF-8 bytes they spell
    pieces: tuple[tuple[str, bytes], ...]  # ("text", bytes) | ("bos", b"") | ("eos", b""), in order
    fingerprint: str  # of `pieces`: the same fingerprint is the same text, whatever the tokenizer

    def documents(self) -> list[tuple[str, str]]:
        """The pieces as (kind, str): a tokenizer encodes strings."""
        return [(kind, data.decode("utf-8")) for kind, data in self.pieces]


def _ends_on_a_character(data: bytes) -> bool:
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the last character's first byte: how many bytes it needs
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return back >= need
    return not data


def _whole_characters(tokens: np.ndarray, table: list[bytes]) -> int:
    """How many leading tokens end on a UTF-8 character boundary (a byte-level token may split one)."""
    end = len(tokens)
    while end > 0 and not _ends_on_a_character(b"".join(table[t] for t in tokens[max(0, end - 8) : end])):
        end -= 1
    return end


def validation_text(dataset: DatasetRef, tokenizer: TokenizerRef, max_blocks: int | None) -> ValidationText:
    """The first `max_blocks * seq_len` tokens of the validation stream (all of it when `max_blocks` is
    None; PAD removed, cut back to a character boundary), and the exact text they spell."""
    if max_blocks is not None and max_blocks < 1:
        raise ScoringError(f"max_blocks must be >= 1 (or None for every block), got {max_blocks}")
    blocks = open_blocks(dataset.path, "val")
    if max_blocks is None:
        budget = blocks.size
        stream = np.asarray(blocks.reshape(-1), dtype=np.int64)
    else:
        budget = max_blocks * dataset.seq_len  # rows hold seq_len + 1 tokens: read one more per block
        stream = np.asarray(blocks.reshape(-1)[: budget + max_blocks], dtype=np.int64)
    pads = np.flatnonzero(stream == tokenizer.pad_id)
    tokens = stream[: min(budget, pads[0] if len(pads) else len(stream))]
    if len(tokens) == 0:
        raise ScoringError(f"{dataset.path}/val.npy holds no tokens: nothing to evaluate")
    table = token_bytes(Tokenizer.from_file(tokenizer.path))
    if int(tokens.max()) >= len(table):
        raise ScoringError(
            f"the validation split holds id {int(tokens.max())}, beyond the tokenizer's {len(table)} tokens: "
            "the dataset was built with another tokenizer"
        )
    tokens = tokens[: _whole_characters(tokens, table)]
    special = {tokenizer.bos_id: "bos", tokenizer.eos_id: "eos"}
    pieces: list[tuple[str, bytes]] = []
    run: list[bytes] = []
    for t in tokens.tolist():
        if t in special:
            if run:
                pieces.append(("text", b"".join(run)))
                run = []
            pieces.append((special[t], b""))
        else:
            run.append(table[t])
    if run:
        pieces.append(("text", b"".join(run)))
    return ValidationText(
        dataset_fingerprint=dataset.fingerprint,
        tokens=tokens,
        context_id=tokenizer.eos_id,
        text=b"".join(data for _, data in pieces),
        pieces=tuple(pieces),
        fingerprint=_fingerprint(pieces),
    )


def _fingerprint(pieces: list[tuple[str, bytes]] | tuple[tuple[str, bytes], ...]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for kind, data in pieces:
        digest.update(f"{kind}:{len(data)}:".encode() + data)
    return digest.hexdigest()


def encode_documents(text: ValidationText, tokenizer: Tokenizer, specials: dict[str, int]) -> np.ndarray:
    """The text in `tokenizer`'s ids: each run of text encoded alone, `specials["bos"|"eos"]` between
    them. ScoringError when the tokenizer does not spell the text back exactly (other bytes)."""
    ids: list[int] = []
    for kind, piece in text.documents():
        if kind != "text":
            ids.append(specials[kind])
            continue
        encoded = tokenizer.encode(piece, add_special_tokens=False).ids
        if tokenizer.decode(encoded, skip_special_tokens=False) != piece:
            raise ScoringError("its tokenizer does not reproduce the validation text exactly")
        ids.extend(encoded)
    return np.asarray(ids, dtype=np.int64)


def first_bytes(
    text: ValidationText, n_bytes: int, tokenizer: Tokenizer, specials: dict[str, int]
) -> ValidationText:
    """The text's first `n_bytes` bytes (cut back to a character boundary), in `tokenizer`'s ids: the same
    bytes whatever tokenizer and block length the text was read with (a cut document is encoded as cut)."""
    pieces: list[tuple[str, bytes]] = []
    left = n_bytes
    for kind, data in text.pieces:
        if left <= 0:
            break
        if kind != "text":
            pieces.append((kind, data))
            continue
        kept = data[:left].decode("utf-8", errors="ignore").encode("utf-8")  # drops a cut character
        pieces.append((kind, kept))
        left -= len(kept)
        if len(kept) < len(data):
            break
    cut = ValidationText(
        dataset_fingerprint=text.dataset_fingerprint,
        tokens=text.tokens[:0],
        context_id=text.context_id,
        text=b"".join(data for _, data in pieces),
        pieces=tuple(pieces),
        fingerprint=_fingerprint(pieces),
    )
    return dataclasses.replace(cut, tokens=encode_documents(cut, tokenizer, specials))


def xz_bits_per_byte(text: ValidationText) -> float:
    """xz -9e's size of the validation text in bits per byte, cached per dataset fingerprint."""
    cache = home.cache_dir() / "xz" / f"{text.dataset_fingerprint}-{len(text.tokens)}.json"
    if cache.is_file():
        known = json.loads(cache.read_text())
        if known.get("text_fingerprint") == text.fingerprint:
            return float(known["bits_per_byte"])
    compressed = len(lzma.compress(text.text, preset=XZ_PRESET))
    bits_per_byte = compressed * 8 / len(text.text)
    record = {"text_fingerprint": text.fingerprint, "bytes": len(text.text), "xz_bytes": compressed}
    write_text_atomic(Path(cache), json.dumps({**record, "bits_per_byte": bits_per_byte}))
    return bits_per_byte
