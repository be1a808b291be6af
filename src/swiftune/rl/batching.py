"""The data side of a GRPO generation: which prompt rows each generation takes, on which process.

Moved out of :mod:`swiftune.rl.trainer` to keep it short; the trainer imports these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..data import load_rows


class GenerationBatchSampler(torch.utils.data.Sampler):
    """Yields this process's prompt indices for a generation, each batch ``repeats`` times in a row.

    The Trainer draws one batch per micro-step; the trainer uses the batch of the micro-step that
    starts a generation and ignores the repeats, so the data advance one generation at a time.
    Every process sees different prompts (rank ``r`` takes the ``r``-th slice of each global batch).
    """

    def __init__(self, num_rows: int, prompts_per_batch: int, repeats: int, *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        self.num_rows, self.per_batch, self.repeats = num_rows, prompts_per_batch, repeats
        self.seed, self.shuffle, self.rank, self.world = seed, shuffle, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.num_rows // (self.per_batch * self.world)) * self.repeats

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=g).tolist()
        else:
            order = list(range(self.num_rows))
        global_batch = self.per_batch * self.world
        for b in range(self.num_rows // global_batch):
            chunk = order[b * global_batch:(b + 1) * global_batch]
            mine = chunk[self.rank * self.per_batch:(self.rank + 1) * self.per_batch]
            for _ in range(self.repeats):
                yield mine


class EpochLoader(torch.utils.data.DataLoader):
    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def prompt_rows_of(data: Any, what: str) -> Sequence[Any]:
    rows = load_rows(data)
    if len(rows) == 0 or "prompt" not in rows[0]:
        raise ValueError(f"{what} rows need a 'prompt' column (a string or a list of messages)")
    return rows


def collate_prompt_rows(rows: list) -> dict[str, list]:
    return {"prompt_rows": list(rows)}


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in prompt)


def as_int_list(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple, set)) else [int(x)]
