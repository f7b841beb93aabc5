"""What happens to each document after its side is decided: exact copies dropped, length limits, a user hook.

`DocFilter` travels with a file's parts as one canonical string (`key`, in the token cache's part key and
the corpus fingerprint; "" when it changes nothing), and is applied as the file is read
(`tasks.data.documents.routed_texts`). A document's side is decided on its text as read, before the hook
maps it: a hook never moves text across the split.

Whole-file documents are deduplicated across the corpus at listing, by their content digest
(`tasks.data.split`); documents inside a file (records, prose segments) by the hash of their text within the
file (`dedup`). Near duplicates (`dedup="minhash"`) are found among whole files with `datasketch`
(`tasks.data.near_dedup`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from tasks.data.errors import DataError


@dataclass(frozen=True)
class DocFilter:
    dedup: bool = False  # drop a document whose text an earlier one of the same file had
    min_chars: int = 0
    max_chars: int | None = None
    hook: str | None = None  # "module:function", text -> text | None
    hook_digest: str = ""  # of the hook's module source: an edited hook is another filter
    rule: str = ""  # how the file's documents are found and placed (documents inside a file)

    @property
    def key(self) -> str:
        values = {k: v for k, v in asdict(self).items() if v not in (False, 0, None, "")}
        return json.dumps(values, sort_keys=True) if values else ""

    @classmethod
    def parse(cls, key: str) -> DocFilter:
        return cls(**json.loads(key)) if key else cls()

    def apply(self, text: str) -> str | None:
        """The document as kept (the hook's result), or None when it is dropped."""
        if self.hook is not None:
            mapped = hook_function(self.hook)(text)
            if mapped is not None and not isinstance(mapped, str):
                raise DataError(
                    f"doc_filter={self.hook!r} returned a {type(mapped).__name__}; it must return the "
                    "document's text (a str) or None to drop it."
                )
            if not mapped:
                return None
            text = mapped
        if len(text) < self.min_chars or (self.max_chars is not None and len(text) > self.max_chars):
            return None
        return text


def _hook_error(spec: str, problem: str) -> DataError:
    return DataError(
        f"doc_filter={spec!r}: {problem}. Give 'module:function', an importable module's function that "
        "takes a document's text and returns its text (changed or not) or None to drop it."
    )


@cache
def hook_function(spec: str) -> Callable[[str], str | None]:
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise _hook_error(spec, "not of the form module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise _hook_error(spec, f"cannot import {module_name!r} ({err})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise _hook_error(spec, f"{module_name!r} has no function {name!r}")
    return function


def hook_digest(spec: str | None) -> str:
    """The hash of the hook's module source (its fingerprint: an edited hook re-filters the corpus)."""
    if spec is None:
        return ""
    function = hook_function(spec)
    source = getattr(importlib.import_module(function.__module__), "__file__", None)
    content = Path(source).read_bytes() if source else spec.encode()
    return hashlib.blake2b(content, digest_size=16).hexdigest()
