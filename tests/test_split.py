"""The sticky split (tasks/data/split.py, tasks/data/chunking.py): a continued run carries its parent's split
manifest, and no change of the corpus (an edit, a deletion, a rename, a copy) puts text a run trained on into
a later run's validation split. Unit level: corpora are resolved, nothing is tokenized."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.data.corpus import Corpus, DataError, resolve_corpus
from tasks.data.errors import unit_hash
from tasks.data.split import MANIFEST_NAME


def _texts(corpus: Corpus) -> tuple[set[str], set[str]]:
    return set(corpus.train.texts()), set(corpus.val.texts())


def _manifest(corpus: Corpus, where: Path) -> str:
    path = where / MANIFEST_NAME
    corpus.manifest.write(path)
    return str(path)


def _never_trained_on(*runs: tuple[set[str], set[str]]) -> None:
    """No run's validation document (runs: each one's (train, validation) texts, in order) is a training
    document of it or of any run before it."""
    trained: set[str] = set()
    for train, val in runs:
        trained |= train
        assert val, "an empty validation split"
        assert not val & trained, f"{len(val & trained)} validation document(s) trained on"


def _code_files(root: Path, count: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = root / f"module{i:02d}.py"
        path.write_text(f"def function_{i}():\n    return {i} * {i + 1}\n")
        paths.append(path)
    return paths


def _name(root: Path, validation: bool, fraction: float) -> Path:
    """A new file name under `root` that the rule (its path's hash) puts on the side asked for."""
    return next(
        root / f"renamed{i}.py"
        for i in range(10_000)
        if (unit_hash(f"renamed{i}.py") < fraction) == validation and not (root / f"renamed{i}.py").exists()
    )


def test_an_edit_near_the_start_of_a_prose_file_moves_only_the_segment_it_is_in(tmp_path: Path) -> None:
    lines = [
        f"line {i} of the book: {'lorem ipsum dolor ' * (i % 7)}sit amet, number {i * 7919}\n"
        for i in range(30_000)
    ]
    book = tmp_path / "books" / "book.txt"
    book.parent.mkdir()
    book.write_text("".join(lines))
    before = resolve_corpus(str(book.parent), val_fraction=0.2)
    (old_train, old_val), manifest = _texts(before), _manifest(before, tmp_path)
    edit = [f"an edit near the start of the file, line {i}\n" for i in range(60)]
    book.write_text("".join([*lines[:3], *edit, *lines[3:]]))
    after = resolve_corpus(str(book.parent), val_fraction=0.2, split_from=manifest)
    new_train, new_val = _texts(after)
    assert len(old_train | old_val) > 20
    changed = (new_train | new_val) - (old_train | old_val)
    assert 1 <= len(changed) <= 2, f"{len(changed)} segments changed: the cuts moved"
    assert (new_train - changed) <= old_train and (new_val - changed) <= old_val, "a segment changed sides"
    whole_lines = {line.rstrip("\n") for line in lines}  # a segment may start or end inside a line
    moved = {line for text in new_val - changed for line in text.splitlines()} & {
        line for text in old_train for line in text.splitlines()
    }
    moved &= whole_lines
    assert not moved, f"{len(moved)} lines trained on are now validation text"
    _never_trained_on((old_train, old_val), (new_train, new_val))


def test_prose_without_newlines_is_cut(tmp_path: Path) -> None:
    (tmp_path / "one_line.txt").write_text(" ".join(f"word{i}" for i in range(400_000)))
    ideographs = "".join(chr(0x4E00 + (i * 7919) % 20_000) for i in range(300_000))  # 3 bytes each
    (tmp_path / "no_space.txt").write_text(ideographs)
    corpus = resolve_corpus(str(tmp_path), val_fraction=0.2)
    texts = list(corpus.train.texts()) + list(corpus.val.texts())
    assert len(texts) > 10 and max(len(t.encode()) for t in texts) <= 1 << 18
    cut = [t for t in texts if t[0] >= chr(0x4E00)]
    assert len(cut) >= 4 and all(t in ideographs for t in cut) and sum(map(len, cut)) == len(ideographs)


def test_a_deleted_validation_file_never_lends_a_trained_one(tmp_path: Path) -> None:
    _code_files(tmp_path / "c", 20)
    first = resolve_corpus(str(tmp_path / "c"), val_fraction=0.05)
    first_texts, manifest = _texts(first), _manifest(first, tmp_path)
    held_out = {Path(p.file.path): Path(p.file.path).read_text() for p in first.val.parts}
    assert held_out
    for path in held_out:
        path.unlink()
    with pytest.raises(DataError, match=r"no validation document left.*every file here was trained on"):
        resolve_corpus(str(tmp_path / "c"), val_fraction=0.05, split_from=manifest)
    (tmp_path / "c" / "new.py").write_text("NEW = 'a file the parent never saw'\n")
    second = resolve_corpus(str(tmp_path / "c"), val_fraction=0.05, split_from=manifest)
    assert [p.file.relpath for p in second.val.parts] == ["new.py"]
    second_texts = _texts(second)
    _never_trained_on(first_texts, second_texts)
    # The deleted file is carried in the manifest: when it comes back, it is validation again.
    back, text = next(iter(held_out.items()))
    back.write_text(text)
    third = resolve_corpus(str(tmp_path / "c"), val_fraction=0.05, split_from=_manifest(second, tmp_path))
    assert back.name in {Path(p.file.path).name for p in third.val.parts}
    _never_trained_on(first_texts, second_texts, _texts(third))


def test_a_renamed_file_keeps_its_side(tmp_path: Path) -> None:
    root = tmp_path / "c"
    _code_files(root, 40)
    first = resolve_corpus(str(root), val_fraction=0.2)
    manifest, sides = _manifest(first, tmp_path), _texts(first)
    trained, validated = Path(first.train.parts[0].file.path), Path(first.val.parts[0].file.path)
    trained.rename(_name(root, validation=True, fraction=0.2))  # its new path alone would be validation
    validated.rename(_name(root, validation=False, fraction=0.2))
    second = resolve_corpus(str(root), val_fraction=0.2, split_from=manifest)
    assert _texts(second) == sides
    _never_trained_on(sides, _texts(second))


def test_the_same_file_at_two_paths_is_one_validation_document(tmp_path: Path) -> None:
    root = tmp_path / "c"
    _code_files(root, 20)
    text = "SHARED = 'the same text at two paths'\n"
    (root / _name(root, validation=True, fraction=0.2).name).write_text(text)
    (root / _name(root, validation=False, fraction=0.2).name).write_text(text)
    corpus = resolve_corpus(str(root), val_fraction=0.2)
    train, val = _texts(corpus)
    assert text in val and text not in train
    assert corpus.duplicates == 1
    _never_trained_on((train, val))
    kept = resolve_corpus(str(root), val_fraction=0.2, dedup="off")
    assert text not in _texts(kept)[0] and kept.duplicates == 1  # a copy of validation text, even then


def test_a_continued_run_that_changes_the_split_rule_is_refused(tmp_path: Path) -> None:
    _code_files(tmp_path / "c", 20)
    manifest = _manifest(resolve_corpus(str(tmp_path / "c"), val_fraction=0.2), tmp_path)
    with pytest.raises(DataError, match=r"val_fraction=0.3 \(the parent's: 0.2\).*give the parent's values"):
        resolve_corpus(str(tmp_path / "c"), val_fraction=0.3, split_from=manifest)
    with pytest.raises(DataError, match=r"names the files of the parent's source.*train from scratch"):
        resolve_corpus(str(tmp_path / "c" / "*.py"), val_fraction=0.2, split_from=manifest)
    _code_files(tmp_path / "other", 20)  # continued pretraining on other files: not a change of rule
    resolve_corpus(str(tmp_path / "other"), val_fraction=0.2, split_from=manifest)
    resolve_corpus(str(tmp_path / "c"), val_fraction=0.2, split_from=manifest)  # the same rule: accepted
