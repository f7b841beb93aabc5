"""The split manifest: which side each whole-file document is on, recorded so a continued run keeps it.

A whole-file document (a code file, a short prose file) is recorded by its content digest with its path
under the source's root, on its side. A run given a manifest (`split_from`; the pretrain flow passes its
`init_from` parent's) looks every whole file up by content first, then (code only) by path: an edited
validation file stays validation, a renamed or copied file keeps its text's side, and a trained file never
becomes validation. Only a document the manifest does not know is placed by the rule (`is_val` of its
identity: a code file's path, a prose file's content). Entries of files no longer in the corpus are carried
forward, so text that was validation once is validation whenever it comes back.

Documents inside a file (records, prose segments) need no entry: their side is a pure function of their
text (`tasks.data.documents`), the same in every run with the same `val_fraction`. Which is why a continued
run may not change the rule (`val_fraction`, the source, `val_data`, `hf_val_split`): `check_rule` refuses it.

Exact copies: among files with the same content, one document is kept, on validation if any copy is there;
a training copy of validation text is always dropped (even with `dedup=off`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.data.documents import VAL, content_identity, is_val
from tasks.data.errors import DataError, blake, unit_hash
from tasks.data.files import SourceFile
from tasks.data.formats import SEGMENTED_SUFFIXES

MANIFEST_NAME = "split_manifest.json"
VERSION = "split-manifest-v1"
TRAIN = "train"


class SplitRule(BaseModel):
    """What decides a document's side that the manifest does not record."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sources: tuple[str, ...]
    val_data: str | None = None
    val_fraction: float
    hf_val_split: str | None = None


class SourceRecord(BaseModel):
    """One source's whole-file documents: content digest → path under the source's root, per side."""

    model_config = ConfigDict(extra="forbid")

    validation: dict[str, str] = Field(default_factory=dict)
    train: dict[str, str] = Field(default_factory=dict)

    def sides(self) -> Callable[[SourceFile], str | None]:
        """A file's recorded side: by its content, then (a code file) by its path; None when it is new."""
        by_content = {**{d: TRAIN for d in self.train}, **{d: VAL for d in self.validation}}
        by_path = {**{p: TRAIN for p in self.train.values()}, **{p: VAL for p in self.validation.values()}}

        def side_of(file: SourceFile) -> str | None:
            if file.digest in by_content:
                return by_content[file.digest]
            return None if file.kind in SEGMENTED_SUFFIXES else by_path.get(file.relpath)

        return side_of


class SplitManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = VERSION
    rule: SplitRule
    sources: dict[str, SourceRecord] = Field(default_factory=dict)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True) + "\n")


def load_manifest(path: str) -> SplitManifest:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise DataError(
            f"split_from={path!r} cannot be read ({err.strerror}): give the {MANIFEST_NAME} of a packed "
            "dataset or of a parent run, or drop split_from for a new split."
        ) from None
    try:
        return SplitManifest.model_validate_json(text)
    except ValidationError as err:
        raise DataError(
            f"split_from={path!r} is not a split manifest ({err.errors()[0]['msg']}): give the "
            f"{MANIFEST_NAME} of a packed dataset or of a parent run."
        ) from None


def check_rule(parent: SplitRule, rule: SplitRule) -> None:
    """Refuse a run whose split rule differs from its parent's: its validation text could be trained text."""
    problems = []
    if rule.val_fraction != parent.val_fraction:
        problems.append(f"val_fraction={rule.val_fraction} (the parent's: {parent.val_fraction})")
    # A source that names the parent's files another way (another root or glob over them) would move code files,
    # whose identity is their path, across the split; a corpus of other files (continued pretraining on new
    # text) is not a change of rule: the manifest still keeps any of the parent's documents on their side.
    if missing := [
        m for m in parent.sources if m not in rule.sources and any(_overlap(m, s) for s in rule.sources)
    ]:
        problems.append(
            f"data={list(rule.sources)} names the files of the parent's source(s) {missing} another way"
        )
    for name in ("val_data", "hf_val_split"):
        if getattr(rule, name) != getattr(parent, name):
            problems.append(f"{name}={getattr(rule, name)!r} (the parent's: {getattr(parent, name)!r})")
    if problems:
        raise DataError(
            f"This run changes the split rule of the run it continues: {'; '.join(problems)}. A continued "
            "run keeps its parent's split, so that its validation text was never trained on: give the "
            "parent's values (a root or glob that still names the parent's files), or train from scratch "
            "(no init_from) for a new split."
        )


def _overlap(a: str, b: str) -> bool:
    """Whether two sources can list the same files: one's root (the path up to its first glob) holds the other's."""
    ra, rb = _root(a), _root(b)
    return ra == rb or rb.is_relative_to(ra) or ra.is_relative_to(rb)


def _root(source: str) -> Path:
    parts = Path(source).expanduser().parts
    fixed = list(parts)
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            fixed = list(parts[:i])
            break
    return Path(*fixed) if fixed else Path(".")


# ------------------------------------------------------------------------------------------ assigning


@dataclass
class WholeSplit:
    """Whole-file documents placed: each side's files (corpus order), the copies dropped, the record."""

    validation: list[SourceFile] = field(default_factory=list)
    train: list[SourceFile] = field(default_factory=list)
    duplicates: list[SourceFile] = field(default_factory=list)
    record: SourceRecord = field(default_factory=SourceRecord)
    carried: str = ""  # the digest of the parent's entries for files no longer listed ("" when none)


def file_identity(file: SourceFile) -> str:
    """What the rule hashes: a code file's path (its edits keep its side), a prose file's content."""
    return content_identity(file.digest) if file.kind in SEGMENTED_SUFFIXES else file.relpath


def assign_whole(
    files: list[SourceFile],
    fraction: float,
    parent: SourceRecord | None,
    *,
    dedup: bool,
    lend: bool,
) -> WholeSplit:
    """Each whole file's side (recorded, else by the rule), exact copies dropped, and with `lend` (no other
    validation document in the source) the lowest-hashing document the parent never trained on lent to
    validation, recorded so it stays there."""
    recorded = parent.sides() if parent is not None else (lambda _: None)
    sides = {}
    for file in files:
        side = recorded(file)
        sides[file.path] = side or (VAL if is_val(file_identity(file), fraction) else TRAIN)
    result = WholeSplit()
    kept: dict[str, SourceFile] = {}
    for file in sorted(files, key=lambda f: sides[f.path] != VAL):  # validation copies first (stable)
        if file.size == 0:  # no document: never anyone's copy
            continue
        first = kept.setdefault(file.digest, file)
        if first is not file and (dedup or sides[first.path] != sides[file.path]):
            result.duplicates.append(file)
    dropped = {f.path for f in result.duplicates}
    chosen = [f for f in files if f.path not in dropped]
    if lend and not any(sides[f.path] == VAL for f in chosen):
        new = [f for f in chosen if f.size and recorded(f) is None]
        if new:
            sides[min(new, key=lambda f: unit_hash(file_identity(f))).path] = VAL
    for file in chosen:
        (result.validation if sides[file.path] == VAL else result.train).append(file)
        if file.size:
            getattr(result.record, TRAIN if sides[file.path] == TRAIN else "validation")[file.digest] = (
                file.relpath
            )
    if parent is not None:
        listed = {f.digest for f in files}
        placed = {**result.record.validation, **result.record.train}
        gone = {
            side: {d: p for d, p in getattr(parent, side).items() if d not in listed and d not in placed}
            for side in ("validation", "train")
        }
        for side, entries in gone.items():
            getattr(result.record, side).update(entries)
        if any(gone.values()):
            result.carried = blake("carried", json.dumps(gone, sort_keys=True))
    return result
