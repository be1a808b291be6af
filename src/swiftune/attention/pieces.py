"""Per-document attention outputs left unconcatenated, for an output projection that saves its input.

The ``sdpa`` paths (:func:`swiftune.attention.backends.sdpa_packed_attention`, and
:func:`swiftune.attention.shared_prompt.shared_prompt_sdpa` for GRPO's shared-prompt rows) run one
``scaled_dot_product_attention`` call per sequence. Each call saves its own output for its backward.
Concatenating the outputs for the output projection makes a second copy of every one of them, and a
projection with trainable weights (a LoRA adapter, full fine-tuning, the tiled projections) saves that
copy for its own backward: in a recomputed layer, two copies of the attention output are alive
through the attention's backward (``q_dim`` bytes a token each in bf16), the peak of a long row.

When the caller asks (the keyword :data:`PIECES_KWARG`, passed by
:func:`swiftune.models.forwards.fused_attention_forward` while gradients are recorded), those paths
return :class:`DocumentOutputs` instead, and the attention forward projects each piece on its own:
``o_proj(cat(p_i)) == cat(o_proj(p_i))`` row by row, and each projection saves a view of the tensor
sdpa saved (its output is laid out ``[L, H, D]`` in memory, so the flattening is a view). Pieces are
kept only when every one has at least :data:`PIECE_MIN_TOKENS` tokens: a projection call per short
document would cost more launches than the copy costs memory.

The same paths take their *inputs* apart with :func:`row_pieces`: a view of ``q``, ``k`` and ``v`` per
call, whose gradients meet in one row-sized buffer. A plain slice ``q[a:b]`` per call makes autograd
build a zero-filled gradient of the whole row for each slice and add them up: ``O(calls x T)`` memory
traffic per tensor per layer, and one extra row-sized gradient alive from the end of a call's backward
through the next call's (where a long row's step peaks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PIECES_KWARG = "swiftune_output_pieces"
PIECE_MIN_TOKENS = 4096  # the mean document length from which ``auto`` takes per-document sdpa

__all__ = ["PIECES_KWARG", "PIECE_MIN_TOKENS", "DocumentOutputs", "document_outputs", "project_pieces",
           "row_pieces"]


@dataclass(frozen=True)
class DocumentOutputs:
    """The outputs of one attention call over consecutive sequences, ``[L_i, Hq, D]`` each, in the
    order of the flat token axis (their lengths sum to its ``T`` tokens)."""

    pieces: tuple[torch.Tensor, ...]

    def cat(self) -> torch.Tensor:
        """``[T, Hq, D]``: what the attention would have returned."""
        return torch.cat(self.pieces, dim=0)


def document_outputs(pieces: list[torch.Tensor], keep_pieces: bool) -> torch.Tensor | DocumentOutputs:
    """``pieces`` as one tensor, or as :class:`DocumentOutputs` when the caller asked for them and
    every piece is long enough to be projected on its own (:data:`PIECE_MIN_TOKENS`)."""
    if len(pieces) == 1:
        return pieces[0]
    if keep_pieces and min(p.shape[0] for p in pieces) >= PIECE_MIN_TOKENS:
        return DocumentOutputs(tuple(pieces))
    return torch.cat(pieces, dim=0)


def project_pieces(o_proj: torch.nn.Module, outputs: DocumentOutputs, batch_shape: tuple[int, ...]) -> torch.Tensor:
    """``o_proj`` over each piece, joined to ``[*batch_shape, hidden]`` (the pieces cover the flat
    axis of ``batch_shape`` in order: documents never cross rows, and padded batches never get here)."""
    projected = [o_proj(p.reshape(1, p.shape[0], -1)) for p in outputs.pieces]
    return torch.cat(projected, dim=1).view(*batch_shape, -1)


class _RowPieces(torch.autograd.Function):
    """Views ``x[a:b]`` of a row for each range, with one gradient buffer in backward.

    The backward runs once every piece's gradient is in (while the calls' backwards run, only their own
    piece-sized gradients are alive) and writes them into a single row-sized buffer. Ranges that do not
    overlap (documents of a packed row) are copied into an uninitialised buffer whose uncovered rows alone
    are zeroed; overlapping ones (a shared prompt read by every completion) are added into a zeroed one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ranges: tuple[tuple[int, int], ...]):
        ctx.ranges, ctx.shape = ranges, x.shape
        ctx.set_materialize_grads(False)  # a piece without a gradient adds nothing (no zero tensor for it)
        return tuple(x[a:b] for a, b in ranges)

    @staticmethod
    def backward(ctx, *grads):
        present = sorted(((r, g) for r, g in zip(ctx.ranges, grads) if g is not None), key=lambda item: item[0])
        if not present:
            return None, None
        first = present[0][1]
        if all(prev[0][1] <= nxt[0][0] for prev, nxt in zip(present, present[1:])):  # disjoint
            total = first.new_empty(ctx.shape)
            covered = 0
            for (a, b), g in present:
                total[covered:a].zero_()
                total[a:b].copy_(g)
                covered = b
            total[covered:].zero_()
            return total, None
        total = first.new_zeros(ctx.shape)
        for (a, b), g in present:
            total[a:b] += g
        return total, None


def row_pieces(x: torch.Tensor, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """``x[a:b]`` for each ``(a, b)`` of ``ranges`` along dim 0, their gradients gathered into one buffer
    in backward (:class:`_RowPieces`)."""
    if not ranges:
        return ()
    return _RowPieces.apply(x, tuple(ranges))
