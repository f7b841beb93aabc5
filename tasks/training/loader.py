"""Deterministic, resumable batches over a packed dataset (`train.npy` of shape (n_blocks, seq_len + 1)).

Order: one permutation of all blocks per epoch, drawn from (seed, epoch); the epochs' permutations follow
one another as one stream. An optimizer step takes the next `micro_batch_size * accumulate_steps *
world_size` blocks of that stream; rank r gets the r-th contiguous share and cuts it into micro-batches.
So the order of examples never depends on how a step is split, and the position (epoch, index), counted
in blocks of all ranks together, is the whole loader state: a checkpoint resumes at another world size.

Every step holds exactly the global batch. The blocks an epoch holds beyond its last full step (n_blocks
mod global batch) are carried into the next step, which the next epoch's first blocks fill up; they are
not a smaller step of their own. Such a step moved the hidden matrices as far as a full one (Muon's
update has the same size whatever the gradient was averaged over) on a gradient of as little as one
block; carrying keeps every block once per epoch and every step alike. Measured against that smaller step,
dropping the leftover, and scaling that step's LR by its share of the batch: benchmarks/epoch_leftover.py
(benchmarks/README.md, "The epoch's leftover").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class LoaderPosition:
    epoch: int = 0
    index: int = 0  # blocks of this epoch's permutation already consumed (by all ranks together)

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


@dataclass
class StepBatch:
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]  # this rank's (inputs, targets), fixed shapes


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
        parts, wanted = [], self.global_batch
        while wanted:  # across an epoch's end (more than one when the batch exceeds the dataset)
            start = self.position.index
            taken = self.permutation(self.position.epoch)[start : start + wanted]
            parts.append(taken)
            wanted -= len(taken)
            self.position.index = start + len(taken)
            if self.position.index == n:
                self.position = LoaderPosition(epoch=self.position.epoch + 1, index=0)
        share = self.micro_batch_size * self.accumulate_steps
        mine = np.concatenate(parts)[self.rank * share : (self.rank + 1) * share]
        micro = [
            self._tensors(mine[i * self.micro_batch_size : (i + 1) * self.micro_batch_size])
            for i in range(self.accumulate_steps)
        ]
        return StepBatch(micro_batches=micro)

    def _tensors(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.asarray(self.blocks[indices], dtype=np.int64)
        # Explicit copies: for a single row both slices are contiguous views of one buffer, and masking the
        # targets would write into the inputs.
        inputs = torch.from_numpy(rows[:, :-1].copy())
        targets = torch.from_numpy(rows[:, 1:].copy())
        targets[targets == self.pad_id] = IGNORE_INDEX
        return self._to_device(inputs), self._to_device(targets)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)
