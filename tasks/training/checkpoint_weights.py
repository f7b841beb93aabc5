"""A sharded model's weights in a checkpoint without gathering them into one process.

Every rank writes its own slices of the state dict through DCP's safetensors format (`model_shards/`, each
file's header holding its slices' offsets): that is all a checkpoint holds of a sharded model, and a resume
at any world size reads it directly (`parallelize.load_checkpoint_weights`). Where a whole model is needed
(evaluation, registration, export), `whole_weights` consolidates the slices once into the checkpoint's
`model.safetensors`, streamed one tensor at a time: each slice read with a plain file read into its place in
that tensor's bytes, then the tensor written out, so the peak host memory is about the largest tensor, never
the whole model (measured: benchmarks/consolidate_memory.py). The file is what `save_weights` writes for the
whole module: the same names (a tied head once), dtypes, shapes and metadata.

By hand: `python -m tasks.training.consolidate CHECKPOINT_DIR`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from model.atomic import atomic_file
from model.weights import CONFIG_FILE, SHARDS_DIR, WEIGHTS_FILE, has_tied_head

# How DCP's safetensors writer records where each slice sits in its whole tensor (file metadata, JSON).
_DCP_SHARDING = "DCP_SHARDING_INFO"
_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def save_model_shards(directory: Path, model: nn.Module) -> None:
    """Every rank writes its slices of `model`'s state dict (a tied head once) under `directory`. A
    collective: every rank of the process group calls it."""
    state = get_model_state_dict(model)
    if has_tied_head(model):
        state.pop("lm_head.weight", None)  # stored once, as the embedding
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))


@dataclass(frozen=True)
class _Slice:
    file: Path
    start: int  # byte offset of the slice's data in `file`
    shape: tuple[int, ...]
    offsets: tuple[int, ...]  # where the slice begins in the whole tensor, per dimension


def _header(file: Path) -> tuple[dict, int]:
    """A safetensors file's header and the byte offset where its data begins."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def _slices(shards: Path) -> tuple[dict[str, list[_Slice]], dict[str, tuple[str, list[int]]]]:
    """Every tensor's slices, and its dtype and whole shape, from the shard files' headers."""
    slices: dict[str, list[_Slice]] = {}
    whole: dict[str, tuple[str, list[int]]] = {}
    files = sorted(shards.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no safetensors shards in {shards}: the checkpoint's model shards are missing"
        )
    for file in files:
        header, data = _header(file)
        sharding = json.loads(header.get("__metadata__", {}).get(_DCP_SHARDING, "{}"))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name not in sharding:
                raise ValueError(f"{file} holds {name} without DCP's slice offsets: not a DCP shard file")
            shape, offsets = tuple(info["shape"]), tuple(sharding[name]["saved_offsets"])
            slices.setdefault(name, []).append(_Slice(file, data + info["data_offsets"][0], shape, offsets))
            dtype, size = whole.setdefault(name, (info["dtype"], [0] * len(shape)))
            whole[name] = (dtype, [max(n, s + o) for n, s, o in zip(size, shape, offsets, strict=True)])
    return slices, whole


def whole_shapes(shards: Path) -> dict[str, torch.Size]:
    """Every tensor's whole shape, from the headers of the shard files under `shards`."""
    return {name: torch.Size(shape) for name, (_, shape) in _slices(shards)[1].items()}


def whole_weights(checkpoint: Path) -> Path:
    """`checkpoint/model.safetensors`, consolidated from the checkpoint's `model_shards/` the first time a
    whole model is needed (the file of a checkpoint that holds one, or no shards, is returned as it is).
    One process; the file appears atomically, so concurrent callers write the same bytes twice at worst."""
    checkpoint = Path(checkpoint)
    out = checkpoint / WEIGHTS_FILE
    if out.is_file() or not (checkpoint / SHARDS_DIR).is_dir():
        return out
    # The metadata save_weights gives a module of this config (model.weights.weights_metadata).
    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    return consolidate_weights(checkpoint / SHARDS_DIR, out, {"format": "pt", "config": json.dumps(config)})


def _byte_view(flat: torch.Tensor, shape: tuple[int, ...] | list[int], itemsize: int) -> torch.Tensor:
    """`flat` uint8 bytes seen as `shape` with the last dimension in bytes (any dtype, copied as bytes)."""
    return flat.view(*shape[:-1], shape[-1] * itemsize) if shape else flat


def _region(part: _Slice, itemsize: int) -> tuple[slice, ...]:
    """Where `part` lies in its whole tensor's byte view (`_byte_view`: the last dimension in bytes)."""
    *rows, last = (slice(o, o + s) for o, s in zip(part.offsets, part.shape, strict=True))
    return (*rows, slice(last.start * itemsize, last.stop * itemsize))


def consolidate_weights(shards: Path, out: Path, metadata: dict[str, str]) -> Path:
    """Write `out` (safetensors, atomically) holding every tensor of the DCP shards under `shards` whole,
    streaming one tensor at a time. Raises ValueError when the slices do not cover a tensor exactly."""
    slices, whole = _slices(shards)
    layout: dict[str, dict] = {}
    position = 0
    for name in sorted(whole):
        dtype, shape = whole[name]
        size = math.prod(shape) * _BYTES[dtype]
        layout[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + size]}
        position += size
    header = json.dumps({"__metadata__": metadata, **layout}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with atomic_file(out) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name, entry in layout.items():
            f.write(_whole_tensor(name, slices[name], entry["shape"], _BYTES[entry["dtype"]]).numpy())
    return out


def _whole_tensor(name: str, parts: list[_Slice], shape: list[int], itemsize: int) -> torch.Tensor:
    """The bytes of tensor `name` assembled from its slices, each read in place."""
    flat = torch.empty(math.prod(shape) * itemsize, dtype=torch.uint8)
    target = _byte_view(flat, shape, itemsize)
    covered = 0
    for part in parts:
        size = math.prod(part.shape) * itemsize
        region = target[_region(part, itemsize)] if shape else target
        if not region.is_contiguous():  # FSDP2 shards rows (dimension 0): a slice is whole rows
            raise ValueError(
                f"{part.file}: a slice of {name} that is not whole rows (offsets {part.offsets})"
            )
        with open(part.file, "rb") as f:
            f.seek(part.start)
            if f.readinto(region.view(-1).numpy()) != size:
                raise ValueError(f"{part.file} ends inside the data of {name}: the shard is truncated")
        covered += size
    if covered != flat.numel():
        raise ValueError(f"the slices of {name} cover {covered} of its {flat.numel()} bytes: shards missing")
    return flat
