"""Text corpora: where documents come from, which side of the split each is on, their fingerprints.

`resolve_corpus(settings)` turns `DataSettings` into a `Corpus` of two `CorpusSplit`s. Resolving lists and
hashes the files (cheap: ~0.1 s for the 11 MB standard library) but tokenizes nothing, so every bad-input
error is raised before the expensive work starts. Sources: `tasks.data.sources` (one module per kind).

Split: with `val_data` the validation split is that source. Otherwise a document is validation when the hash
of its identity is below `val_fraction` (`tasks.data.documents`), whatever else the corpus holds: a new file,
a new subdirectory or a second file never moves a document that was there before. Code files are documents
whole (identity: the path under the source's root); prose files are cut into line-aligned segments and
record files into records, so their parts of a split are the documents of each file on that side. When no
whole file hashes into validation (a small corpus), the lowest-hashing one is lent to it: it can only move
back to training when the corpus grows, never the other way. A table source holds out rows by their text,
unless `hf_val_split` names a split.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from tasks.data.documents import VAL, generate_documents, is_val, part_texts
from tasks.data.errors import DataError, DataWarning, blake, unit_hash
from tasks.data.files import FilePart, SourceFile, read_source_files
from tasks.data.formats import RECORD_SUFFIXES, SEGMENT_CHARS, SEGMENTED_SUFFIXES
from tasks.data.settings import DataSettings, as_settings
from tasks.data.sources import kind_of
from tasks.data.sources.base import TableRef
from tasks.data.sources.stdlib import EXCLUDED_DIRS as STDLIB_EXCLUDED_DIRS
from tasks.data.tables import table_dataset, table_fingerprint

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
SPLIT_RULE = "by-document-identity-v2"  # in the fingerprints of parts split inside a file, and of tables
_TRAIN = "train"


# -------------------------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class CorpusSplit:
    """One split of a corpus: a fingerprint plus a way to get its documents."""

    name: Literal["train", "validation"]
    fingerprint: str
    description: str
    parts: tuple[FilePart, ...] = ()
    text_field: str = "text"
    table: TableRef | None = None
    table_select: tuple[str, float] | None = None
    bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # A mixture's split: each source's split of this side and its weight (normalized to sum to 1).
    components: tuple[tuple[str, float, CorpusSplit], ...] = ()

    def leaves(self) -> tuple[CorpusSplit, ...]:
        """The splits that hold documents: this one, or each source's of a mixture."""
        return tuple(split for _, _, split in self.components) or (self,)

    def texts(self) -> Iterator[str]:
        """Documents one by one, without holding the corpus in memory."""
        if self.components:
            for leaf in self.leaves():
                yield from leaf.texts()
            return
        if self.table is not None:
            for row in table_dataset(self.table, self.table_select):
                if row["text"]:
                    yield row["text"]
            return
        for part in self.parts:
            yield from part_texts(part, self.text_field)

    def sample(self, limit: int | None) -> tuple[Iterator[str], str]:
        """About `limit` bytes of this split's documents, chosen by their identity (deterministic, spread over
        the whole split), and what the choice adds to a fingerprint ("" when the split is taken whole).
        A mixture's sample takes from each source its weight's share of `limit`."""
        if self.components:
            return self._mixture_sample(limit)
        size = None if self.table is not None else sum(p.file.size for p in self.parts)
        if limit is None or (size is not None and size <= limit):
            return self.texts(), ""
        rate = 1.0 if not size else min(1.0, limit / size)  # a table's size is unknown: its first documents
        return self._sampled(rate, limit), f"sample={limit}"

    def _mixture_sample(self, limit: int | None) -> tuple[Iterator[str], str]:
        picks = [
            split.sample(None if limit is None else max(1, int(limit * w))) for _, w, split in self.components
        ]

        def texts() -> Iterator[str]:
            for iterator, _ in picks:
                yield from iterator

        added = [sample for _, sample in picks]
        return texts(), (f"mixture-sample={added}" if any(added) else "")

    def _sampled(self, rate: float, limit: int) -> Iterator[str]:
        left = limit
        for text in self._sample_candidates(rate):
            yield text
            left -= len(text.encode("utf-8"))
            if left <= 0:
                return

    def _sample_candidates(self, rate: float) -> Iterator[str]:
        if self.table is not None:
            yield from self.texts()
            return
        for part in self.parts:
            if part.select is not None:
                yield from (t for t in part_texts(part, self.text_field) if unit_hash(f"sample:{t}") < rate)
            elif (
                unit_hash(f"sample:{part.file.relpath}") < rate
            ):  # a whole file out of the sample is not read
                yield from part_texts(part, self.text_field)

    def dataset(self, *, streaming: bool = False):  # -> datasets.Dataset | datasets.IterableDataset
        """A `datasets` object with one column `text`, one row per document."""
        if self.table is not None:
            return table_dataset(self.table, self.table_select, streaming=streaming)
        from datasets import Dataset, Features, IterableDataset, Value

        kwargs = {"parts": list(self.parts), "text_field": self.text_field}
        features = Features({"text": Value("string")})
        if streaming:
            return IterableDataset.from_generator(generate_documents, features=features, gen_kwargs=kwargs)
        return Dataset.from_generator(
            generate_documents, features=features, gen_kwargs=kwargs, fingerprint=f"{self.fingerprint}-docs"
        )


@dataclass(frozen=True)
class Corpus:
    settings: DataSettings
    train: CorpusSplit
    val: CorpusSplit

    @property
    def fingerprint(self) -> str:
        return blake(FORMAT_VERSION, self.train.fingerprint, self.val.fingerprint)


def _parts_fingerprint(parts: list[FilePart], text_field: str) -> str:
    """Of the files' bytes and paths; a part split inside its file adds the rule and the fraction (a whole
    file's fingerprint is what it was before the split rule had a name: the stdlib corpus keeps its own)."""
    needs_field = any(p.file.kind in RECORD_SUFFIXES for p in parts)
    items = [FORMAT_VERSION, text_field if needs_field else ""]
    for part in sorted(parts, key=lambda p: p.file.relpath):
        items += [part.file.relpath, part.file.digest]
        if part.select is not None:
            items += [SPLIT_RULE, *map(repr, part.select)]
    return blake(*items)


def _split_inside(file: SourceFile) -> bool:
    """Whether a file's documents are not the file itself: records, or a prose file longer than a segment."""
    return file.kind in RECORD_SUFFIXES or (file.kind in SEGMENTED_SUFFIXES and file.size > SEGMENT_CHARS)


def _split_files(
    source: str, files: list[SourceFile], settings: DataSettings
) -> tuple[CorpusSplit, CorpusSplit]:
    fraction = settings.val_fraction
    inside = [f for f in files if _split_inside(f)]
    whole = [f for f in files if not _split_inside(f)]
    val_whole = [f for f in whole if is_val(f.relpath, fraction)]
    if not val_whole and not inside:
        val_whole = sorted(whole, key=lambda f: unit_hash(f.relpath))[:1]  # lent to validation: see above
    held_out = {f.relpath for f in val_whole}
    if len(held_out) == len(whole) and not inside:
        raise DataError(
            f"{source!r} holds {len(whole)} document(s), all on the validation side at val_fraction={fraction}, "
            "and a document's side never depends on the rest of the corpus: give val_data=, more files, or a "
            f"smaller val_fraction (a .txt/.md file over {SEGMENT_CHARS} characters splits by its segments, "
            "a .jsonl/.parquet by its records)."
        )
    train: list[FilePart] = []
    val: list[FilePart] = []
    for file in files:  # in the order listed: the corpus order
        if _split_inside(file):
            train.append(FilePart(file, (_TRAIN, fraction)))
            val.append(FilePart(file, (VAL, fraction)))
        else:
            (val if file.relpath in held_out else train).append(FilePart(file))
    return (
        _files_split(_TRAIN, source, train, settings.text_field),
        _files_split(VAL, source, val, settings.text_field),
    )


def _files_split(
    name: Literal["train", "validation"], source: str, parts: list[FilePart], text_field: str
) -> CorpusSplit:
    exact = all(p.select is None and p.file.kind not in RECORD_SUFFIXES for p in parts)
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


def _mixture(settings: DataSettings) -> Corpus:
    """Each source resolved (and split by its own documents' identities) alone; the mixture's splits hold
    them with their normalized weights, and its fingerprints cover every source's and every weight."""
    items = settings.sources() or ()
    total = sum(item.weight for item in items)
    corpora = [
        (
            item.source,
            item.weight / total,
            resolve_corpus(settings.model_copy(update={"data": item.source, **item.options()})),
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
    return Corpus(settings, *splits)


# ---------------------------------------------------------------------------------------- resolving


def _whole_source(source: str, settings: DataSettings, name: Literal["train", "validation"]) -> CorpusSplit:
    kind = kind_of(source)
    if kind.list_files is None:
        table = _table(source, settings, settings.hf_split)
        return CorpusSplit(name, blake(FORMAT_VERSION, table_fingerprint(table)), source, table=table)
    files = read_source_files(source, *kind.list_files(source), settings.text_field)
    return _files_split(name, source, [FilePart(f) for f in files], settings.text_field)


def corpus_of_parameters(parameters: Mapping[str, Any]) -> Corpus:
    """The corpus that a data stage task's parameters name (its cache key reads them before the task runs)."""
    named = {key: parameters[key] for key in DataSettings.model_fields if key != "data" and key in parameters}
    return resolve_corpus(parameters.get("data"), **named)


def resolve_corpus(data: str | DataSettings | None = None, **overrides: Any) -> Corpus:
    """Find, read and fingerprint the corpus, and decide its split; tokenizes nothing."""
    settings = as_settings(data, **overrides)
    if settings.sources() is not None:
        return _mixture(settings)
    source = settings.data or "stdlib"
    if settings.val_data is not None:
        return Corpus(
            settings, _whole_source(source, settings, _TRAIN), _whole_source(settings.val_data, settings, VAL)
        )
    kind = kind_of(source)
    if kind.list_files is None:
        return Corpus(settings, *_table_splits(source, settings))
    files = read_source_files(source, *kind.list_files(source), settings.text_field)
    return Corpus(settings, *_split_files(source, files, settings))
