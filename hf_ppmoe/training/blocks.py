"""The training loop's data: an object that hands each data-parallel process its batches.

The loop asks only this (see `train.py`):

    data.batch(step, micro) -> dict     model inputs of this process for (optimizer step, micro-step), on the CPU
    data.validation_batches() -> list   this process's validation batches
    data.state_dict() / load_state_dict(state)   the data position a checkpoint keeps ({} when the order is a pure
                                        function of the seed and the step)
    data.fingerprint                    what decides the batches (recorded in every checkpoint: a resume on other
                                        data is refused)

`PackedBlocks` serves causal-LM blocks held as one `[N, block_size]` tensor.
"""

from __future__ import annotations

import hashlib

import torch


def batch_rows(step: int, micro: int, process: int, world: int, batch_size: int, accumulation: int, seed: int,
               n_blocks: int) -> torch.Tensor:
    """Rows of `n_blocks` for (optimizer step, micro-step, data-parallel process): the global batch of step s is the
    s-th slice of per-epoch seeded permutations, cut into micro-batches and processes. A pure function of its
    arguments, so a resumed run reads exactly what an uninterrupted one would."""
    b = batch_size
    start = (step * accumulation + micro) * world * b + process * b
    positions = torch.arange(start, start + b)
    epochs, offsets = positions // n_blocks, positions % n_blocks
    rows = torch.empty(b, dtype=torch.long)
    for epoch in range(start // n_blocks, (start + b - 1) // n_blocks + 1):  # the epochs these b positions span
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        rows[epochs == epoch] = perm[offsets[epochs == epoch]]
    return rows


class PackedBlocks:
    """Causal-LM batches from packed blocks in memory (`labels` = `input_ids`: the model shifts them)."""

    def __init__(self, train: torch.Tensor, validation: torch.Tensor, args, rank: int, world: int):
        self.train, self.validation = train, validation
        self.args, self.rank, self.world = args, rank, world
        self.num_blocks = len(train)
        self.fingerprint = hashlib.sha256(train.contiguous().numpy().tobytes()).hexdigest()

    def rows(self, step: int, micro: int) -> torch.Tensor:
        a = self.args
        return batch_rows(step, micro, self.rank, self.world, a.per_device_train_batch_size,
                          a.gradient_accumulation_steps, a.seed, self.num_blocks)

    def batch(self, step: int, micro: int) -> dict:
        ids = self.train[self.rows(step, micro)]
        return {"input_ids": ids, "labels": ids}

    def validation_batches(self) -> list[dict]:
        b = self.args.per_device_train_batch_size
        starts = list(range(0, len(self.validation), b))
        if self.args.eval_batches:
            starts = starts[: self.args.eval_batches]
        return [{"input_ids": self.validation[i : i + b], "labels": self.validation[i : i + b]}
                for i in starts[self.rank :: self.world]]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
