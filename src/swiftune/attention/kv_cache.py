"""Attention against a static KV cache, for the fast rollout engine's decode steps.

The engine switches the model's attention implementation to :data:`ROLLOUT_ATTENTION_NAME`
during a call and passes its per-call state (an object with an ``attend`` method, see
:class:`CacheAttention`) to every layer as the keyword argument :data:`ROLLOUT_KWARG`; the
layer's own projections, q/k norms and RoPE run as usual and only the attention is the
engine's. The functions below are that attention in a decode step: every row's one query
over the first ``kv_len`` cache slots, under a per-row slot mask (row ``b`` sees slots
``j <= cur[b]``, within its sliding window), plus gpt-oss's attention sinks (one learned logit per
query head that joins the softmax's denominator with a zero value, :mod:`swiftune.attention.sinks`).

Both take ``query [B, Hq, 1, D]`` and ``keys, values [B, Hk, kv_len, D]`` and return
``[B, 1, Hq, D]``. Query head ``h`` reads K/V head ``h // (Hq / Hk)``, so the ``Hq / Hk`` query
heads of one K/V head are laid out as that head's queries: ``[B, Hk, Hq / Hk, D]``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .sinks import dense_sink_scores

ROLLOUT_ATTENTION_NAME = "swiftune_rollout"
ROLLOUT_KWARG = "swiftune_rollout"


class CacheAttention(Protocol):
    """What the rollout engine hands every attention layer (its ``DecodeContext``)."""

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output ``[B, S, Hq, D]`` of layer ``layer``, writing this step's K/V to the cache;
        ``sinks [Hq]``: gpt-oss's per-head sink logits (``None``: no sink)."""
        ...


def rollout_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              sliding_window: int | None = None, softcap: float | None = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function used inside the fast rollout engine's calls only."""
    ctx: CacheAttention | None = kwargs.get(ROLLOUT_KWARG)
    if ctx is None:
        raise RuntimeError("the swiftune_rollout attention only runs inside FastRolloutEngine.generate")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")  # gpt-oss passes its attention sinks under transformers' name
    if sinks is None:
        return ctx.attend(module.layer_idx, query, key, value, scale, sliding_window, softcap), None
    return ctx.attend(module.layer_idx, query, key, value, scale, sliding_window, softcap, sinks=sinks), None


def slot_mask(cur: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """``[B, 1, 1, kv_len]`` bool: slot ``j`` visible to row ``b`` (``j <= cur[b]``, within the window)."""
    j = torch.arange(kv_len, device=cur.device)[None, :]
    cur = cur[:, None]
    allowed = j <= cur
    if window:
        allowed = allowed & (cur - j < window)
    return allowed[:, None, None, :]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as ``0 / -inf`` in ``dtype``: SDPA would otherwise convert a bool mask again in
    every layer, so the engine builds this once per step."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def cached_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Decode attention through SDPA with the additive slot mask ``bias`` (:func:`additive_mask`).

    The query heads of a K/V head share one position, so SDPA over ``[B, Hk, g]`` queries with the
    row's slot mask is one fused kernel on CUDA instead of matmul / mask / softmax / matmul."""
    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(rows, 1, heads, dim)


def softcapped_cached_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                allowed: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Decode attention with Gemma 2's ``c * tanh(s / c)`` soft-cap, which SDPA cannot apply:
    matmul, cap, mask (``allowed``: :func:`slot_mask`), float32 softmax, matmul."""
    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, Hk, g, kv_len]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [B, Hk, g, D]
    return out.reshape(rows, 1, heads, dim)


def sink_cached_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                          scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Decode attention with gpt-oss's attention sinks (``sinks [Hq]``, one logit per query head),
    which SDPA has no hook for: matmul, mask (``allowed``: :func:`slot_mask`), then the softmax over
    ``[scores, sink]`` in float32 with the sink's column dropped (what transformers' eager gpt-oss
    attention and the training side's :func:`~swiftune.attention.sinks.dense_sink_scores` compute), matmul.

    Every op stays on the device with static shapes, so the decode step that calls it is capturable."""
    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, Hk, g, kv_len]
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    # query head h = kv_head * g + i, so [B, Hk, g, L] is [B, Hq, 1, L]: one sink per query head
    probs = dense_sink_scores(scores.reshape(rows, heads, 1, -1), sinks)
    out = torch.matmul(probs.reshape(scores.shape).to(values.dtype), values)  # [B, Hk, g, D]
    return out.reshape(rows, 1, heads, dim)
