"""A mixture-of-experts router's top-k for a decode step: one Triton launch after the router's matmul.

From the router logits ``z [T, E]`` of ``T`` tokens, transformers' routers compute the experts ``idx [T, k]``
and their routing weights ``r [T, k]`` in one of two orders:

* ``softmax_first`` (Qwen3-MoE, Mixtral)::

      p = softmax(float32(z))                       over all E experts
      idx, v = topk(p, k)                           largest first
      r = v / sum(v)   if normalised, else v        (Qwen3-MoE's norm_topk_prob; Mixtral always)
      r = r in out_dtype                            (Qwen3-MoE: the logits' dtype; Mixtral: float32)

* ``topk_first`` (gpt-oss)::

      idx, v = topk(z, k)                           on the logits themselves
      r = softmax(v) in the logits' dtype           over the k chosen only (float32 inside)

As torch runs them that is a softmax, a top-k, a sum, a division and a cast: five launches a layer, each
a few microseconds of a decode step that is bound by its launches. Here each program takes one token's
row of logits into registers (``E`` is at most a few hundred) and computes all of it: the softmax's
maximum and sum, then ``k`` rounds of "largest value left, lowest index among ties" (what a stable
descending sort gives), then the normalisation and the cast.

Roundings: float32 throughout, as transformers' routers; the softmax's sum is reduced in another order
than torch's kernel, so a weight may differ from torch's in its last float32 bit (``moe_router_reference``
is torch's formula; the tests compare the two). Where two experts' values tie exactly at the k-th place,
torch's ``topk`` may keep either; this kernel keeps the lower id. A NaN logit (a diverged model) ranks
below every number, so the k experts are always distinct ids of the layer (the expert kernels index with
them). No backward: a decode step runs under ``no_grad``.
"""

from __future__ import annotations

from typing import Literal

import torch

from .launch import Backend, choose_backend, next_pow2, tl, triton

__all__ = ["RouterOrder", "moe_router_topk", "moe_router_topk_reference"]

RouterOrder = Literal["softmax_first", "topk_first"]


def moe_router_topk_reference(logits: torch.Tensor, top_k: int, order: RouterOrder, normalize: bool,
                              out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in out_dtype, experts [T, k] int64)`` as transformers' routers compute them
    (module docstring)."""
    if order == "softmax_first":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        values, index = torch.topk(probs, top_k, dim=-1)
        if normalize:
            values = values / values.sum(dim=-1, keepdim=True)
        return values.to(out_dtype), index
    values, index = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype).to(out_dtype), index


if triton is not None:

    @triton.jit
    def _router_topk_kernel(z_ptr, w_ptr, idx_ptr, num_experts, stride_z, stride_w, stride_i,
                            TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, NORMALIZE: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK_E)
        valid = cols < num_experts
        z = tl.load(z_ptr + t * stride_z + cols, mask=valid, other=float("-inf")).to(tl.float32)
        if SOFTMAX_FIRST:
            e = tl.where(valid, tl.exp(z - tl.max(z, axis=0)), 0.0)
            values = e / tl.sum(e, axis=0)
        else:
            values = z
        # a NaN (a diverged model's logits) ranks lowest: the experts chosen stay k distinct ids in range
        values = tl.where(values == values, values, float("-inf"))
        free = valid  # the experts not chosen yet (padding lanes never are)
        slots = tl.arange(0, BLOCK_K)
        top = tl.zeros((BLOCK_K,), dtype=tl.float32)
        index = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(tl.where(free, values, float("-inf")), axis=0)
            at = tl.min(tl.where(free & (values == best), cols, BLOCK_E), axis=0)  # the lowest id among ties
            top = tl.where(slots == j, best, top)
            index = tl.where(slots == j, at.to(tl.int64), index)
            free = free & (cols != at)
        kept = slots < TOP_K
        if SOFTMAX_FIRST:
            if NORMALIZE:
                top = top / tl.sum(tl.where(kept, top, 0.0), axis=0)
        else:
            e = tl.where(kept, tl.exp(top - tl.max(tl.where(kept, top, float("-inf")), axis=0)), 0.0)
            top = e / tl.sum(e, axis=0)
        tl.store(w_ptr + t * stride_w + slots, top.to(w_ptr.dtype.element_ty), mask=kept)
        tl.store(idx_ptr + t * stride_i + slots, index, mask=kept)


def moe_router_topk(logits: torch.Tensor, top_k: int, order: RouterOrder, normalize: bool = True,
                    out_dtype: torch.dtype | None = None, *, backend: Backend = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights and experts of ``logits [T, E]`` (module docstring): ``(weights [T, top_k]
    in out_dtype (default: the logits'), experts [T, top_k] int64)``, largest weight first.
    ``normalize`` applies to ``softmax_first`` only (``topk_first``'s softmax over the k is normalised)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if order not in ("softmax_first", "topk_first"):
        raise ValueError(f"order must be 'softmax_first' or 'topk_first', got {order!r}")
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] (the number of experts), got {top_k}")
    out_dtype = logits.dtype if out_dtype is None else out_dtype
    kernel = _router_topk_kernel if triton is not None else None
    differentiable = torch.is_grad_enabled() and logits.requires_grad  # the kernel has no backward
    if choose_backend(backend, kernel, {"logits": logits}) == "reference" or tokens == 0 or differentiable:
        return moe_router_topk_reference(logits, top_k, order, normalize, out_dtype)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=out_dtype, device=logits.device)
    index = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    _router_topk_kernel[(tokens,)](
        logits, weights, index, experts, logits.stride(0), weights.stride(0), index.stride(0),
        TOP_K=top_k, SOFTMAX_FIRST=order == "softmax_first", NORMALIZE=normalize,
        BLOCK_E=max(16, next_pow2(experts)), BLOCK_K=max(2, next_pow2(top_k)), num_warps=1 if experts <= 128 else 2,
    )
    return weights, index
