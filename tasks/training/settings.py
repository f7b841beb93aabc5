"""TrainSettings: the one definition of every training option.

The same typed object goes from the flow's config (`PretrainConfig` is a TrainSettings plus the other
stages' options) to the train task, a train deployment's parameter, the torchrun workers and each
checkpoint (`train_settings.json`). Plain values only, so it travels as JSON.

Every field declares how it bears on resuming a checkpoint (`tasks.training.resume`), by its annotation:
  MustMatch[T]   it changes what the run computes (data order, loss, schedule, updates): a resume with
                 another value than the checkpoint's is refused;
  InRunShape[T]  it decides the global batch or the run length, which a resume compares as such (the
                 batch may be split differently into micro-batches, accumulation and ranks);
  MayChange[T]   how the run is carried out (device, compile, precision, parallelism, checkpointing,
                 logging): a resume may change it.
A field without one is an error when this module is imported, so a new setting cannot be forgotten.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.training.budget import parse_duration


class OnResume(Enum):
    """How a setting bears on a resume (see the module docstring)."""

    MUST_MATCH = "must_match"
    IN_RUN_SHAPE = "in_run_shape"
    MAY_CHANGE = "may_change"


_T = TypeVar("_T")
MustMatch = Annotated[_T, OnResume.MUST_MATCH]
InRunShape = Annotated[_T, OnResume.IN_RUN_SHAPE]
MayChange = Annotated[_T, OnResume.MAY_CHANGE]


class TrainSettings(BaseModel):
    """How to train. Steps are optimizer steps; one step consumes `micro_batch_size * accumulate_steps *
    nproc_per_node * nnodes` packed blocks.

    Length of the run: `max_steps` when it is set; otherwise, with `time_budget`, as many steps as fit in
    the budget on this host (measured before the first update: `tasks.training.budget`); otherwise
    `ceil(epochs * n_blocks / global batch)`.
    Every step holds a whole global batch: an epoch's leftover blocks open the next step.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: InRunShape[int] = Field(8, ge=1, description="Sequences per forward/backward pass")
    accumulate_steps: InRunShape[int] = Field(1, ge=1, description="Micro-batches per optimizer step")
    max_steps: InRunShape[int | None] = Field(
        None, ge=1, description="Optimizer steps; when set, it alone decides the run length"
    )
    epochs: InRunShape[float] = Field(
        1.0, gt=0, description="Passes over the training blocks when max_steps is not set"
    )

    optimizer: MustMatch[Literal["adamw", "muon"]] = Field(
        "adamw",
        description="adamw: AdamW for every parameter; muon: Muon for the 2-D weights inside the decoder "
        "layers, AdamW for embeddings, output head and norms",
    )
    lr: MustMatch[float] = Field(
        3e-4, gt=0, description="Peak AdamW learning rate (the default of every AdamW group)"
    )
    embed_lr: MustMatch[float | None] = Field(
        None, gt=0, description="Peak AdamW LR of the embeddings and a tied output head (default: lr)"
    )
    head_lr: MustMatch[float | None] = Field(
        None, gt=0, description="Peak AdamW LR of an untied output head (default: lr)"
    )
    scalar_lr: MustMatch[float | None] = Field(
        None, gt=0, description="Peak AdamW LR of norm gains (default: lr)"
    )
    muon_lr: MustMatch[float] = Field(0.04, gt=0, description="muon: peak Muon LR of the hidden matrices")
    muon_momentum: MustMatch[float] = Field(0.95, ge=0, lt=1, description="muon: Nesterov momentum")
    muon_ns_steps: MustMatch[int] = Field(5, ge=1, le=99, description="muon: Newton-Schulz iterations")
    muon_weight_decay: MustMatch[float] = Field(
        0.0, ge=0, description="muon: decoupled weight decay (times the LR)"
    )
    muon_adjust_lr: MustMatch[Literal["original", "match_rms_adamw"]] = Field(
        "original",
        description="muon: LR scale per matrix shape: original = sqrt(max(1, rows/cols)); match_rms_adamw = "
        "0.2 sqrt(max(rows, cols)) (Moonshot's, for AdamW-sized LRs)",
    )
    min_lr_ratio: MustMatch[float] = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak")
    warmup_steps: MustMatch[int] = Field(0, ge=0, description="Linear warmup, in optimizer steps")
    schedule: MustMatch[Literal["cosine", "wsd"]] = Field(
        "cosine", description="cosine, or warmup-stable-decay"
    )
    decay_fraction: MustMatch[float] = Field(
        0.2, gt=0, le=1, description="wsd: share of the post-warmup steps that decay"
    )
    weight_decay: MustMatch[float] = Field(0.1, ge=0, description="AdamW weight decay of the matmul weights")
    betas: MustMatch[tuple[float, float]] = Field((0.9, 0.95), description="AdamW betas")
    eps: MustMatch[float] = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: MustMatch[float] = Field(
        1.0, ge=0, description="Max global gradient norm; 0 disables clipping (the norm is logged)"
    )

    seed: MustMatch[int] = Field(1337, description="Seeds data order, initialisation and sampling")
    compile: MayChange[bool] = Field(
        True, description="torch.compile the model (after any checkpoint is loaded)"
    )
    dtype: MayChange[Literal["auto", "bf16", "fp32"]] = Field(
        "auto",
        description="Autocast precision: auto is bf16 where the hardware has it (CUDA from Ampere on, CPUs "
        "with AVX-512 BF16 or AMX) and fp32 elsewhere (an AVX2 CPU emulates bf16, 20-50x slower)",
    )
    document_mask: MustMatch[bool] = Field(
        False,
        description="Attention stays inside each document of a packed block (documents end with EOS)",
    )
    device: MayChange[str] = Field("auto", description="auto, cpu, cuda, cuda:N")
    nproc_per_node: InRunShape[int] = Field(
        1, ge=1, description="Data-parallel processes (torchrun) on this node"
    )
    data_parallel: MayChange[Literal["ddp", "fsdp", "hsdp"]] = Field(
        "ddp",
        description="How data-parallel ranks share the model: ddp (each rank holds the whole model and "
        "optimizer state), fsdp (FSDP2: parameters, gradients and optimizer state sharded per decoder "
        "block over all ranks; checkpoints written by every rank) or hsdp (FSDP2 on a 2-D mesh: sharded "
        "within a group of hsdp_shard_size ranks, one node by default, replicated across the groups; "
        "docs/scaling.md). One process trains the plain module either way",
    )
    hsdp_shard_size: MayChange[int | None] = Field(
        None,
        ge=1,
        description="data_parallel=hsdp: ranks that shard the model among them (default nproc_per_node: one "
        "node); the world size must be a multiple of it. Other modes ignore it",
    )
    fsdp_gradient_sync: MayChange[Literal["every_micro_batch", "last_micro_batch"]] = Field(
        "every_micro_batch",
        description="fsdp with accumulate_steps > 1: every_micro_batch reduce-scatters each micro-batch's "
        "gradients into the sharded ones (each rank keeps 1/ranks of the gradients); last_micro_batch keeps "
        "every block's unsharded fp32 gradient until the step's last micro-batch (one reduce-scatter per step, "
        "4 more bytes per parameter on every rank)",
    )
    activation_checkpointing: MayChange[Literal["none", "full"]] = Field(
        "none",
        description="full: recompute each decoder block's activations in the backward pass (less memory, "
        "about a third more compute)",
    )
    nnodes: InRunShape[int] = Field(
        1,
        ge=1,
        description="Nodes (machines) of the job, each running torchrun with nproc_per_node processes; "
        "checkpoint_dir and the dataset must be on storage every node reads",
    )
    max_restarts: MayChange[int] = Field(
        0,
        ge=0,
        description="Times torchrun restarts the whole worker group after a failed process; each restart "
        "resumes from the newest checkpoint",
    )
    rdzv_endpoint: MayChange[str | None] = Field(
        None,
        description="host:port of the c10d rendezvous when nnodes > 1 (a SLURM head node, a Kubernetes "
        "headless service); unset with placement='deployment': node 0 publishes its own",
    )
    node_rank: MayChange[int] = Field(
        0,
        ge=0,
        description="This node's index in the job when nnodes > 1: node 0 hosts the rendezvous store at "
        "rdzv_endpoint (it must be the machine at that address), the others connect to it. Where global rank "
        "0 runs is torch's choice; with placement='deployment' each node run is given its own",
    )
    rdzv_id: MayChange[str | None] = Field(
        None,
        description="Rendezvous id shared by every node of the job (default: the MLflow run id when the "
        "pretrain flow trains, else an id derived from the checkpoint directory)",
    )
    rdzv_timeout_s: MayChange[int] = Field(
        300,
        ge=1,
        description="How long a rendezvous waits for all nnodes nodes (at the start and after a restart) "
        "before the job fails; also how long the other nodes wait for node 0's rendezvous store to open "
        "(node 0 may still be preparing its data)",
    )
    process_group_timeout_min: MayChange[float] = Field(
        10.0,
        gt=0,
        description="How long a collective waits for a silent peer before the job fails (torch's default "
        "is 30 minutes); must exceed the longest checkpoint write",
    )
    stop_grace_s: MayChange[int] = Field(
        120,
        ge=1,
        description="On a stop (cancellation, Ctrl-C), how long the workers get to finish their step and "
        "checkpoint before they are killed (torchrun's shutdown timeout)",
    )

    checkpoint_every: MayChange[int] = Field(
        0, ge=0, description="Optimizer steps between checkpoints (0 = at the end only)"
    )
    keep_checkpoints: MayChange[int] = Field(
        2, ge=1, description="Newest checkpoints kept in the run directory"
    )
    log_every: MayChange[int] = Field(1, ge=1, description="Optimizer steps between logged metrics")
    eval_every: MayChange[int] = Field(
        0,
        ge=0,
        description="Optimizer steps between validation scores during training, on the first eval_bytes "
        "bytes of the validation text (0 = off); logged as val_subset/bits_per_byte, what a sweep prunes on",
    )
    eval_bytes: MayChange[int] = Field(
        32768,
        ge=1,
        description="eval_every: bytes of validation text scored, the first ones: the same text each time and "
        "for every run on the same data, whatever its tokenizer or seq_len (sweep trials compare on it)",
    )
    max_time_s: MayChange[float | None] = Field(
        None, gt=0, description="Stop (after a checkpoint) once training ran this long"
    )
    # The plan it makes is kept with the checkpoints: a resume continues the planned run whatever this says.
    time_budget: MayChange[str | float | None] = Field(
        None,
        description="Wall-clock budget of the whole run (10m, 1h30m, 90s or seconds): the steps that fit are "
        "measured and planned before the first update, and the schedule is laid over them (ends decayed); "
        "max_steps, when set, wins",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, values: object) -> object:
        if isinstance(values, dict) and "eval_blocks" in values:
            raise ValueError(
                "eval_blocks is gone: the periodic score's text is counted in bytes now, the same for every "
                "tokenizer and seq_len; set eval_bytes instead"
            )
        return values

    @field_validator("time_budget", mode="before")
    @classmethod
    def _seconds(cls, value: object) -> float | None:
        return None if value is None else parse_duration(value)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _check(self) -> TrainSettings:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"rdzv_endpoint must be host:port (e.g. node0.cluster:29500), got {self.rdzv_endpoint!r}"
                )
        self._check_hsdp()
        if self.eval_every % self.log_every:
            raise ValueError(
                f"eval_every={self.eval_every} must be a multiple of log_every={self.log_every}: the scores are "
                "logged with the step's metrics"
            )
        return self

    @property
    def budget_seconds(self) -> float | None:
        """The time budget in seconds when it decides the run length (max_steps unset), else None."""
        return float(self.time_budget) if self.time_budget is not None and self.max_steps is None else None

    def _check_hsdp(self) -> None:
        if self.data_parallel != "hsdp":
            return
        if self.optimizer == "muon":
            raise ValueError(
                "optimizer=muon does not run under data_parallel=hsdp yet (its sharded update gathers rows over a "
                "1-D mesh): use data_parallel=fsdp with muon, or adamw with hsdp"
            )
        shard, world = hsdp_shard_size(self), self.nnodes * self.nproc_per_node
        if world % shard:
            raise ValueError(
                f"data_parallel=hsdp shards over groups of {shard} ranks, which {world} ranks (nnodes "
                f"{self.nnodes} x nproc_per_node {self.nproc_per_node}) do not divide into: set hsdp_shard_size "
                f"to a divisor of {world} (nproc_per_node, one node, is the usual choice)"
            )


def hsdp_shard_size(settings: TrainSettings) -> int:
    """The ranks of one HSDP shard group: `hsdp_shard_size`, by default one node's processes."""
    return settings.hsdp_shard_size or settings.nproc_per_node


def resume_rules(model: type[BaseModel] = TrainSettings) -> dict[str, OnResume]:
    """Each training setting's `OnResume`, by name; raises TypeError naming the fields that declare none."""
    rules: dict[str, OnResume] = {}
    for name, field in model.model_fields.items():
        declared = [m for m in field.metadata if isinstance(m, OnResume)]
        if len(declared) == 1:
            rules[name] = declared[0]
    missing = [name for name in model.model_fields if name not in rules]
    if missing:
        raise TypeError(
            f"{model.__name__} fields {missing} must each declare how they bear on a resume: annotate the type "
            "with exactly one of MustMatch[...], InRunShape[...] or MayChange[...] (tasks/training/settings.py)"
        )
    return rules


RESUME_RULES = resume_rules()  # at import: a field added without its rule fails here, not at some resume
