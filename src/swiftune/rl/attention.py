"""Attention for GRPO's packed policy rows, including shared-prompt ("prefix tree") rows.

A *shared-prompt* row holds, for each group, the prompt once followed by its completions::

    [ P P P P | c1 c1 c1 | c2 c2 | c3 c3 c3 c3 ] [ P' P' | c1' ... ]
      pos 0..p-1  p..        p..     p..            next group: positions restart at 0

Completion ``k`` of a group attends to the group's prompt and causally to its own earlier tokens,
never to a sibling completion; positions continue from the prompt in every completion, so each
completion sees exactly what it would see in its own row ``prompt + completion``: the log-probs
and gradients equal the unshared computation while the prompt is encoded once per group. The
rule, for query token ``i`` and key ``j`` (``doc`` = group, ``seg`` = 0 on the prompt and ``k``
on completion ``k``)::

    allowed(i, j) = doc[i] == doc[j]  and  j <= i  and  (seg[j] == 0 or seg[j] == seg[i])
                    [and pos[i] - pos[j] < W for a sliding window W]

Backends: ``reference`` (each group separately, eager softmax attention with that mask; CPU and
tests) and ``flex`` (``flex_attention`` with a block mask from the same rule, compiled on CUDA:
O(T) memory plus the block table). Any other requested backend (``auto``, ``varlen``,
``flash_attn``: their kernels take contiguous documents only) means flex on CUDA and reference
elsewhere for shared rows; plain packed rows use the requested backend as it is.

How it reaches the model without editing anyone's source: :func:`install_grpo_attention` registers
:func:`grpo_attention_forward` with transformers' ``AttentionInterface`` (and swiftune's packed
mask function with ``AttentionMaskInterface``) as ``"swiftune_grpo"`` and makes it the model's
attention implementation. The policy forward passes a :class:`RowLayout` as the keyword argument
``swiftune_row_layout``; transformers forwards it to every attention call (and gradient
checkpointing replays it in the recomputation, so the recomputed forward is the same). Without
that keyword (generation, any other forward) the function is swiftune's ``packed_attention_forward``
unchanged, so the switch is safe to leave in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import PackedBatch, packed_attention, packed_attention_forward, packed_attention_mask
from ..attention.backends import flex_token_major
from ..models.patching import causal_lm_of

GRPO_ATTENTION_NAME = "swiftune_grpo"
LAYOUT_KWARG = "swiftune_row_layout"

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    create_block_mask = flex_attention = None


@dataclass
class RowLayout:
    """The document structure of one policy-forward row ``[1, T]``.

    Attributes:
        packed: the plain packed layout (``cu_seqlens`` of the documents; a shared-prompt group is
            one document).
        position_ids: ``[T]`` positions.
        seg: ``[T]`` int32, 0 on prompt tokens and ``k >= 1`` on the k-th completion of a shared
            group; ``None`` for a plain packed row (every sample its own document).
        backend: attention backend name (``auto``, ``reference``, ``flex``; for plain rows any of
            swiftune's packed backends).
    """

    packed: PackedBatch
    position_ids: torch.Tensor
    seg: torch.Tensor | None = None
    backend: str = "auto"
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def shared(self) -> bool:
        return self.seg is not None

    def shared_backend(self, on_cuda: bool) -> str:
        """The backend a shared row runs: ``flex`` or ``reference`` when asked for; otherwise (``auto``,
        or a varlen kernel, which cannot express the rule) flex on CUDA and reference elsewhere."""
        if self.backend in ("flex", "reference"):
            return self.backend
        return "flex" if on_cuda and flex_attention is not None else "reference"

    @property
    def attention_kernel(self) -> str | None:
        """``"flex"`` when this row's attention surely runs flex (GQA in the kernel, dq in the
        activation dtype), else ``None`` (decided per call). Read by offloaded checkpointing
        (``checkpointing.ATTENTION_KERNEL_ATTR``) to size the working set of a recomputed layer."""
        if self.shared:
            return "flex" if self.shared_backend(self.position_ids.is_cuda) == "flex" else None
        return "flex" if self.backend == "flex" else None


def register_grpo_attention() -> str:
    """Register ``"swiftune_grpo"`` with transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(GRPO_ATTENTION_NAME, grpo_attention_forward)
    AttentionMaskInterface.register(GRPO_ATTENTION_NAME, packed_attention_mask)
    return GRPO_ATTENTION_NAME


def install_grpo_attention(model: nn.Module) -> None:
    """Make ``model`` (patched by :func:`swiftune.patch_model`) call :func:`grpo_attention_forward`."""
    name = register_grpo_attention()
    hf_model = causal_lm_of(model)
    if hf_model.config._attn_implementation == name:
        return
    try:
        hf_model.set_attn_implementation(name)
    except (AttributeError, ValueError):  # older API: the config attribute is the switch
        hf_model.config._attn_implementation = name


def grpo_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: a :class:`RowLayout` row when one is passed, else packed."""
    layout = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return packed_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                         sliding_window=sliding_window, softcap=softcap, **kwargs)
    bsz, heads, q_len, head_dim = query.shape
    if bsz != 1 or key.shape[2] != q_len:
        raise ValueError(f"a GRPO policy row is one row [1, T] without cache; got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}")
    if scaling is None:
        scaling = head_dim**-0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    window = int(sliding_window) if sliding_window else None
    cap = float(softcap) if softcap else None
    if not layout.shared:
        out = packed_attention(q, k, v, layout.packed, scale=scaling, window=window, softcap=cap, dropout=dropout,
                               backend=layout.backend)
    else:
        backend = layout.shared_backend(q.is_cuda)
        if dropout:
            raise ValueError("attention dropout is not supported in shared-prompt rows; set share_prompt=False")
        if backend == "flex":
            out = shared_prompt_flex(q, k, v, layout, scale=scaling, window=window, softcap=cap)
        elif backend == "reference":
            out = shared_prompt_reference(q, k, v, layout, scale=scaling, window=window, softcap=cap)
        else:
            raise ValueError(f"shared-prompt rows run on the 'flex' or 'reference' backend, not {backend!r}")
    return out.unsqueeze(0), None


def _allowed(seg_q: torch.Tensor, seg_k: torch.Tensor, pos_q: torch.Tensor, pos_k: torch.Tensor,
             window: int | None) -> torch.Tensor:
    """The mask rule of one group: ``[Lq, Lk]`` with flat indices ``j <= i`` (queries = keys here)."""
    n = seg_q.shape[0]
    i = torch.arange(n, device=seg_q.device).unsqueeze(1)
    j = torch.arange(seg_k.shape[0], device=seg_q.device).unsqueeze(0)
    allowed = (j <= i) & ((seg_k.unsqueeze(0) == 0) | (seg_k.unsqueeze(0) == seg_q.unsqueeze(1)))
    if window:
        allowed = allowed & (pos_q.unsqueeze(1) - pos_k.unsqueeze(0) < window)
    return allowed


def shared_prompt_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, *, scale: float,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Eager attention per group with the shared-prompt mask (the arithmetic of swiftune's reference)."""
    groups = q.shape[1] // k.shape[1]
    bounds = layout.packed.cu_seqlens.tolist()
    seg, pos = layout.seg, layout.position_ids
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qd = q[start:end].transpose(0, 1)
        kd = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vd = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = torch.matmul(qd, kd.transpose(1, 2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = _allowed(seg[start:end], seg[start:end], pos[start:end], pos[start:end], window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        outs.append(torch.matmul(probs, vd).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def _shared_block_mask(layout: RowLayout, window: int | None, device: torch.device):
    key = ("shared_block_mask", window)
    if key not in layout.cache:
        total = layout.packed.num_tokens
        padded = -(-total // 128) * 128  # whole 128-token tiles; the tail is its own document (-1)
        doc = torch.full((padded,), -1, dtype=torch.int32, device=device)
        doc[:total] = layout.packed.doc_ids()
        seg = torch.zeros(padded, dtype=torch.int32, device=device)
        seg[:total] = layout.seg
        pos = torch.zeros(padded, dtype=torch.int32, device=device)
        pos[:total] = layout.position_ids.to(torch.int32)

        def mask_mod(b, h, q_idx, kv_idx):
            ok = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx) & ((seg[kv_idx] == 0) | (seg[kv_idx] == seg[q_idx]))
            if window:
                ok = ok & (pos[q_idx] - pos[kv_idx] < window)
            return ok

        layout.cache[key] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device,
                                              _compile=device.type == "cuda")
    return layout.cache[key]


def shared_prompt_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, *, scale: float,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """``flex_attention`` over the whole row with the shared-prompt block mask (GPU path)."""
    if flex_attention is None:  # pragma: no cover
        raise RuntimeError("flex attention needs torch >= 2.5")
    return flex_token_major(q, k, v, _shared_block_mask(layout, window, q.device), scale=scale, softcap=softcap)
