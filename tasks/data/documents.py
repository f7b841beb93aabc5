"""A part's documents, read while its bytes are hashed, and which side of the split each one is on.

A document inside a file is placed by a pure function of its identity, whatever else the corpus holds: a
prose segment's is the hash of its bytes (`tasks.data.chunking` cuts where the content says), a record's is
its text; it is validation when `unit_hash(identity) < val_fraction`. Whole files are placed when the corpus
is listed (`tasks.data.split`). After its side, each document goes through the part's `DocFilter`.

The bytes read are hashed on the way; a file whose bytes are not the ones the corpus was listed with (an
ingest job rewrote it, or deleted it) is a `DataError` at the end of the read, so tokens are never stored
under the key of other bytes.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator, Sequence

from tasks.data.chunking import segments
from tasks.data.digest_index import forget
from tasks.data.errors import DataError, not_utf8, unit_hash
from tasks.data.files import FilePart, SourceFile
from tasks.data.filters import DocFilter
from tasks.data.formats import RECORD_SUFFIXES, SEGMENTED_SUFFIXES, HashingReader, records, text_documents

VAL = "validation"


def is_val(identity: str, val_fraction: float) -> bool:
    return unit_hash(identity) < val_fraction


def content_identity(digest: str) -> str:
    """The identity of prose by its bytes' digest: a short file's is its file digest's."""
    return f"content:{digest}"


def _documents(file: SourceFile, raw: HashingReader, text_field: str) -> Iterator[tuple[str, str]]:
    """(identity, text) of every non-empty document of `file`."""
    if file.kind in SEGMENTED_SUFFIXES:
        for digest, text in segments(io.BufferedReader(raw, buffer_size=1 << 20)):  # type: ignore[arg-type]
            if text:
                yield content_identity(digest), text
        return
    if file.kind not in RECORD_SUFFIXES:
        for text in text_documents(raw, file.kind):
            if text:
                yield file.relpath, text
        return
    for index, record in enumerate(records(raw, file.path, file.kind, file.codec, [text_field])):
        if text_field not in record:
            raise DataError(
                f"{file.path} record {index} has no field {text_field!r}; its fields are {list(record)}."
            )
        if text := record[text_field]:
            text = str(text)
            yield text, text


def part_texts(part: FilePart, text_field: str) -> Iterator[str]:
    """The texts of a part's documents, in file order; raises DataError when the file's bytes changed."""
    return (text for _, text in routed_texts(part.file, [part.select], text_field, part.filters))


def routed_texts(
    file: SourceFile, selects: Sequence[tuple[str, float] | None], text_field: str, filters: str = ""
) -> Iterator[tuple[int, str]]:
    """Each document of `file` in one read, as (index of the first selection it falls in, text); documents in
    none are skipped (`None` selects the whole file), and so are those `filters` (a `DocFilter.key`) drops.
    Raises DataError when the file's bytes changed."""
    keep = DocFilter.parse(filters)
    seen: set[bytes] = set()
    try:
        handle = open(file.path, "rb")  # noqa: SIM115 (closed by the `with` below)
    except FileNotFoundError as err:
        raise DataError(
            f"{file.path} was deleted after the corpus was listed; rerun (the corpus is listed again)."
        ) from err
    with handle:
        raw = HashingReader(handle)
        try:
            for identity, text in _documents(file, raw, text_field):
                position = None  # the identity's unit hash, computed once per document
                for index, select in enumerate(selects):
                    if select is not None:
                        position = unit_hash(identity) if position is None else position
                        if (position < select[1]) != (select[0] == VAL):  # is_val, hashed once
                            continue
                    if keep.dedup:
                        digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
                        if digest in seen:
                            break
                        seen.add(digest)
                    if (kept := keep.apply(text)) is not None:
                        yield index, kept
                    break
        except UnicodeDecodeError as err:  # inside a compressed file: its bytes were not checked when listed
            raise not_utf8(file.path, err) from err
        digest, size = raw.finish()
    if digest != file.digest:
        forget(file.path)  # a stale row of the digest index must not list the old digest again
        raise DataError(
            f"{file.path} changed while this run read it ({size} bytes now, {file.size} when the corpus was "
            "listed): its tokens are not kept. Rerun once whatever writes it has finished."
        )


def generate_documents(parts: list[FilePart], text_field: str) -> Iterator[dict[str, str]]:
    """Generator for `datasets`: one row {"text": ...} per document (top-level, so it pickles)."""
    for part in parts:
        for text in part_texts(part, text_field):
            yield {"text": text}
