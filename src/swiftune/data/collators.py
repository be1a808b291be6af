"""Collators for the three batch modes, all built from the same tokenized examples.

An example is ``{"input_ids": list[int], "completion_mask": list[int]}`` (no mask: every token
trained), optionally with ``"seq_lengths"`` when it is already a packed row of several
documents (see :func:`swiftune.data.packing.pack_dataset`).

Label convention (all modes)
----------------------------
``labels`` are *unshifted*, as transformers models expect: the model shifts them inside, so
``labels[t]`` is predicted from the hidden state at ``t - 1``. ``labels[t] = input_ids[t]`` where
the token is trained, else ``-100``. **The first token of every document gets ``-100``**: its
shifted prediction would come from the previous document's last token, so masking it is what
keeps any label from crossing a document boundary (and it is never a real target anyway: nothing
in its own document precedes it). Hence the loss terms of a packed row are exactly those of its
documents run one by one.

Modes
-----
* :class:`PaddingFreeCollator` (default): one row ``[1, T]`` of all examples concatenated,
  ``position_ids`` restarting at 0 at each example, no padding (unless ``pad_to_multiple_of``) and
  no ``attention_mask``. The
  attention layer finds the documents from ``position_ids`` (``cu_seqlens``).
* :class:`PackedCollator`: rows of at most ``max_length`` (best-fit decreasing), each laid out as
  padding-free, right-padded to the longest row. Padding is one more document: its
  ``position_ids`` restart at 0 and count up, its labels are ``-100``, so no real token attends
  to it or is trained on it. No ``attention_mask`` is returned: a 2-D mask cannot express
  document boundaries (it would only hide padding), and passing one makes transformers leave
  its packed-sequence path; the document structure is all in ``position_ids``.
* :class:`PaddedCollator` (reference): one example per row, right padding, ``attention_mask``.

Every batch also carries ``num_trained_tokens`` (the number of loss terms, what transformers
calls ``num_items_in_batch``), ``num_tokens`` (real tokens) and ``num_padding_tokens`` as Python
ints; padding-free and packed batches also ``row_tokens`` (``[rows]``: how many leading tokens of
each row are real, the rest being its padding document; what a batch statistic over real tokens,
such as a MoE router's load-balancing loss, needs). They are not model inputs: take them out with
:func:`pop_batch_stats` before the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from swiftune.data.packing import pack_best_fit, position_ids_from_seq_lengths

IGNORE_INDEX = -100
BATCH_STAT_KEYS: tuple[str, ...] = ("num_trained_tokens", "num_tokens", "num_padding_tokens")
BatchMode = Literal["padding_free", "packed", "padded"]


@dataclass
class BatchStats:
    """Token counts of one batch: trained tokens (loss terms), real tokens and padding."""

    num_trained_tokens: int
    num_tokens: int
    num_padding_tokens: int

    @property
    def padding_fraction(self) -> float:
        """Share of the batch's token slots that are padding."""
        slots = self.num_tokens + self.num_padding_tokens
        return self.num_padding_tokens / slots if slots else 0.0


def pop_batch_stats(batch: dict[str, Any]) -> BatchStats:
    """Remove the count entries (and ``row_tokens``) from a collated batch, so it can go to the
    model, and return the counts."""
    batch.pop("row_tokens", None)
    return BatchStats(**{key: int(batch.pop(key)) for key in BATCH_STAT_KEYS})


def padding_fraction(batch: dict[str, Any]) -> float:
    """Share of padding slots in a collated batch (without removing its count entries)."""
    return BatchStats(**{key: int(batch[key]) for key in BATCH_STAT_KEYS}).padding_fraction


def _segment_lengths(example: dict) -> list[int]:
    return list(example.get("seq_lengths") or [len(example["input_ids"])])


def _labels(example: dict) -> list[int]:
    """Unshifted labels of one (possibly packed) example, first token of each document masked."""
    ids = example["input_ids"]
    mask = example.get("completion_mask")
    if mask is None:
        labels = list(ids)
    else:
        if len(mask) != len(ids):
            raise ValueError(f"completion_mask has {len(mask)} entries for {len(ids)} input_ids")
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    start = 0
    for length in _segment_lengths(example):
        labels[start] = IGNORE_INDEX  # its shifted prediction would cross the boundary
        start += length
    if start != len(ids):
        raise ValueError(f"seq_lengths sum to {start} but the example has {len(ids)} tokens")
    return labels


def _concat_row(examples: Sequence[dict]) -> tuple[list[int], list[int], list[int]]:
    input_ids: list[int] = []
    labels: list[int] = []
    seq_lengths: list[int] = []
    for example in examples:
        input_ids.extend(example["input_ids"])
        labels.extend(_labels(example))
        seq_lengths.extend(_segment_lengths(example))
    return input_ids, labels, seq_lengths


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def _finish(batch: dict[str, Any], num_tokens: int) -> dict[str, Any]:
    labels = batch["labels"]
    batch["num_trained_tokens"] = int((labels != IGNORE_INDEX).sum())
    batch["num_tokens"] = num_tokens
    batch["num_padding_tokens"] = labels.numel() - num_tokens
    return batch


@dataclass
class PaddingFreeCollator:
    """All examples in one row ``[1, T]`` with restarting ``position_ids``; no padding at all.

    With ``pad_to_multiple_of`` (TRL's field: fewer distinct shapes for compilers) the row is
    right-padded to a multiple of it; as in :class:`PackedCollator` the padding is one more
    document (positions restart at 0, labels ``-100``), so no real token sees it or trains on it.
    """

    pad_token_id: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[dict]) -> dict[str, Any]:
        if not examples:
            raise ValueError("cannot collate an empty list of examples")
        input_ids, labels, seq_lengths = _concat_row(examples)
        n = len(input_ids)
        extra = _round_up(n, self.pad_to_multiple_of) - n
        if extra:
            input_ids = input_ids + [self.pad_token_id if self.pad_token_id is not None else 0] * extra
            labels = labels + [IGNORE_INDEX] * extra
            seq_lengths = seq_lengths + [extra]
        batch = {
            "input_ids": torch.tensor([input_ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": position_ids_from_seq_lengths(seq_lengths).unsqueeze(0),
            "row_tokens": torch.tensor([n], dtype=torch.long),
        }
        return _finish(batch, n)


@dataclass
class PackedCollator:
    """Rows of at most ``max_length`` tokens packed best-fit decreasing, padded to the longest.

    Examples that are already packed rows (they have ``seq_lengths``, from
    :func:`~swiftune.data.packing.pack_dataset`) stay one row each; plain examples are packed
    here, within the batch. ``pad_token_id`` only fills padding slots, which are never attended
    to by real tokens nor trained, so ``None`` (a tokenizer without pad token) falls back to 0.
    """

    max_length: int
    pad_token_id: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[dict]) -> dict[str, Any]:
        if not examples:
            raise ValueError("cannot collate an empty list of examples")
        if all("seq_lengths" in e for e in examples):
            rows = [[e] for e in examples]
        else:
            lengths = [len(e["input_ids"]) for e in examples]
            rows = [[examples[i] for i in row] for row in pack_best_fit(lengths, self.max_length)]
        built = [_concat_row(row) for row in rows]
        width = _round_up(max(len(ids) for ids, _, _ in built), self.pad_to_multiple_of)
        pad_id = self.pad_token_id if self.pad_token_id is not None else 0
        input_ids = torch.full((len(built), width), pad_id, dtype=torch.long)
        labels = torch.full((len(built), width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.empty((len(built), width), dtype=torch.long)
        num_tokens = 0
        row_tokens = torch.tensor([len(ids) for ids, _, _ in built], dtype=torch.long)
        for r, (ids, row_labels, seq_lengths) in enumerate(built):
            n = len(ids)
            input_ids[r, :n] = torch.tensor(ids)
            labels[r, :n] = torch.tensor(row_labels)
            # Padding is its own document: positions restart at 0 after the last real token.
            position_ids[r] = position_ids_from_seq_lengths(seq_lengths + ([width - n] if width > n else []))
            num_tokens += n
        batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "row_tokens": row_tokens}
        return _finish(batch, num_tokens)


@dataclass
class PaddedCollator:
    """Reference mode: one example per row, right-padded, with ``attention_mask``.

    Needs a real ``pad_token_id`` (as transformers' padding collators do).
    """

    pad_token_id: int | None
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        if self.pad_token_id is None:
            raise ValueError(
                "padded batches need a pad token and the tokenizer has none: set "
                "tokenizer.pad_token (e.g. tokenizer.pad_token = tokenizer.eos_token), or use "
                "padding-free batches (the default) or packing, which need no pad token"
            )

    def __call__(self, examples: Sequence[dict]) -> dict[str, Any]:
        if not examples:
            raise ValueError("cannot collate an empty list of examples")
        for e in examples:
            if len(_segment_lengths(e)) > 1:
                raise ValueError(
                    "padded batches take one example per row, but got a packed row "
                    "(seq_lengths); use PackedCollator for packed rows"
                )
        width = _round_up(max(len(e["input_ids"]) for e in examples), self.pad_to_multiple_of)
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        num_tokens = 0
        for r, example in enumerate(examples):
            n = len(example["input_ids"])
            input_ids[r, :n] = torch.tensor(example["input_ids"])
            labels[r, :n] = torch.tensor(_labels(example))
            attention_mask[r, :n] = 1
            num_tokens += n
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
        return _finish(batch, num_tokens)


def make_collator(
    mode: BatchMode = "padding_free",
    *,
    max_length: int | None = None,
    pad_token_id: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> PaddingFreeCollator | PackedCollator | PaddedCollator:
    """The collator for ``mode``; ``max_length`` is required for ``"packed"``."""
    if mode == "padding_free":
        return PaddingFreeCollator(pad_token_id, pad_to_multiple_of)
    if mode == "packed":
        if max_length is None:
            raise ValueError("packed batches need max_length (the row length)")
        return PackedCollator(max_length, pad_token_id, pad_to_multiple_of)
    if mode == "padded":
        return PaddedCollator(pad_token_id, pad_to_multiple_of)
    raise ValueError(f"unknown batch mode {mode!r}; choose 'padding_free', 'packed' or 'padded'")
