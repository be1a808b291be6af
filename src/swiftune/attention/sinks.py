"""Packed causal attention with attention sinks (gpt-oss).

A sink is one learned logit ``s_h`` per query head that joins every softmax as a key of its own
with a zero value: for query ``i`` with allowed keys ``J(i)`` (same document, causal, window),

    p_ij = exp(x_ij) / (exp(s_h) + sum_{j' in J(i)} exp(x_ij'))      x_ij = scale * q_i . k_j
    o_i  = sum_j p_ij v_j

so the sink only takes probability mass away (the weights sum to ``1 - p_sink``). Backward: the usual
softmax gradient over the ``|J(i)| + 1`` logits, and ``d L / d s_h = -sum_i p_sink,i (dL/do_i . o_i)``,
which autograd derives from either formulation below.

Two ways, both O(T) in the keys a token sees, never across documents:

* ``reference``: each document alone, eager scores with the sink column appended, as transformers'
  gpt-oss ``eager_attention_forward`` computes them (max-subtracted softmax, sink column dropped);
  for CPU and tests.
* ``flex``: one extra key/value slot (index ``T``, zero key and value) that every query may see;
  its score is replaced by ``s_h`` in a ``score_mod``. flex builds the same softmax, compiled on
  CUDA, at O(T) memory plus the block table; the sinks' gradient flows through the captured tensor.

The varlen / flash / sdpa kernels have no hook for an extra logit; ``auto`` takes flex on CUDA.
GRPO's shared-prompt rows (:mod:`.shared_prompt`) reuse :func:`dense_sink_scores` and
:func:`flex_sink_with_mask` under their own mask.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from .backends import (FLEX_TRAINING_KERNEL, causal_window_mask, document_block_mask, document_bounds, flex_fn,
                       flex_in_head_groups)
from .packing import PackedBatch

SINK_BACKENDS = ("flex", "reference")

__all__ = ["SINK_BACKENDS", "dense_sink_scores", "flex_sink_attention", "flex_sink_with_mask",
           "reference_sink_attention", "sink_attention"]


def dense_sink_scores(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores [..., H, Lq, Lk]`` (masked entries ``-inf``) with one sink logit per head
    (``sinks [H]``) as an extra column, the sink's column dropped: the attention weights."""
    h = scores.shape[-3]
    column = sinks.to(scores.dtype).reshape(h, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values  # as transformers: no overflow in bf16
    return F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def reference_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float,
    sinks: torch.Tensor,
    window: int | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Each document alone: ``q [T, Hq, D]``, ``k, v [T, Hk, D]`` -> ``[T, Hq, D]`` (module docstring)."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for start, end in document_bounds(packed):
        qd = q[start:end].transpose(0, 1)
        kd = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vd = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = torch.matmul(qd, kd.transpose(1, 2)) * scale
        allowed = causal_window_mask(end - start, window, q.device)
        probs = dense_sink_scores(scores.masked_fill(~allowed, float("-inf")), sinks)
        if dropout:
            probs = F.dropout(probs, p=dropout, training=True)
        outs.append(torch.matmul(probs.to(vd.dtype), vd).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def flex_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float,
    sinks: torch.Tensor,
    window: int | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """flex_attention over the flat axis plus one sink slot (module docstring)."""
    if dropout:
        raise ValueError("flex attention has no attention dropout")
    return flex_sink_with_mask(q, k, v, document_block_mask(packed, window, q.device, sink_slot=True), scale=scale,
                               sinks=sinks)


def flex_sink_with_mask(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, *, scale: float, sinks: torch.Tensor,
) -> torch.Tensor:
    """flex_attention of token-major ``q [T, Hq, D]``, ``k, v [T, Hk, D]`` plus the sink slot (key ``T``,
    zero key and value, its score replaced by ``sinks[h]``) under ``block_mask``, a mask over ``T + 1``
    keys that must open the last one to every query. Shared by the packed rows here and GRPO's
    shared-prompt rows (:mod:`.shared_prompt`), which differ only in the mask. A q past flex's int32
    offsets runs in groups of heads (:func:`~.backends.flex_in_head_groups`), each with its heads' sinks."""
    total = q.shape[0]
    k1 = torch.cat([k, k.new_zeros(1, *k.shape[1:])], dim=0)
    v1 = torch.cat([v, v.new_zeros(1, *v.shape[1:])], dim=0)
    # a device tensor, not a Python int: compiled for dynamic shapes, dynamo would lift the int to a
    # CPU scalar tensor, which the CUDA kernel cannot read (see softcap_score_mod)
    sink_slot = torch.tensor(total, dtype=torch.int32, device=q.device)

    def attend(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, first_head: int) -> torch.Tensor:
        sink_logits = sinks[first_head:first_head + q.shape[1]].float()  # this call's query heads

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx == sink_slot, sink_logits[h].to(score.dtype), score)

        with warnings.catch_warnings():
            # Off CUDA flex runs eagerly (tests only) and warns that it materialises the scores.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_fn(q.device)(
                q.transpose(0, 1).unsqueeze(0), k1.transpose(0, 1).unsqueeze(0), v1.transpose(0, 1).unsqueeze(0),
                score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k1.shape[1],
                kernel_options=FLEX_TRAINING_KERNEL,
            )
        return out.squeeze(0).transpose(0, 1)

    return flex_in_head_groups(attend, q, k1, v1)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float,
    sinks: torch.Tensor,
    window: int | None = None,
    dropout: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Packed causal attention with sinks through ``backend`` (``auto``: flex on CUDA, else reference).

    A backend without sink support (varlen, flash_attn, sdpa) asked for by name is refused: running
    it without the sink would silently compute another attention.
    """
    if backend == "auto":
        backend = "flex" if q.device.type == "cuda" else "reference"
    if backend not in SINK_BACKENDS:
        raise ValueError(f"attention backend {backend!r} has no attention sinks (gpt-oss); use one of "
                         f"{SINK_BACKENDS} or 'auto'")
    if backend == "flex" and q.device.type != "cuda" and torch.is_grad_enabled() and q.requires_grad:
        raise ValueError("flex attention has no backward off CUDA; use backend='reference'")
    fn = flex_sink_attention if backend == "flex" else reference_sink_attention
    return fn(q, k, v, packed, scale=scale, sinks=sinks, window=window, dropout=dropout)
