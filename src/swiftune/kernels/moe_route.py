"""The grouped-GEMM path's bookkeeping for a rollout step of routed experts: the sort by expert in two launches,
the weighted combine in one.

Above the decode kernels' token cap (:mod:`swiftune.kernels.moe_decode`) a rollout step runs its experts as grouped
GEMMs over the ``A = T k`` (token, expert) assignments sorted by expert. Around the two GEMMs, torch's ops take
about twenty launches a layer: a stable ``argsort`` (a radix sort, tens of microseconds for a few hundred
assignments), a search for the blocks' ends, gathers, the inverse permutation, a second sort for each token's
experts in ascending id, and ``k`` rounded adds. Here:

* :func:`expert_sort` (two launches, a program per block of 64 assignments): ``order [A]`` (the flat assignment
  index of each sorted row, exactly what a stable sort by expert gives), ``token_of [A]``, ``ends [E]`` int32 (the
  end of each expert's rows) and ``slot_row [T, k]`` (the sorted row of token ``t``'s ``r``-th smallest expert
  id). A counting sort: the first launch counts each block's assignments per expert (a one-hot block summed over
  its rows); in the second, each program sums every block's counts (the running sum over experts gives each
  expert's first row) and places its own block's assignments after that expert's rows from earlier blocks and
  earlier lanes of its own block (a strictly-lower-triangular comparison). An assignment's rank among its token's
  experts is how many of the token's ``k`` ids are smaller (a token's experts are distinct). Both passes in one
  program, serially over the blocks, was the first version (docs/benchmarks.md, "rollout_moe").
* :func:`expert_combine` (a program per token and column block)::

      out_t = p_{t,1} + p_{t,2} + ... + p_{t,k}       p_{t,r} = round(y[slot_row[t, r]] * w[order[slot_row[t, r]]])

  with every product and every partial sum rounded to the activation dtype, in ascending expert order: the
  roundings of ``(y * w).to(dtype)`` followed by ``k - 1`` additions in that dtype, which is what the torch path
  (:func:`swiftune.models.experts.rollout_experts_forward`) computes, so the two give the same bits.

No backward: a rollout step runs under ``no_grad``.
"""

from __future__ import annotations

import torch

from ._fp8_common import round_to_bf16
from .launch import next_pow2, tl, triton
from .moe_decode import moe_decode_interpreted

__all__ = ["EXPERT_SORT_MAX_ASSIGNMENTS", "EXPERT_SORT_MAX_EXPERTS", "expert_combine", "expert_sort"]

#: the most assignments (tokens x k) the sort takes (every program holds all blocks' counts: 64 x E at most); a
#: prefill above it keeps torch's sort
EXPERT_SORT_MAX_ASSIGNMENTS = 4096
#: the most experts a layer may have for the one-hot block (64 x E) to stay in registers
EXPERT_SORT_MAX_EXPERTS = 256
_BLOCK_A = 64
_NO_EXPERT = 2**30  # above every expert id: the masked lanes of a token's ids


if triton is not None:

    @triton.jit
    def _expert_count_kernel(idx_ptr, hist_ptr, num_assign, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
        """Program ``b``: how many of assignments ``[b BLOCK_A, (b + 1) BLOCK_A)`` each expert has, to row ``b``
        of ``hist [blocks, BLOCK_E]``."""
        b = tl.program_id(0)
        experts = tl.arange(0, BLOCK_E)
        a = b * BLOCK_A + tl.arange(0, BLOCK_A)
        e = tl.load(idx_ptr + a, mask=a < num_assign, other=-1).to(tl.int32)
        counts = tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(hist_ptr + b * BLOCK_E + experts, counts)

    @triton.jit
    def _expert_place_kernel(idx_ptr, hist_ptr, order_ptr, token_ptr, ends_ptr, slot_ptr, num_assign, num_experts,
                             num_blocks, TOP_K: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, NO_EXPERT: tl.constexpr):
        """Program ``b`` places block ``b``'s assignments: the blocks' ends from every block's counts, the start
        of each expert's rows for this block (its block start plus the earlier blocks' counts), then each
        assignment's row (plus the same expert's earlier lanes of this block) and its slot among its token's
        experts. Program 0 also writes the ends."""
        b = tl.program_id(0)
        experts = tl.arange(0, BLOCK_E)
        blocks = tl.arange(0, BLOCK_B)
        hist = tl.load(hist_ptr + blocks[:, None] * BLOCK_E + experts[None, :], mask=blocks[:, None] < num_blocks,
                       other=0)
        total = tl.sum(hist, axis=0)
        ends = tl.cumsum(total, axis=0)
        tl.store(ends_ptr + experts, ends, mask=experts + b * BLOCK_E < num_experts)  # program 0 only
        before = ends - total + tl.sum(tl.where(blocks[:, None] < b, hist, 0), axis=0)
        lanes = tl.arange(0, BLOCK_A)
        a = b * BLOCK_A + lanes
        valid = a < num_assign
        e = tl.load(idx_ptr + a, mask=valid, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
        row = tl.sum(onehot * before[None, :], axis=1) + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(order_ptr + row, a.to(tl.int64), mask=valid)
        t = a // TOP_K
        tl.store(token_ptr + row, t.to(tl.int64), mask=valid)
        ks = tl.arange(0, BLOCK_K)
        ids = tl.load(idx_ptr + t[:, None] * TOP_K + ks[None, :], mask=valid[:, None] & (ks[None, :] < TOP_K),
                      other=NO_EXPERT).to(tl.int32)
        rank = tl.sum((ids < e[:, None]).to(tl.int32), axis=1)
        tl.store(slot_ptr + t * TOP_K + rank, row.to(tl.int64), mask=valid)

    @triton.jit
    def _expert_combine_kernel(y_ptr, slot_ptr, order_ptr, w_ptr, out_ptr, hidden, s_y, s_o,
                               TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        n_mask = n < hidden
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for r in tl.static_range(TOP_K):  # ascending expert id: the torch path's order of the rounded adds
            row = tl.load(slot_ptr + t * TOP_K + r)
            w = tl.load(w_ptr + tl.load(order_ptr + row)).to(tl.float32)
            y = tl.load(y_ptr + row * s_y + n, mask=n_mask, other=0.0).to(tl.float32)
            part = y * w
            if ROUND_BF16:  # the interpreter's cast truncates: round first, then the cast is exact
                part = round_to_bf16(part)
            part = part.to(out_ptr.dtype.element_ty).to(tl.float32)
            if r == 0:
                acc = part
            else:
                acc = acc + part
                if ROUND_BF16:
                    acc = round_to_bf16(acc)
                acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * s_o + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)

else:  # pragma: no cover
    _expert_count_kernel = _expert_place_kernel = _expert_combine_kernel = None


def expert_sort(top_k_index: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order [A], token_of [A], ends [E] int32, slot_row [T, k])`` of the ``[T, k]`` assignments (module
    docstring), in two launches. Takes at most :data:`EXPERT_SORT_MAX_ASSIGNMENTS` assignments and
    :data:`EXPERT_SORT_MAX_EXPERTS` experts, each token's ``k`` experts distinct; CUDA tensors, or CPU ones
    through the Triton interpreter."""
    tokens, top_k = top_k_index.shape
    num_assign = tokens * top_k
    if num_assign > EXPERT_SORT_MAX_ASSIGNMENTS or num_experts > EXPERT_SORT_MAX_EXPERTS:
        raise ValueError(f"expert_sort takes at most {EXPERT_SORT_MAX_ASSIGNMENTS} assignments and "
                         f"{EXPERT_SORT_MAX_EXPERTS} experts, got {num_assign} and {num_experts}")
    flat = top_k_index.reshape(-1).contiguous()
    order = torch.empty(num_assign, dtype=torch.int64, device=flat.device)
    token_of = torch.empty_like(order)
    ends = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    slot_row = torch.empty(tokens, top_k, dtype=torch.int64, device=flat.device)
    if num_assign == 0:
        return order, token_of, ends.zero_(), slot_row
    blocks = triton.cdiv(num_assign, _BLOCK_A)
    block_e = max(16, next_pow2(num_experts))
    hist = torch.empty(blocks, block_e, dtype=torch.int32, device=flat.device)
    _expert_count_kernel[(blocks,)](flat, hist, num_assign, BLOCK_A=_BLOCK_A, BLOCK_E=block_e, num_warps=4)
    block_b = max(2, next_pow2(blocks))
    _expert_place_kernel[(blocks,)](
        flat, hist, order, token_of, ends, slot_row, num_assign, num_experts, blocks, TOP_K=top_k, BLOCK_A=_BLOCK_A,
        BLOCK_E=block_e, BLOCK_B=block_b, BLOCK_K=max(2, next_pow2(top_k)), NO_EXPERT=_NO_EXPERT,
        num_warps=4 if block_b * block_e <= 4096 else 8,
    )
    return order, token_of, ends, slot_row


def expert_combine(y: torch.Tensor, slot_row: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """``out [T, H]`` in ``dtype``: each token's ``k`` expert outputs (rows of ``y [A, H]`` in sorted order)
    times their routing weights, added in ascending expert order with the torch path's roundings (module
    docstring)."""
    tokens, top_k = slot_row.shape
    size = y.shape[1]
    out = torch.empty(tokens, size, dtype=dtype, device=y.device)
    if tokens == 0:
        return out
    if y.stride(1) != 1:
        y = y.contiguous()
    block_h = min(1024, next_pow2(size))
    _expert_combine_kernel[(tokens, triton.cdiv(size, block_h))](
        y, slot_row, order, top_k_weights.reshape(-1).contiguous(), out, size, y.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, ROUND_BF16=moe_decode_interpreted() and dtype == torch.bfloat16, num_warps=4,
        enable_fp_fusion=False,  # torch rounds the product before the add: no fused multiply-add (float32 rows)
    )
    return out
