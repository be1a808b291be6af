"""Bin packing of examples into rows, token-budget batching, and ``cu_seqlens`` from positions.

Best-fit decreasing (BFD)
-------------------------
Examples are taken longest first; each goes into the open row whose free space is the smallest
that still fits it, and opens a new row when none fits. BFD uses at most 11/9 OPT + 6/9 rows
(Dósa 2007); with many examples much shorter than a row, the rows come out nearly full.

Complexity: sorting is O(n log n). Free spaces are integers in ``[0, max_length]``, so rows are
kept in buckets by free space, with a sorted list of the distinct free spaces that have a row;
"smallest free space >= length" is one ``bisect`` (O(log max_length)), and inserting/removing a
distinct free space moves at most ``max_length`` list slots (one memmove). Total
O(n log n + n log max_length), so packing a whole dataset up front is cheap next to tokenizing it.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence

import torch


def _check_lengths(lengths: Sequence[int], max_length: int, what: str) -> None:
    if max_length < 1:
        raise ValueError(f"{what} must be >= 1, got {max_length}")
    for index, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"example {index} has length {length}; every example needs >= 1 token")
        if length > max_length:
            raise ValueError(
                f"example {index} has {length} tokens, more than {what}={max_length}; truncate "
                f"examples to at most {what} (prepare_dataset(max_length=...)) or raise {what}"
            )


def pack_best_fit(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Pack example indices into rows of at most ``max_length`` tokens, best-fit decreasing.

    Returns one list of example indices per row; every index appears exactly once. Within a row
    indices are in the order they were placed (longest first). Deterministic: equal lengths are
    placed in index order. Raises ``ValueError`` if an example is longer than ``max_length``.
    """
    lengths = [int(n) for n in lengths]
    _check_lengths(lengths, max_length, "max_length")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties by index
    bins: list[list[int]] = []
    rows_by_free_space: dict[int, list[int]] = {}  # free space -> ids of rows with exactly that
    free_spaces: list[int] = []  # sorted distinct keys of rows_by_free_space
    for index in order:
        length = lengths[index]
        slot = bisect.bisect_left(free_spaces, length)
        if slot < len(free_spaces):
            free = free_spaces[slot]
            rows = rows_by_free_space[free]
            row = rows.pop()
            if not rows:
                del rows_by_free_space[free]
                del free_spaces[slot]
        else:
            row, free = len(bins), max_length
            bins.append([])
        bins[row].append(index)
        free -= length
        if free > 0:  # a full row can take nothing more: keep it out of the search
            if free not in rows_by_free_space:
                rows_by_free_space[free] = []
                bisect.insort(free_spaces, free)
            rows_by_free_space[free].append(row)
    return bins


def packing_efficiency(bins: Sequence[Sequence[int]], lengths: Sequence[int], max_length: int) -> float:
    """Share of the ``len(bins) * max_length`` token slots that hold real tokens (1.0 = no waste)."""
    if not bins:
        return 1.0
    used = sum(int(lengths[i]) for row in bins for i in row)
    return used / (len(bins) * max_length)


def batch_by_token_budget(
    lengths: Sequence[int], max_tokens: int, max_examples: int | None = None
) -> list[list[int]]:
    """Split example indices, in the given order, into batches of at most ``max_tokens`` tokens.

    Greedy: a batch is closed when the next example would exceed the budget (or
    ``max_examples``). The cost of a batch is the sum of its lengths, which is exactly the row
    length of a padding-free batch. Order is kept so that a shuffled order stays shuffled.
    """
    lengths = [int(n) for n in lengths]
    _check_lengths(lengths, max_tokens, "max_tokens")
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for index, length in enumerate(lengths):
        full = max_examples is not None and len(current) >= max_examples
        if current and (tokens + length > max_tokens or full):
            batches.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += length
    if current:
        batches.append(current)
    return batches


class TokenBudgetBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batch sampler for a ``DataLoader``: shuffled batches of at most ``max_tokens`` tokens.

    Each epoch shuffles the example order with ``seed + epoch`` (call :meth:`set_epoch`; the
    transformers Trainer does) and then cuts it with :func:`batch_by_token_budget`.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        max_examples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ):
        self.lengths = [int(n) for n in lengths]
        _check_lengths(self.lengths, max_tokens, "max_tokens")
        self.max_tokens, self.max_examples = max_tokens, max_examples
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        cut = batch_by_token_budget([self.lengths[i] for i in order], self.max_tokens, self.max_examples)
        return [[order[i] for i in batch] for batch in cut]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def pack_dataset(examples: Sequence[dict], max_length: int) -> list[dict[str, list[int]]]:
    """Pack tokenized examples into rows once, for the whole dataset (best-fit decreasing).

    Each returned row is ``{"input_ids", "completion_mask", "seq_lengths"}``: the concatenated
    examples and their lengths, which the collators turn into restarting ``position_ids``.
    Packing the whole dataset fills rows far better than packing each batch on its own.
    """
    lengths = [len(e["input_ids"]) for e in examples]
    rows = []
    for row in pack_best_fit(lengths, max_length):
        input_ids: list[int] = []
        completion_mask: list[int] = []
        for i in row:
            input_ids.extend(examples[i]["input_ids"])
            completion_mask.extend(examples[i].get("completion_mask") or [1] * lengths[i])
        rows.append({
            "input_ids": input_ids,
            "completion_mask": completion_mask,
            "seq_lengths": [lengths[i] for i in row],
        })
    return rows


def position_ids_from_seq_lengths(seq_lengths: Sequence[int]) -> torch.Tensor:
    """``[0..n0-1, 0..n1-1, ...]`` as int64: positions that restart at every example."""
    lengths = torch.as_tensor(list(seq_lengths), dtype=torch.long)
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total) - torch.repeat_interleave(starts, lengths)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sequence lengths of the documents in ``position_ids`` ([T] or [B, T]).

    A document starts wherever the position is 0, and at the start of every row. Rows are
    flattened in order, matching a flattened ``[B*T]`` token axis. Returns
    ``(cu_seqlens int32 [num_docs + 1] on position_ids' device, max_seqlen as a Python int)``,
    the arguments of variable-length attention kernels. ``max_seqlen`` costs one device sync.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    rows, width = position_ids.shape
    if rows * width == 0:
        return torch.zeros(1, dtype=torch.int32, device=position_ids.device), 0
    starts = position_ids == 0
    starts[:, 0] = True
    flat_starts = torch.nonzero(starts.reshape(-1), as_tuple=True)[0]
    total = torch.tensor([rows * width], device=position_ids.device, dtype=flat_starts.dtype)
    cu_seqlens = torch.cat([flat_starts, total]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return cu_seqlens, max_seqlen
