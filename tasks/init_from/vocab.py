"""The tokenizer that comes with the weights, checked against the embedding before any work; and the one
explicit way to grow the embedding for added tokens (`resize_embeddings`): new rows start as the mean of
the existing ones. Nothing is ever resized silently."""

from __future__ import annotations

from tokenizers import Tokenizer

from model import LlamaConfig
from tasks.init_from.parent_cache import InitFromError
from tasks.refs import ParentRef, TokenizerRef


def embedding_rows(tokenizer: TokenizerRef, parent: ParentRef, config: LlamaConfig, resize: bool) -> int:
    """The vocabulary size of the run's model: the parent's, or the tokenizer's when `resize` lets the
    embedding grow for it. A tokenizer with more tokens than the embedding has rows is refused here."""
    rows = config.vocab_size
    if tokenizer.vocab_size <= rows:
        return rows
    if resize:
        return tokenizer.vocab_size
    raise InitFromError(
        f"the tokenizer has {tokenizer.vocab_size} tokens but the model from init_from={parent.source!r} has "
        f"{rows} embedding rows (vocab_size): ids {rows}..{tokenizer.vocab_size - 1} have no row. Train with the "
        f"parent's own tokenizer (leave `tokenizer` unset), or let the embedding grow to {tokenizer.vocab_size} "
        "rows with resize_embeddings=true (--resize-embeddings; new rows start as the mean of the existing ones)"
    )


def check_extends(tokenizer: TokenizerRef, parent: ParentRef) -> None:
    """A tokenizer given with init_from must keep every token of the parent's at its id (tokens may only be
    added): the parent's embedding rows are indexed by those ids."""
    if parent.tokenizer_path is None:
        return
    theirs = Tokenizer.from_file(parent.tokenizer_path).get_vocab(with_added_tokens=True)
    ours = Tokenizer.from_file(tokenizer.path).get_vocab(with_added_tokens=True)
    moved = [(token, i, ours.get(token)) for token, i in sorted(theirs.items(), key=lambda kv: kv[1])]
    moved = [m for m in moved if m[1] != m[2]]
    if moved:
        token, before, after = moved[0]
        where = "is missing" if after is None else f"moved from id {before} to {after}"
        raise InitFromError(
            f"the tokenizer {tokenizer.path} does not extend the one that came with init_from="
            f"{parent.source!r}: {len(moved)} of its tokens changed id (e.g. {token!r} {where}), so the "
            "parent's embedding rows would stand for other tokens. Leave `tokenizer` unset to use the "
            "parent's, or add tokens to it (Tokenizer.add_tokens) without renumbering"
        )


def check_positions(seq_len: int, config: LlamaConfig, source: str) -> None:
    if seq_len > config.max_position_embeddings:
        raise InitFromError(
            f"seq_len={seq_len} is longer than the {config.max_position_embeddings} positions of the model "
            f"from init_from={source!r}: lower seq_len, or raise them with "
            f"model_overrides={{'max_position_embeddings': {seq_len}}}"
        )
