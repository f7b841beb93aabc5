"""DataSettings: which text a run trains on and how validation text is held out; the one typed object the
data stages take (`PretrainConfig` is one, so every field is a CLI flag and a YAML key)."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.data.errors import DataError
from tasks.data.sources import check_source, kind_of


class MixtureSource(BaseModel):
    """One source of a mixture and its weight (weights are relative: 0.7/0.3 and 7/3 are one mixture), with
    the options it may set for itself (`text_field`, `hf_split`, `val_fraction`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str
    weight: float
    # This source's own options (None: the run's): each source is resolved and split on its own.
    text_field: str | None = None
    hf_split: str | None = None
    val_fraction: float | None = Field(None, gt=0.0, lt=1.0)

    def options(self) -> dict[str, Any]:
        """The options this source sets for itself."""
        return {
            k: v for k in ("text_field", "hf_split", "val_fraction") if (v := getattr(self, k)) is not None
        }

    @model_validator(mode="after")
    def _check(self) -> Any:
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise DataError(
                f"weight={self.weight} of source {self.source!r} must be a positive number (weights are "
                "relative: 0.7 and 0.3, or 7 and 3); leave a source out of the list instead of weighting it 0"
            )
        check_source(self.source)
        return self


def _mixture_error(problem: str) -> DataError:
    return DataError(
        f"{problem}; a mixture is data: [{{source: PATH, weight: 0.7}}, {{source: PATH2, weight: 0.3}}] in YAML, "
        """or --data '[{"source": "PATH", "weight": 0.7}, {"source": "PATH2", "weight": 0.3}]'"""
    )


def _mixture_item(item: Any) -> MixtureSource:
    """One item of a mixture, validated here so that its error is the only one (not one per union branch)."""
    if isinstance(item, MixtureSource):
        return item
    if not isinstance(item, dict) or "source" not in item or "weight" not in item:
        raise _mixture_error(f"mixture item {item!r} needs a source and a weight")
    try:
        return MixtureSource.model_validate(item)
    except ValidationError as err:
        cause = err.errors()[0].get("ctx", {}).get("error")
        if isinstance(cause, DataError):
            raise cause from None
        raise _mixture_error(f"mixture item {item!r}: {err.errors()[0]['msg']}") from None


class DataSettings(BaseModel):
    """Which text to train on, and how to hold out validation text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: str | tuple[MixtureSource, ...] | None = Field(
        None,
        description="Corpus: None/'stdlib' = this interpreter's standard library sources; a file, directory "
        "(e.g. of Parquet shards) or glob of .txt .md .py .jsonl[.gz|.zst] .json .parquet; a dataset saved "
        "with datasets' save_to_disk; 'hf:NAME[:CONFIG]'; or a mixture, a JSON list "
        '[{"source": ..., "weight": 0.7}, ...] (each source holds out its own validation documents)',
    )
    val_data: str | None = Field(
        None,
        description="Separate validation corpus, same forms as data (default: a split of data by document)",
    )
    val_fraction: float = Field(
        0.05, gt=0.0, lt=1.0, description="Fraction of documents held out for validation (by their identity)"
    )
    text_field: str = Field("text", description="Text field of JSON/JSONL/Parquet/dataset records")
    hf_split: str = Field("train", description="Split of a Hugging Face dataset (hf:NAME) to train on")
    hf_val_split: str | None = Field(
        None, description="A Hugging Face dataset's split to validate on (default: held-out rows of hf_split)"
    )
    task_runner: Literal["threads", "dask"] = Field(
        "threads",
        description="Where the tokenization map runs: the flow's threads, or a Dask cluster through prefect-dask "
        "(pip install 'llamaflow[dask]'); the dataset is the same",
    )
    dask_address: str | None = Field(
        None,
        description="With task_runner=dask: a running scheduler (tcp://HOST:8786); none: a local cluster",
    )
    dask_workers: int = Field(
        2, ge=1, description="With task_runner=dask and no address: local worker processes"
    )
    streaming: bool = Field(
        False,
        description="Stream a Hugging Face dataset instead of caching it as Arrow (corpora beyond disk)",
    )
    # The data caches' budget (tasks.data.cache_budget).
    cache_max_size: str | None = Field(
        None,
        description="After the data stage, prune the least recently used token entries, packed datasets, "
        "tokenizers and datasets-cache items down to this size (e.g. 50G); never what a live run holds",
    )

    @field_validator("cache_max_size")
    @classmethod
    def _check_cache_max_size(cls, value: str | None) -> str | None:
        if value is not None:
            from tasks.data.cache_budget import parse_size

            try:
                parse_size(value)
            except ValueError as err:
                raise DataError(f"cache_max_size: {err}") from None
        return value

    # -- the split's record and the documents' filters (tasks.data.split, tasks.data.filters) --
    split_from: str | None = Field(
        None,
        description="A split manifest (split_manifest.json of a packed dataset or a run) whose documents keep "
        "their sides; a run with init_from takes its parent's (once validation, always validation)",
    )
    dedup: Literal["exact", "minhash", "off"] = Field(
        "exact",
        description="Drop exact copies of documents (exact), also near copies of whole files by MinHash "
        "(minhash: pip install 'llamaflow[dedup]'), or keep copies (off: a copy of validation text is "
        "still never trained on)",
    )
    near_dup_threshold: float = Field(
        0.8, gt=0.0, lt=1.0, description="With dedup=minhash: the Jaccard similarity of near copies"
    )
    min_chars: int = Field(0, ge=0, description="Drop documents shorter than this many characters")
    max_chars: int | None = Field(None, ge=1, description="Drop documents longer than this many characters")
    doc_filter: str | None = Field(
        None,
        description="A function 'module:function' every document goes through: it returns the text to "
        "keep (changed or not) or None to drop the document",
    )

    @model_validator(mode="after")
    def _check_filters(self) -> Any:
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise DataError(
                f"max_chars={self.max_chars} is below min_chars={self.min_chars}: no document could be kept; "
                "raise max_chars or lower min_chars."
            )
        if self.doc_filter is not None and ":" not in self.doc_filter:
            raise DataError(
                f"doc_filter={self.doc_filter!r} must be 'module:function' (an importable module's function "
                "that takes a document's text and returns its text or None)."
            )
        return self

    @field_validator("data", mode="before")
    @classmethod
    def _parse_mixture(cls, value: Any) -> Any:
        """A mixture given as one string (the command line's --data, a deployment parameter) is JSON."""
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                return json.loads(value)
            except ValueError as err:
                raise _mixture_error(
                    f"data={value!r} starts like a mixture but is not JSON ({err})"
                ) from None
        if isinstance(value, list | tuple):
            if not value:
                raise _mixture_error("data=[] names no source")
            return tuple(_mixture_item(item) for item in value)
        return value

    @model_validator(mode="after")
    def _check_sources(self) -> Any:
        if isinstance(self.data, tuple):
            self._check_mixture()
        for source in (self.data, self.val_data):
            if not isinstance(source, tuple):
                check_source(source)
        if self.hf_val_split is not None and not kind_of(self.data).named_splits:
            raise DataError(
                f"hf_val_split={self.hf_val_split!r} names a split of a Hugging Face dataset, but data="
                f"{self.data!r} is not one: drop hf_val_split (val_fraction or val_data hold out text)"
            )
        return self

    def _check_mixture(self) -> None:
        sources = [item.source for item in self.data]  # type: ignore[union-attr]
        repeated = sorted({s for s in sources if sources.count(s) > 1})
        if repeated:
            raise _mixture_error(f"the mixture lists {repeated} more than once: give each source once")
        if self.val_data is not None or self.hf_val_split is not None:
            raise DataError(
                "a mixture holds out validation documents from each of its sources (val_fraction): drop "
                "val_data / hf_val_split, or add the validation text as a source of its own"
            )

    def sources(self) -> tuple[MixtureSource, ...] | None:
        """The mixture's sources, or None for a single source."""
        return self.data if isinstance(self.data, tuple) else None

    def data_settings(self) -> DataSettings:
        """The data options alone (for a subclass such as PretrainConfig: the object the data stages take)."""
        return DataSettings.model_validate(self.model_dump(include=set(DataSettings.model_fields)))


def as_settings(data: str | DataSettings | dict[str, Any] | None = None, **overrides: Any) -> DataSettings:
    """DataSettings from a source string or settings; keyword overrides that are None are ignored."""
    updates = {key: value for key, value in overrides.items() if value is not None}
    if isinstance(data, dict):  # as a task parameter travels
        data = DataSettings.model_validate(data)
    base = data.data_settings().model_dump() if isinstance(data, DataSettings) else {"data": data}
    try:
        return DataSettings(**{**base, **updates})
    except ValidationError as err:
        first = err.errors()[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, DataError):
            raise cause from None
        where = ".".join(str(part) for part in first["loc"])
        if where == "val_fraction":
            raise DataError(
                f"val_fraction={first['input']} must be between 0 and 1 (exclusive); 0.05 is typical."
            ) from None
        raise DataError(f"{where}={first.get('input')!r}: {first['msg']}") from None
