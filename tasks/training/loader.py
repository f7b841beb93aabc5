"""Deterministic, resumable batches over a packed dataset (`train.npy` of shape (n_blocks, seq_len + 1)).

Order: one permutation of all blocks per epoch, drawn from (seed, epoch). An optimizer step takes the next
`micro_batch_size * accumulate_steps * world_size` blocks of it; rank r gets the r-th contiguous share and
cuts it into micro-batches. So the order of examples never depends on how a step is split, and the
position (epoch, index) is the whole loader state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100
_EMPTY = -1  # slot of a micro-batch that no block fills (the last step of an epoch)


@dataclass
class LoaderPosition:
    epoch: int = 0
    index: int = 0  # blocks of this epoch's permutation already consumed (by all ranks together)

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


@dataclass
class StepBatch:
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]  # this rank's (inputs, targets), fixed shapes
    n_blocks: int  # real blocks in the whole step, all ranks


class BlockLoader:
    def __init__(
        self,
        blocks: np.ndarray,
        *,
        pad_id: int,
        micro_batch_size: int,
        accumulate_steps: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        if len(blocks) == 0:
            raise ValueError("the training split holds no blocks; build the dataset from more text")
        self.blocks = blocks
        self.pad_id = pad_id
        self.micro_batch_size = micro_batch_size
        self.accumulate_steps = accumulate_steps
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.position = LoaderPosition()
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.accumulate_steps * self.world_size

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def state_dict(self) -> dict[str, int]:
        return {**self.position.to_dict(), "seed": self.seed, "n_blocks": len(self.blocks)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed or state["n_blocks"] != len(self.blocks):
            raise ValueError(
                f"checkpoint loader state (seed {state['seed']}, {state['n_blocks']} blocks) does not match this "
                f"run (seed {self.seed}, {len(self.blocks)} blocks): resume with the same dataset and seed, or "
                "use a new checkpoint_dir"
            )
        self.position = LoaderPosition(epoch=state["epoch"], index=state["index"])

    def next_step(self) -> StepBatch:
        """The next optimizer step's micro-batches for this rank; advances the position."""
        n = len(self.blocks)
        start = self.position.index
        taken = self.permutation(self.position.epoch)[start : start + self.global_batch]
        # The leftover at an epoch's end becomes fewer micro-batches of the same shape; the last one is
        # topped up with empty rows whose targets are all ignored.
        per_rank_micro = -(-len(taken) // (self.micro_batch_size * self.world_size))
        slots = np.full(per_rank_micro * self.micro_batch_size * self.world_size, _EMPTY, dtype=np.int64)
        slots[: len(taken)] = taken
        share = per_rank_micro * self.micro_batch_size
        mine = slots[self.rank * share : (self.rank + 1) * share]
        micro = [
            self._tensors(mine[i * self.micro_batch_size : (i + 1) * self.micro_batch_size])
            for i in range(per_rank_micro)
        ]
        self.position.index = start + len(taken)
        if self.position.index >= n:
            self.position = LoaderPosition(epoch=self.position.epoch + 1, index=0)
        return StepBatch(micro_batches=micro, n_blocks=len(taken))

    def _tensors(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.full((len(indices), self.blocks.shape[1]), self.pad_id, dtype=np.int64)
        real = indices != _EMPTY
        if real.any():
            rows[real] = self.blocks[indices[real]]
        # Explicit copies: for a single row both slices are contiguous views of one buffer, and masking the
        # targets would write into the inputs.
        inputs = torch.from_numpy(rows[:, :-1].copy())
        targets = torch.from_numpy(rows[:, 1:].copy())
        targets[targets == self.pad_id] = IGNORE_INDEX
        targets[torch.from_numpy(~real)] = IGNORE_INDEX
        return self._to_device(inputs), self._to_device(targets)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)
