"""Small typed references that travel between tasks: paths plus content fingerprints.

Nothing large crosses a Prefect task boundary, so caching and retries stay cheap.

A path under the llamaflow home is absolute in memory, but written as `$LLAMAFLOW_HOME/...` whenever a ref
is serialized (a Prefect cache record, a deployment parameter, a result file) and resolved against the
reader's own home when it is read back. A cached ref therefore stays valid after the home moves, and a ref
handed to a worker on another machine names the place in that worker's home.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer

from tasks.home import local, portable

# A location: absolute on this machine once validated, home-relative once serialized.
HomePath = Annotated[str, BeforeValidator(local), PlainSerializer(portable, return_type=str)]


class _Ref(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TokenizerRef(_Ref):
    path: HomePath = Field(description="Path of tokenizer.json")
    fingerprint: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    sha256: str | None = Field(
        None,
        description="Of tokenizer.json's bytes: the same hash is the same tokenizer, however it was made",
    )


class DatasetRef(_Ref):
    path: HomePath = Field(description="Directory holding train.npy, val.npy, meta.json, tokenizer.json")
    fingerprint: str
    seq_len: int
    vocab_size: int
    train_blocks: int
    val_blocks: int
    train_tokens: int
    val_tokens: int
    stats: dict[str, float | int | str] = Field(default_factory=dict)


class ParentRef(_Ref):
    """The model a run starts from (`init_from`), resolved once at the start of the flow: an alias is pinned
    to a version and its model id here, and every later stage and node uses this, never the alias again."""

    source: str = Field(description="init_from as given (models:/NAME@ALIAS, a path, a hub id, ...)")
    kind: Literal["local", "registry", "logged_model", "hf"]
    pinned: str = Field(
        description="What it resolved to: models:/NAME/VERSION, models:/m-ID, hf:ORG/NAME@COMMIT, local:FILE"
    )
    path: HomePath = Field(description="Directory holding config.json and model.safetensors (our layout)")
    weights_sha256: str
    tokenizer_path: HomePath | None = Field(None, description="The tokenizer.json that came with the weights")
    special_tokens: dict[str, str] = Field(
        default_factory=dict, description="bos/eos/pad token names the source declares (HF tokenizer_config)"
    )
    name: str | None = Field(None, description="Registered model name, when the parent is a registry version")
    version: str | None = None
    model_id: str | None = Field(None, description="MLflow logged model id of the parent")
    run_id: str | None = Field(None, description="MLflow run that trained the parent")
    tokens_seen_total: int = Field(
        0, description="Tokens the chain up to and including the parent trained on"
    )
    lineage: tuple[str, ...] = Field(
        (), description="Registered ancestors NAME/VERSION, oldest first, parent last"
    )
    depth: int = Field(1, description="Generations from the root of the chain: the parent's own depth")
    root: str = Field(description="Where the chain began: scratch, or an HF checkpoint (hf:ORG/NAME@COMMIT)")


class ModelRef(_Ref):
    path: HomePath = Field(
        description="Directory holding config.json and model.safetensors (initial weights)"
    )
    fingerprint: str
    n_params: int
    parent: ParentRef | None = Field(None, description="Where the initial weights came from (init_from)")
    optimizer_state: HomePath | None = Field(
        None,
        description="The parent's training checkpoint whose optimizer state a new run starts with (init_optimizer)",
    )


class CheckpointRef(_Ref):
    path: HomePath = Field(
        description="Directory of the final checkpoint (model.safetensors + config.json inside)"
    )
    run_dir: HomePath
    step: int
    tokens_seen: int
    metrics: dict[str, float] = Field(default_factory=dict)
    run_length: str = Field(
        "", description="How many optimizer steps, and whether max_steps or epochs set it"
    )


class CheckpointScore(_Ref):
    """One checkpoint of the run scored on the validation text (the final one and those kept before it)."""

    step: int
    path: HomePath = Field(description="The checkpoint directory (model.safetensors + config.json inside)")
    val_loss: float
    bits_per_byte: float


class EvalResult(_Ref):
    """What evaluation measured on the validation text (`tasks.scoring`): the text's first
    `max_blocks * seq_len` tokens of the dataset's validation split (all of it when None), in `dtype`."""

    val_loss: float = Field(description="Mean loss per scored token (nats)")
    perplexity: float
    bits_per_byte: float = Field(description="Summed loss in bits over the scored text's UTF-8 bytes")
    xz_bits_per_byte: float = Field(description="xz -9e on the same bytes")
    scored_tokens: int
    scored_bytes: int
    text_fingerprint: str = Field(description="Of the scored text: equal fingerprints, same text")
    dataset_fingerprint: str
    max_blocks: int | None
    dtype: str
    initial_val_loss: float | None = None
    initial_bits_per_byte: float | None = None
    samples: tuple[tuple[str, str], ...] = ()
    checkpoints: tuple[CheckpointScore, ...] = Field(
        (), description="Every valid checkpoint left in the run directory, scored the same way, oldest first"
    )


# When a registration moves the alias (tasks.register): only when measured better than the champion; also
# when the champion cannot be compared (its files are gone, it cannot be scored on our text); or always.
Promotion = Literal["if_better", "if_better_or_incomparable", "always"]


class RegisteredModel(_Ref):
    name: str
    version: str
    uri: str
    alias: str
    promoted: bool
    run_id: str
    bits_per_byte: float
    champion_bits_per_byte: float | None = Field(
        None, description="The previous champion's bits per byte on the same validation text, if comparable"
    )
    champion_version: str | None = None
