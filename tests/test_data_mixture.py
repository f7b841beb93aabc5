"""Mixtures of sources (`data: [{source, weight}, ...]`): deterministic per-block sampling by weight, each
source's own held-out documents as validation, fingerprints that cover every weight, clear errors for bad
weights (the MLflow run's record of each source: tests/test_tracking.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from stdlib_corpus import MODULES, STDLIB, copy_modules
from tasks.data import packing
from tasks.data.corpus import DataError, DataWarning, resolve_corpus
from tasks.data.settings import DataSettings
from tasks.dataset import build_dataset
from tasks.refs import DatasetRef, TokenizerRef
from tasks.tokenize import train_tokenizer

SEQ_LEN = 32


def _records(path: Path) -> Path:
    """A JSONL source: one record per paragraph of other stdlib modules than the code source's."""
    lines = []
    for name in (*MODULES[8:], "difflib.py"):  # not the code source's modules
        text = (STDLIB / name).read_text(encoding="utf-8")
        lines += [json.dumps({"text": block}) for block in text.split("\n\n") if len(block) > 40]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def sources(tmp_path: Path) -> tuple[str, str]:
    code = tmp_path / "code"
    copy_modules(code, MODULES[:8])
    return str(code), str(_records(tmp_path / "prose" / "records.jsonl"))


def _mixture(sources: tuple[str, str], weights: tuple[float, float]) -> DataSettings:
    return DataSettings(
        data=[{"source": s, "weight": w} for s, w in zip(sources, weights, strict=True)], val_fraction=0.2
    )


def _blocks(ref: DatasetRef, split: str) -> np.ndarray:
    return np.load(Path(ref.path) / f"{split}.npy", allow_pickle=False)


@pytest.fixture()
def tokenizer(home: Path, sources: tuple[str, str]) -> TokenizerRef:
    return train_tokenizer(_mixture(sources, (0.5, 0.5)), 384)


def test_mixture_draws_blocks_by_weight_and_validates_on_every_source(
    home: Path, sources: tuple[str, str], tokenizer: TokenizerRef, tmp_path: Path, monkeypatch
) -> None:
    mixture = _mixture(sources, (0.8, 0.2))
    ref = build_dataset(mixture, tokenizer, SEQ_LEN, num_proc=2)
    alone = [build_dataset(source, tokenizer, SEQ_LEN, val_fraction=0.2, num_proc=2) for source in sources]
    train = _blocks(ref, "train")
    own = [{row.tobytes() for row in _blocks(a, "train")} for a in alone]
    assert not own[0] & own[1]
    drawn = [sum(row.tobytes() in rows for row in train) for rows in own]
    assert sum(drawn) == len(train) == sum(a.train_blocks for a in alone)  # every block from one source
    assert drawn[0] / len(train) == pytest.approx(0.8, abs=0.05)
    # the lighter source's blocks drawn from across all of it, each once, not its first ones; the heavier
    # source, short of blocks, starts over: its epochs are recorded
    position = {row.tobytes(): i for i, row in enumerate(_blocks(alone[1], "train"))}
    from_prose = [position[row.tobytes()] for row in train if row.tobytes() in own[1]]
    assert len(set(from_prose)) == len(from_prose) < alone[1].train_blocks
    assert max(from_prose) >= len(from_prose) + 2 and min(from_prose) < alone[1].train_blocks // 2
    # validation: each source's own held-out blocks, all of them, in the order the sources are listed
    np.testing.assert_array_equal(_blocks(ref, "val"), np.concatenate([_blocks(a, "val") for a in alone]))
    meta = json.loads((Path(ref.path) / "meta.json").read_text())
    assert [(m["source"], m["weight"], m["blocks"]) for m in meta["mixture"]] == [
        (sources[0], 0.8, drawn[0]),
        (sources[1], 0.2, drawn[1]),
    ]
    assert [m["stream_tokens"] for m in meta["mixture"]] == [a.stats["train_stream_tokens"] for a in alone]
    epochs = [m["epochs"] for m in meta["mixture"]]
    assert (
        epochs == [round(d / a.train_blocks, 3) for d, a in zip(drawn, alone, strict=True)] and epochs[0] > 1
    )
    monkeypatch.setattr(
        packing, "REPEAT_WARNING", 1.0
    )  # the heavier source repeats: warned (at 10 by default)
    with pytest.warns(DataWarning, match=rf"source {re.escape(repr(sources[0]))} is repeated \d+\.\d times"):
        build_dataset(mixture, tokenizer, SEQ_LEN - 1, num_proc=2)
    # deterministic: the same mixture built again in another home is the same array
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "home2"))
    shutil.copytree(Path(tokenizer.path).parent, tmp_path / "tok")
    again = build_dataset(
        mixture, tokenizer.model_copy(update={"path": str(tmp_path / "tok" / "tokenizer.json")}), SEQ_LEN
    )
    assert again.fingerprint == ref.fingerprint
    np.testing.assert_array_equal(_blocks(again, "train"), train)


def test_the_fingerprint_covers_every_weight(sources: tuple[str, str]) -> None:
    base = resolve_corpus(_mixture(sources, (0.7, 0.3)))
    assert resolve_corpus(_mixture(sources, (7, 3))).fingerprint == base.fingerprint  # weights are relative
    assert resolve_corpus(_mixture(sources, (0.6, 0.4))).fingerprint != base.fingerprint
    assert resolve_corpus(_mixture(sources[::-1], (0.3, 0.7))).fingerprint != base.fingerprint
    assert resolve_corpus(sources[0], val_fraction=0.2).fingerprint != base.fingerprint
    # a mixture's split keeps each source's own split: its documents' sides do not depend on the mixture
    alone = resolve_corpus(sources[0], val_fraction=0.2)
    assert base.val.leaves()[0].fingerprint == alone.val.fingerprint


def test_a_mixture_from_the_command_line_is_json(sources: tuple[str, str]) -> None:
    given = json.dumps([{"source": sources[0], "weight": 2}, {"source": sources[1], "weight": 1}])
    settings = DataSettings(data=given)
    assert [(s.source, s.weight) for s in settings.sources()] == [(sources[0], 2.0), (sources[1], 1.0)]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([("A", 0.0), ("B", 1.0)], r"weight=0.0 of source .* must be a positive number.*leave a source out"),
        ([("A", -1.0), ("B", 1.0)], r"weight=-1.0 .* positive number"),
        ([("A", float("nan")), ("B", 1.0)], r"weight=nan .* positive number"),
        ([("A", 1.0), ("A", 1.0)], r"lists \[.*\] more than once: give each source once"),
        ([], r"names no source.*a mixture is data: \[\{source"),
    ],
)
def test_bad_mixtures_are_refused_with_the_fix(
    sources: tuple[str, str], items: list[tuple[str, float]], message: str
) -> None:
    named = {"A": sources[0], "B": sources[1]}
    with pytest.raises(DataError, match=message):
        resolve_corpus([{"source": named[s], "weight": w} for s, w in items])


def test_a_mixture_holds_out_its_own_validation_text(sources: tuple[str, str]) -> None:
    with pytest.raises(DataError, match="drop val_data"):
        resolve_corpus(_mixture(sources, (1, 1)), val_data=sources[0])
    with pytest.raises(DataError, match="not JSON"):
        resolve_corpus("[{source: x}")


def test_each_source_may_set_its_own_text_field_and_val_fraction(
    tmp_path: Path, sources: tuple[str, str]
) -> None:
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text(Path(sources[1]).read_text().replace('"text"', '"body"'))
    items = [{"source": sources[0], "weight": 1}, {"source": str(bodies), "weight": 1}]
    with pytest.raises(DataError, match=r"has no field 'text'"):
        resolve_corpus(items)
    items[1] |= {"text_field": "body", "val_fraction": 0.5}
    mixed = resolve_corpus(items, val_fraction=0.2)
    alone = [
        resolve_corpus(sources[0], val_fraction=0.2),
        resolve_corpus(str(bodies), text_field="body", val_fraction=0.5),
    ]
    assert [leaf.fingerprint for leaf in mixed.val.leaves()] == [a.val.fingerprint for a in alone]
    assert list(mixed.val.leaves()[1].texts()) == list(alone[1].val.texts())
    with pytest.raises(DataError, match=r"val_fraction"):
        resolve_corpus([items[0], {**items[1], "val_fraction": 1.5}])
