"""How the ranks share the model: this module alone decides none | DDP | FSDP2 | HSDP, applies it, and hands the
loop a `Parallel` whose methods hide the difference (gradient sync, the reduction's divisor, clipping, the
whole state dict). The loop never asks which.

  none  no process group (one process): the plain module.
  ddp   every rank holds the whole model and optimizer state; gradients are all-reduced (DDP averages)
        once per optimizer step.
  fsdp  FSDP2 as torchtitan applies it: the model built on the meta device, `fully_shard` on each decoder
        block then the root, materialised shard by shard; every rank reads only its own shards of the
        initial weights (DCP's safetensors reader), before compilation. Parameters, gradients and optimizer
        state are sharded; gradients are reduce-scattered as plain SUMS after every micro-batch (once per
        optimizer step with `fsdp_gradient_sync: last_micro_batch`; the loop divides by the global token count: no AVG reduction, which gloo has been reported to get wrong
        under FSDP2, pytorch issue 162338). On CUDA with bf16, `MixedPrecisionPolicy` gathers bf16
        parameters and reduces in fp32.
  hsdp  FSDP2 on a 2-D mesh (replicate x shard): each group of `hsdp_shard_size` ranks (one node by
        default) shards the model as fsdp does, and the groups hold replicas. A block's all-gather and
        reduce-scatter stay within the group (the node's links); the shards' gradients are all-reduced
        across the groups (SUM) once per optimizer step (`set_requires_all_reduce` on the last micro-batch
        only). Checkpoints are fsdp's: DCP writes each slice once (replicas deduplicated).

Sequence: build (meta under fsdp) -> load the weights into the (sharded) plain module -> activation
checkpointing per block -> DDP or fully_shard -> compile. The optimizer is built afterwards, from the
parameters of the result (`Parallel.plain`): under FSDP2 those are new DTensor parameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from model import LlamaConfig, LlamaForPretraining, load_pretrained
from model.weights import WEIGHTS_FILE, check_fit, has_tied_head, stored_shapes
from tasks.training.checkpoint_weights import SHARDS_DIR, whole_shapes
from tasks.training.errors import TrainingInputError
from tasks.training.loss import LossHead
from tasks.training.precision import BF16_FSDP_PARAMS, precision_recipe
from tasks.training.settings import TrainSettings, hsdp_shard_size

Mode = Literal["none", "ddp", "fsdp", "hsdp"]
SHARDED: tuple[Mode, ...] = ("fsdp", "hsdp")  # FSDP2 holds the parameters as DTensor shards


def parallel_mode(settings: TrainSettings) -> Mode:
    """`settings.data_parallel` when this process is a rank of a process group (torchrun), else none."""
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    return settings.data_parallel


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of the decoder stack, through any wrapper: the members of every nn.ModuleList
    in `model` except embedding tables (the value-embedding tables are a ModuleList too)."""
    return [
        block
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for block in module
        if not isinstance(block, nn.Embedding)
    ]


@dataclass(eq=False)
class Parallel:
    mode: Mode
    model: nn.Module  # (inputs, targets) -> summed token loss: LossHead, wrapped and/or compiled
    plain: nn.Module  # the original module: names, parameters (this rank's DTensor shards under fsdp)
    world_size: int
    ddp: DistributedDataParallel | None = None
    fsdp_sync_every_micro_batch: bool = True

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 DTensor shards (fsdp, hsdp)."""
        return self.mode in SHARDED

    @property
    def gradient_divisor(self) -> int:
        """What the gradient reduction divides the rank sum by: DDP averages, FSDP2 here sums."""
        return self.world_size if self.mode == "ddp" else 1

    @contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Forward and backward of one micro-batch. DDP all-reduces after the last one of an optimizer step
        only (no_sync before). FSDP2 reduce-scatters every micro-batch's gradients and adds them to the
        sharded ones by default; with `fsdp_gradient_sync: last_micro_batch` it keeps the unsharded
        gradients until the last (set_requires_gradient_sync). HSDP all-reduces across the replicas on the
        last micro-batch only: the reduce-scattered shards accumulate in between (set_requires_all_reduce)."""
        if self.sharded:
            assert isinstance(self.plain, FSDPModule)
            self.plain.set_requires_gradient_sync(last or self.fsdp_sync_every_micro_batch)
            if self.mode == "hsdp":
                self.plain.set_requires_all_reduce(last)
        sync = self.ddp.no_sync() if self.ddp is not None and not last else nullcontext()
        with sync:
            yield

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to `max_norm` (inf: measure only) by the global norm; under FSDP2 the per-shard norms are
        combined over ranks (a DTensor reduction) before clipping."""
        params = [p for p in self.plain.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original module's whole state dict, on the main rank (a collective under fsdp: every rank
        calls it; the others get {}). Gathered one tensor at a time into CPU memory."""
        if not self.sharded:
            return self.plain.state_dict()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.plain, options=options)


def parallelize(
    config: LlamaConfig,
    weights: Path,
    settings: TrainSettings,
    device: torch.device,
    *,
    eos_id: int | None,
) -> Parallel:
    """The model holding `weights` (a directory with model.safetensors), shared over the ranks as
    `parallel_mode` says, activation-checkpointed and compiled as `settings` say."""
    mode = parallel_mode(settings)
    world = dist.get_world_size() if mode != "none" else 1
    if mode in SHARDED:
        plain: nn.Module = _sharded_model(
            config, weights, settings, device, _mesh_shape(settings, mode, world)
        )
    else:
        plain = _plain_model(config, weights, device)
        if settings.activation_checkpointing == "full":
            _checkpoint_blocks(plain)
    plain.train()
    model: nn.Module = LossHead(plain, eos_id=eos_id)
    ddp = None
    if mode == "ddp":
        model = ddp = _wrap_ddp(model, device)
    if settings.compile:
        # The whole LossHead, under FSDP2 too, rather than each decoder block (torchtitan's choice): on this
        # CPU the whole model stepped 435 tokens/s against 385 and compiled in 61 s against 175
        # (benchmarks/results/fsdp_compile.json, docs/scaling.md). Re-measure on GPUs (benchmarks/gpu_check.py).
        # DDP first, then compile: DDPOptimizer splits the graph at bucket boundaries, so each bucket's
        # all-reduce overlaps the rest of the backward pass.
        model = torch.compile(model, dynamic=False)
    every = settings.fsdp_gradient_sync == "every_micro_batch"
    return Parallel(
        mode=mode, model=model, plain=plain, world_size=world, ddp=ddp, fsdp_sync_every_micro_batch=every
    )


def _wrap_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    device_ids = [device.index] if device.type == "cuda" else None
    with warnings.catch_warnings():
        # torch 2.13 deprecates broadcast_buffers but says to keep it False until its replacement can skip
        # the sync at init. The only buffers are the RoPE tables, derived from the config on every rank.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def _checkpoint_blocks(model: nn.Module) -> None:
    """Recompute each decoder block's activations in the backward pass instead of keeping them. The
    wrapper's name never reaches a state dict (its hooks strip it). The model draws no random numbers,
    so the RNG state need not be replayed."""
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for i, block in enumerate(module):
                if not isinstance(block, nn.Embedding):
                    module[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def _mesh_shape(settings: TrainSettings, mode: Mode, world: int) -> tuple[int, ...]:
    """fsdp: one dimension of all ranks; hsdp: (replica groups, ranks per shard group)."""
    if mode == "fsdp":
        return (world,)
    shard = hsdp_shard_size(settings)
    if world % shard:  # settings check nnodes x nproc_per_node; this is torchrun's actual world
        raise TrainingInputError(
            f"data_parallel=hsdp: {world} ranks do not divide into shard groups of {shard}: set hsdp_shard_size "
            f"to a divisor of {world}"
        )
    return (world // shard, shard)


def _sharded_model(
    config: LlamaConfig, weights: Path, settings: TrainSettings, device: torch.device, shape: tuple[int, ...]
) -> nn.Module:
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    if settings.activation_checkpointing == "full":
        _checkpoint_blocks(model)
    # A 2-D mesh makes fully_shard replicate over dimension 0 and shard over dimension 1 (HSDP).
    names = ("replicate", "shard")[-len(shape) :]
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    if precision_recipe("fsdp", device.type, settings.dtype) == BF16_FSDP_PARAMS:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, never average: divide factor 1 and SUM collectives (no AVG or PREMUL_SUM ops).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(
        device=device
    )  # this rank's shards only; the RoPE tables are rebuilt (LlamaForPretraining)
    load_checkpoint_weights(model, weights)
    return model


def _plain_model(config: LlamaConfig, weights: Path, device: torch.device) -> nn.Module:
    """The whole model holding `weights`: model.safetensors, or a sharded checkpoint's slices."""
    if not (Path(weights) / SHARDS_DIR).is_dir():
        return load_pretrained(config, weights, device=device)
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    model.to_empty(device=device)
    load_checkpoint_weights(model, weights)
    return model


def load_checkpoint_weights(model: nn.Module, directory: Path) -> None:
    """Fill a module, sharded or whole, from `directory`: a sharded checkpoint's slices (`model_shards/`,
    at any world size: DCP places every saved slice where this rank's parameters need it), else its
    model.safetensors. Under FSDP2 each rank reads only the parts of its own shards, so the whole model
    never sits in one rank's memory. A collective where a process group is up: every rank calls it."""
    source = Path(directory) / SHARDS_DIR
    if source.is_dir():
        shapes, where = whole_shapes(source), str(source)
    else:
        source = Path(directory)
        shapes, where = stored_shapes(source / WEIGHTS_FILE), str(source / WEIGHTS_FILE)
    state = get_model_state_dict(model)
    tied = has_tied_head(model)
    if tied:
        del state["lm_head.weight"]  # stored once, as the embedding
    check_fit({k: t.shape for k, t in state.items()}, shapes, source=where)
    # The reader takes every *.safetensors directly in `source`: the optimizer's shards live in a
    # subdirectory of the checkpoint.
    with warnings.catch_warnings():
        # One process (no process group) reads every slice itself, which is what is meant here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(source)))
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    set_model_state_dict(model, state)
