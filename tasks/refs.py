"""Small typed references that travel between tasks: paths plus content fingerprints.

Nothing large crosses a Prefect task boundary, so caching and retries stay cheap.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Ref(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TokenizerRef(_Ref):
    path: str = Field(description="Absolute path of tokenizer.json")
    fingerprint: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int


class DatasetRef(_Ref):
    path: str = Field(description="Directory holding train.npy, val.npy, meta.json, tokenizer.json")
    fingerprint: str
    seq_len: int
    vocab_size: int
    train_blocks: int
    val_blocks: int
    train_tokens: int
    val_tokens: int
    stats: dict[str, float | int | str] = Field(default_factory=dict)


class ModelRef(_Ref):
    path: str = Field(description="Directory holding config.json and model.safetensors (initial weights)")
    fingerprint: str
    n_params: int


class CheckpointRef(_Ref):
    path: str = Field(
        description="Directory of the final checkpoint (model.safetensors + config.json inside)"
    )
    run_dir: str
    step: int
    tokens_seen: int
    metrics: dict[str, float] = Field(default_factory=dict)
    run_length: str = Field(
        "", description="How many optimizer steps, and whether max_steps or epochs set it"
    )


class EvalResult(_Ref):
    val_loss: float
    perplexity: float
    initial_val_loss: float | None = None
    samples: tuple[tuple[str, str], ...] = ()


class RegisteredModel(_Ref):
    name: str
    version: str
    uri: str
    alias: str
    promoted: bool
    run_id: str
    champion_val_loss: float | None = None
