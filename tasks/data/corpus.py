"""Text corpora: where documents come from, which side of the split each is on, their fingerprints.

`resolve_corpus(settings)` turns `DataSettings` into a `Corpus` of two `CorpusSplit`s. Resolving lists and
hashes the files (cheap: ~0.1 s for the 11 MB standard library) but tokenizes nothing, so every bad-input
error is raised before the expensive work starts. Sources: `tasks.data.sources` (one module per kind).

Split: with `val_data` the validation split is that source. Otherwise each document is placed once and
keeps its side: a whole file (code; prose up to `chunking.MIN_BYTES`) by the split manifest a continued run
carries (`split_from`, `tasks.data.split`), else by the hash of its identity (a code file's path under the
source's root, a prose file's content) below `val_fraction`; a document inside a file (a prose segment cut
where its content says, a record) by the hash of its text. A new file, a new subdirectory, an edit, a rename
or a deletion never moves a document that was there before. Exact copies are dropped (validation's copy
kept), and with no whole file on the validation side of a small corpus one never trained on is lent to it,
recorded in the manifest. A table source holds out rows by their text, unless `hf_val_split` names a split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from tasks.data.chunking import MIN_BYTES
from tasks.data.corpus_split import CorpusSplit
from tasks.data.documents import VAL
from tasks.data.errors import DataError, DataWarning, blake
from tasks.data.files import FilePart, SourceFile, read_source_files
from tasks.data.filters import DocFilter, hook_digest
from tasks.data.formats import RECORD_SUFFIXES, SEGMENTED_SUFFIXES
from tasks.data.near_dedup import drop_near_copies
from tasks.data.settings import DataSettings, as_settings
from tasks.data.sources import kind_of
from tasks.data.sources.base import TableRef
from tasks.data.sources.stdlib import EXCLUDED_DIRS as STDLIB_EXCLUDED_DIRS
from tasks.data.split import SourceRecord, SplitManifest, SplitRule, assign_whole, check_rule, load_manifest
from tasks.data.tables import table_fingerprint

__all__ = [
    "STDLIB_EXCLUDED_DIRS",
    "Corpus",
    "CorpusSplit",
    "DataError",
    "DataSettings",
    "DataWarning",
    "blake",
    "resolve_corpus",
]

FORMAT_VERSION = "corpus-v1"
SPLIT_RULE = "by-document-identity-v2"  # in the fingerprints of table splits
INSIDE_RULE = "by-text-hash-v3"  # of parts split inside a file: prose segments cut by content (chunking)
_TRAIN = "train"


@dataclass(frozen=True)
class Corpus:
    settings: DataSettings
    train: CorpusSplit
    val: CorpusSplit
    records: dict[str, SourceRecord] = field(default_factory=dict)  # each source's whole files, by side
    carried: tuple[str, ...] = ()  # digests of the parent manifest's entries for files no longer listed
    duplicates: int = 0  # documents dropped as (near) copies when the corpus was listed

    @property
    def fingerprint(self) -> str:
        return blake(FORMAT_VERSION, self.train.fingerprint, self.val.fingerprint, *self.carried)

    @property
    def manifest(self) -> SplitManifest:
        return SplitManifest(rule=split_rule(self.settings), sources=self.records)


def split_rule(settings: DataSettings) -> SplitRule:
    items = settings.sources()
    return SplitRule(
        sources=tuple(item.source for item in items) if items else (settings.data or "stdlib",),  # type: ignore[misc]
        val_data=settings.val_data,
        val_fraction=settings.val_fraction,
        hf_val_split=settings.hf_val_split,
    )


def _parts_fingerprint(parts: list[FilePart], text_field: str) -> str:
    """Of the files' bytes and paths; a part split inside its file adds the rule and the fraction (a whole
    file's fingerprint is what it was before the split rule had a name: the stdlib corpus keeps its own),
    and a part with filters those."""
    needs_field = any(p.file.kind in RECORD_SUFFIXES for p in parts)
    items = [FORMAT_VERSION, text_field if needs_field else ""]
    for part in sorted(parts, key=lambda p: p.file.relpath):
        items += [part.file.relpath, part.file.digest]
        if part.select is not None:
            items += [INSIDE_RULE, *map(repr, part.select)]
        if part.filters:
            items.append(part.filters)
    return blake(*items)


def _split_inside(file: SourceFile) -> bool:
    """Whether a file's documents are not the file itself: records, or a prose file that may be cut."""
    return file.kind in RECORD_SUFFIXES or (file.kind in SEGMENTED_SUFFIXES and file.size > MIN_BYTES)


def _filters(settings: DataSettings, hook: str) -> Callable[[SourceFile], str]:
    """Each file's `DocFilter.key` (`hook`: the hook's digest, read once per corpus)."""

    def key(file: SourceFile) -> str:
        inside = _split_inside(file)
        return DocFilter(
            dedup=inside and settings.dedup != "off",
            min_chars=settings.min_chars,
            max_chars=settings.max_chars,
            hook=settings.doc_filter,
            hook_digest=hook,
            rule=INSIDE_RULE if inside else "",
        ).key

    return key


def _split_files(
    source: str, files: list[SourceFile], settings: DataSettings, parent: SourceRecord | None
) -> Corpus:
    fraction = settings.val_fraction
    inside = [f for f in files if _split_inside(f)]
    whole = [f for f in files if not _split_inside(f)]
    placed = assign_whole(whole, fraction, parent, dedup=settings.dedup != "off", lend=not inside)
    if settings.dedup == "minhash":
        placed = drop_near_copies(placed, settings.near_dup_threshold)
    if not placed.validation and not inside and whole:
        raise DataError(
            f"{source!r} has no validation document left: the files its parent run validated on are gone, "
            "and every file here was trained on by it. Add files (a new one is lent to validation), or train "
            "from scratch (no init_from) for a new split."
        )
    if not placed.train and not inside:
        raise DataError(
            f"{source!r} holds {len(whole)} document(s), all on the validation side at val_fraction={fraction}, "
            "and a document's side never depends on the rest of the corpus: give val_data=, more files, or a "
            f"smaller val_fraction (a .txt/.md file over {MIN_BYTES} bytes splits by its segments, "
            "a .jsonl/.parquet by its records)."
        )
    sides = {f.path: VAL for f in placed.validation} | {f.path: _TRAIN for f in placed.train}
    train: list[FilePart] = []
    val: list[FilePart] = []
    filters_of = _filters(settings, hook_digest(settings.doc_filter))
    for file in files:  # in the order listed: the corpus order
        filters = filters_of(file)
        if _split_inside(file):
            train.append(FilePart(file, (_TRAIN, fraction), filters))
            val.append(FilePart(file, (VAL, fraction), filters))
        elif file.path in sides:
            (val if sides[file.path] == VAL else train).append(FilePart(file, None, filters))
    return Corpus(
        settings,
        _files_split(_TRAIN, source, train, settings.text_field),
        _files_split(VAL, source, val, settings.text_field),
        {source: placed.record},
        (placed.carried,) if placed.carried else (),
        len(placed.duplicates),
    )


def _files_split(
    name: Literal["train", "validation"], source: str, parts: list[FilePart], text_field: str
) -> CorpusSplit:
    exact = all(p.select is None and p.file.kind not in RECORD_SUFFIXES and not p.filters for p in parts)
    inside = sum(p.select is not None for p in parts)
    return CorpusSplit(
        name,
        _parts_fingerprint(parts, text_field),
        f"{source}: {len(parts) - inside} files" + (f" + documents of {inside} more" if inside else ""),
        tuple(parts),
        text_field,
        # Only whole text files have a known text size (Parquet and compressed files do not bound it).
        bytes=sum(p.file.size for p in parts) if exact else None,
        extra={"files": len(parts)},
    )


# ------------------------------------------------------------------------------------------- tables


def _table(source: str, settings: DataSettings, split: str) -> TableRef:
    return TableRef(kind_of(source).name, source, split, settings.text_field, settings.streaming)


def _table_splits(source: str, settings: DataSettings) -> tuple[CorpusSplit, CorpusSplit]:
    train_table = _table(source, settings, settings.hf_split)
    train_fp = table_fingerprint(train_table)
    if settings.hf_val_split is not None:
        val_table = _table(source, settings, settings.hf_val_split)
        return (
            CorpusSplit(
                _TRAIN, blake(FORMAT_VERSION, train_fp), f"{source}[{settings.hf_split}]", table=train_table
            ),
            CorpusSplit(
                VAL,
                blake(FORMAT_VERSION, table_fingerprint(val_table)),
                f"{source}[{settings.hf_val_split}]",
                table=val_table,
            ),
        )
    fraction = settings.val_fraction
    return tuple(  # type: ignore[return-value]
        CorpusSplit(
            name,
            blake(FORMAT_VERSION, train_fp, SPLIT_RULE, name, repr(fraction)),
            source if name == _TRAIN else f"{source} (held-out rows)",
            table=train_table,
            table_select=(name, fraction),
        )
        for name in (_TRAIN, VAL)
    )


# ---------------------------------------------------------------------------------------- mixtures

MIXTURE_RULE = "mixture-v2"  # v2: blocks drawn from across each source (tasks.data.mixture)


def _tagged(split: CorpusSplit, source: str) -> CorpusSplit:
    return replace(split, extra={**split.extra, "mixture_source": source})


def _mixture(settings: DataSettings, parent: SplitManifest | None) -> Corpus:
    """Each source resolved (and split by its own documents' identities) alone; the mixture's splits hold
    them with their normalized weights, and its fingerprints cover every source's and every weight."""
    items = settings.sources() or ()
    total = sum(item.weight for item in items)
    corpora = [
        (
            item.source,
            item.weight / total,
            _resolve(settings.model_copy(update={"data": item.source, **item.options()}), parent),
        )
        for item in items
    ]
    splits = []
    for name in (_TRAIN, VAL):
        components = tuple(
            (source, weight, _tagged(corpus.train if name == _TRAIN else corpus.val, source))
            for source, weight, corpus in corpora
        )
        fingerprint = blake(
            FORMAT_VERSION, MIXTURE_RULE, *(f"{s.fingerprint}:{round(w, 12)!r}" for _, w, s in components)
        )
        description = " + ".join(f"{w:.3g} × {s.description}" for _, w, s in components)
        sizes = [s.bytes for _, _, s in components]
        splits.append(
            CorpusSplit(
                name,
                fingerprint,
                f"mixture: {description}",
                text_field=settings.text_field,
                bytes=None if None in sizes else sum(sizes),  # type: ignore[arg-type]
                components=components,
            )
        )
    return Corpus(
        settings,
        *splits,
        {source: record for _, _, corpus in corpora for source, record in corpus.records.items()},
        tuple(carried for _, _, corpus in corpora for carried in corpus.carried),
        sum(corpus.duplicates for _, _, corpus in corpora),
    )


# ---------------------------------------------------------------------------------------- resolving


def _listed(source: str, settings: DataSettings) -> list[SourceFile]:
    kind = kind_of(source)
    return read_source_files(source, *kind.list_files(source), settings.text_field)  # type: ignore[misc]


def _table_source(source: str, settings: DataSettings, name: Literal["train", "validation"]) -> CorpusSplit:
    table = _table(source, settings, settings.hf_split)
    return CorpusSplit(name, blake(FORMAT_VERSION, table_fingerprint(table)), source, table=table)


def _with_val_data(source: str, settings: DataSettings) -> Corpus:
    """`val_data` is the validation split; training drops copies of its files (and of its own, unless
    dedup=off)."""
    dedup = settings.dedup != "off"
    holder: dict[str, str] = {}  # content digest -> the side that holds it
    splits: dict[str, CorpusSplit] = {}
    records: dict[str, SourceRecord] = {}
    dropped = 0
    filters_of = _filters(settings, hook_digest(settings.doc_filter))
    for name, where in ((VAL, settings.val_data or ""), (_TRAIN, source)):
        if kind_of(where).list_files is None:
            splits[name] = _table_source(where, settings, name)
            continue
        parts = []
        for file in _listed(where, settings):
            held = holder.get(file.digest) if file.size else None
            if held is not None and (dedup or (held == VAL and name == _TRAIN)):
                dropped += 1
                continue
            holder.setdefault(file.digest, name)
            parts.append(FilePart(file, None, filters_of(file)))
        entries = {p.file.digest: p.file.relpath for p in parts if p.file.size}
        records[where] = SourceRecord(validation=entries) if name == VAL else SourceRecord(train=entries)
        splits[name] = _files_split(name, where, parts, settings.text_field)
    return Corpus(settings, splits[_TRAIN], splits[VAL], records, (), dropped)


def corpus_of_parameters(parameters: Mapping[str, Any]) -> Corpus:
    """The corpus that a data stage task's parameters name (its cache key reads them before the task runs)."""
    named = {key: parameters[key] for key in DataSettings.model_fields if key != "data" and key in parameters}
    return resolve_corpus(parameters.get("data"), **named)


def resolve_corpus(data: str | DataSettings | None = None, **overrides: Any) -> Corpus:
    """Find, read and fingerprint the corpus, and decide its split; tokenizes nothing. With `split_from`,
    the manifest's documents keep their sides, and a changed split rule is refused."""
    settings = as_settings(data, **overrides)
    hook_digest(settings.doc_filter)  # an unimportable hook fails here, before the corpus is read
    parent = None
    if settings.split_from is not None:
        parent = load_manifest(settings.split_from)
        check_rule(parent.rule, split_rule(settings))
    return _resolve(settings, parent)


def _resolve(settings: DataSettings, parent: SplitManifest | None) -> Corpus:
    if settings.sources() is not None:
        return _mixture(settings, parent)
    source = settings.data or "stdlib"
    if settings.val_data is not None:
        return _with_val_data(source, settings)
    if kind_of(source).list_files is None:
        return Corpus(settings, *_table_splits(source, settings), {source: SourceRecord()})
    record = parent.sources.get(source) if parent is not None else None
    return _split_files(source, _listed(source, settings), settings, record)
