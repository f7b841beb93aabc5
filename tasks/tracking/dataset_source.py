"""Where a run's dataset came from, as MLflow stores it: the packed split's file relative to the llamaflow
home (`$LLAMAFLOW_HOME/datasets/.../train.npy`) and the dataset fingerprint, never a path of one machine.

MLflow's own sources for a local file store its absolute path; a worker's path means nothing to whoever
reads the run elsewhere, and a `$LLAMAFLOW_HOME/...` path resolves in every home that holds the dataset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlflow.data.dataset_source import DatasetSource
from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE

from tasks import home
from tasks.credentials import redact

TAG_WEIGHT = "llamaflow.weight"


class PackedSplitSource(DatasetSource):
    """A split of a llamaflow packed dataset (`source_type` "llamaflow")."""

    def __init__(self, path: str, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint

    @classmethod
    def of(cls, file: str | Path, fingerprint: str) -> PackedSplitSource:
        stored = home.portable(file)
        if Path(stored).is_absolute():  # outside the home: only what names it, not where it is here
            stored = f"{Path(stored).parent.name}/{Path(stored).name}"
        return cls(stored, fingerprint)

    @staticmethod
    def _get_source_type() -> str:
        return "llamaflow"

    def load(self, **kwargs: Any) -> str:
        """The split's file on this machine (under this machine's home)."""
        return home.local(self.path)

    @staticmethod
    def _can_resolve(raw_source: Any) -> bool:
        return False

    @classmethod
    def _resolve(cls, raw_source: Any) -> PackedSplitSource:
        raise NotImplementedError("a llamaflow dataset source is made with PackedSplitSource.of()")

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, source_dict: dict[str, Any]) -> PackedSplitSource:
        return cls(source_dict["path"], source_dict["fingerprint"])


def mixture_inputs(dataset_dir: Path, mixture: list[dict[str, Any]]) -> list[DatasetInput]:
    """One `training` input per source of a mixture (`meta.json`'s "mixture"): named by the source as the
    config gave it, its digest the source's train-split fingerprint, its weight a tag of the input and, with
    its token and block counts, the dataset's profile."""
    inputs = []
    for item in mixture:
        source = PackedSplitSource.of(dataset_dir / "train.npy", item["fingerprint"])
        keys = ("weight", "stream_tokens", "blocks", "epochs", "val_stream_tokens", "val_blocks")
        profile = {
            key: item[key] for key in keys if key in item
        }  # epochs: since the mixture drew across sources
        entity = Dataset(
            name=f"{dataset_dir.name}/{redact(item['source'])}",
            digest=item["fingerprint"][:MAX_DATASET_DIGEST_SIZE],
            source_type=source._get_source_type(),
            source=json.dumps(source.to_dict()),
            profile=json.dumps(profile),
        )
        tags = [InputTag("mlflow.data.context", "training"), InputTag(TAG_WEIGHT, repr(item["weight"]))]
        inputs.append(DatasetInput(entity, tags=tags))
    return inputs
