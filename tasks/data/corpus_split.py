"""One split of a corpus (`CorpusSplit`): its fingerprint, and its documents as text, a sample or a
`datasets` object. `tasks.data.corpus` makes them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.data.documents import generate_documents, part_texts
from tasks.data.errors import unit_hash
from tasks.data.files import FilePart
from tasks.data.sources.base import TableRef
from tasks.data.tables import table_dataset


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
