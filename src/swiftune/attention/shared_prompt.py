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
tests), ``flex`` (``flex_attention`` with a block mask from the same rule, compiled on CUDA:
O(T) memory plus the block table) and ``sdpa`` (each completion as its own dense causal sequence
``prompt + completion`` through ``F.scaled_dot_product_attention``: the prompt's queries are
computed once more per completion, which costs nothing next to long completions, and in exchange
the fastest dense kernel runs, cuDNN's on Hopper). ``auto`` on CUDA takes ``sdpa`` when the
sequences average at least ``SDPA_MIN_MEAN_DOC_TOKENS`` tokens and the layer has neither sliding
window nor soft-cap, else flex; reference elsewhere. ``varlen``/``flash_attn`` (contiguous
documents only) mean the same as ``auto`` for shared rows; plain packed rows use the requested
backend as it is.

Attention sinks (gpt-oss: one logit per head joining every softmax, :mod:`.sinks`) run on shared rows
through ``reference`` (each group eagerly, the mask above plus the sink column) or ``flex`` (the same
mask_mod over one extra key slot whose score is the sink); ``auto`` takes flex on CUDA, reference
elsewhere; sdpa has no hook for the extra logit and is refused by name
(:meth:`RowLayout.shared_sink_backend`).

How it reaches the model without editing anyone's source:
:func:`swiftune.attention.registry.register_grpo_attention` registers :func:`grpo_attention_forward`
with transformers' ``AttentionInterface`` (and swiftune's packed mask function with
``AttentionMaskInterface``) as ``"swiftune_grpo"``; the policy forward
(:func:`swiftune.rl.policy.install_grpo_attention`) makes it the model's attention
implementation and passes a :class:`RowLayout` as the keyword argument
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

from .backends import dense_causal_attention, flex_token_major, packed_attention
from .hf import packed_attention_forward
from .kept_outputs import kept_attention_outputs
from .kernel_choice import layout_attention_kernel, prefers_sdpa
from .packing import PackedBatch
from .pieces import PIECES_KWARG, DocumentOutputs, document_outputs, row_pieces
from .sinks import dense_sink_scores, flex_sink_with_mask, sink_attention

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
        backend: attention backend name (``auto``, ``reference``, ``flex``, ``sdpa``; for plain rows
            any of swiftune's packed backends).
        sequences: for a shared row, ``(prompt_start, prompt_end, completion_start, completion_end)``
            on the flat axis for every completion, in row order (host integers: the ``sdpa`` path
            slices with them without a device sync).
    """

    packed: PackedBatch
    position_ids: torch.Tensor
    seg: torch.Tensor | None = None
    backend: str = "auto"
    sequences: list[tuple[int, int, int, int]] | None = None
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def shared(self) -> bool:
        return self.seg is not None

    def shared_backend(self, on_cuda: bool, window: int | None = None, softcap: float | None = None) -> str:
        """The backend a shared row runs: ``flex``, ``sdpa`` or ``reference`` when asked for; otherwise
        (``auto``, or a varlen kernel, which cannot express the rule) on CUDA ``sdpa`` for long
        sequences without window or soft-cap, else flex; reference off CUDA."""
        if self.backend in ("flex", "reference", "sdpa"):
            return self.backend
        if not on_cuda:
            return "reference"
        long_seqs = self.sequences is not None and prefers_sdpa(
            sum(pe - ps + ce - cs for ps, pe, cs, ce in self.sequences), len(self.sequences))
        dense_ok = not window and not softcap
        if long_seqs and dense_ok:
            return "sdpa"
        if flex_attention is not None:
            return "flex"
        return "sdpa" if dense_ok else "reference"  # torch without flex

    def shared_sink_backend(self, on_cuda: bool) -> str:
        """The backend a shared row with attention sinks (gpt-oss) runs: ``flex`` or ``reference`` when
        asked for; otherwise (``auto``, or a varlen kernel, as :meth:`shared_backend`) flex on CUDA,
        reference off it. ``sdpa`` has no hook for the sink logit: asked for by name it is refused,
        since running it without the sink would compute another attention (as
        :func:`~swiftune.attention.sinks.sink_attention` refuses it on plain rows)."""
        if self.backend in ("flex", "reference"):
            return self.backend
        if self.backend == "sdpa":
            raise ValueError("the sdpa backend has no attention sinks (gpt-oss); use 'flex', 'reference' or 'auto' "
                             "for this model")
        return "flex" if on_cuda and flex_attention is not None else "reference"

    @property
    def attention_kernel(self) -> str | None:
        """The kernel this row's attention runs, as far as the row decides it: ``"flex"`` (GQA in
        the kernel, dq in the activation dtype) or ``"sdpa"`` (one dense causal call per sequence,
        GQA in the kernel, a float32 dq for one sequence at a time: :attr:`max_seqlen`), else
        ``None`` (the reference path, or a varlen-style kernel). Read by offloaded checkpointing
        (``checkpointing.ATTENTION_KERNEL_ATTR``) to size the working set of a recomputed layer;
        layers with a sliding window or soft-cap run another kernel, which it checks on the model.

        Shared rows' sdpa also copies the prompt's k/v in front of every completion after a group's
        first (saved for backward: ``2 kv x 2`` bytes a token of those completions; their queries
        are a view, :func:`shared_prompt_sdpa`), which the planner's sdpa terms do not name: the
        margin of those terms covers the copies (the measured peak is in ``docs/benchmarks.md``)."""
        return self.attention_kernel_on(self.position_ids.is_cuda)

    def attention_kernel_on(self, on_cuda: bool) -> str | None:
        """:attr:`attention_kernel` for a row on CUDA (``on_cuda``) or off it."""
        if self.shared:
            kernel = self.shared_backend(on_cuda)
            return kernel if kernel in ("flex", "sdpa") else None
        return layout_attention_kernel(self.backend, on_cuda, self.packed.num_tokens, self.packed.num_docs)

    @property
    def max_seqlen(self) -> int:
        """The longest sequence one attention call covers: prompt + completion in a shared row
        (its sdpa path), else the longest document. Read with :attr:`attention_kernel`
        (``checkpointing.MAX_DOC_TOKENS_ATTR``)."""
        if self.shared and self.sequences:
            return max(pe - ps + ce - cs for ps, pe, cs, ce in self.sequences)
        return int(self.packed.max_seqlen)


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
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks
    keep_pieces = bool(kwargs.get(PIECES_KWARG))  # the caller projects per-sequence outputs (attention.pieces)
    bsz, heads, q_len, head_dim = query.shape
    if bsz != 1 or key.shape[2] != q_len:
        raise ValueError(f"a GRPO policy row is one row [1, T] without cache; got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}")
    if scaling is None:
        scaling = head_dim**-0.5
    # [T, H, D] views; squeeze, not [0]: the backward of an index fills a zero [1, H, T, D] tensor and copies
    # the gradient in (head-major, a row-sized buffer per layer), squeeze's is a view that keeps it token-major
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))
    window = int(sliding_window) if sliding_window else None
    cap = float(softcap) if softcap else None
    if sinks is not None:
        if cap:
            raise ValueError("attention sinks with a soft-cap: no family has both, and no backend computes it")
        if not layout.shared:
            out = sink_attention(q, k, v, layout.packed, scale=scaling, sinks=sinks, window=window, dropout=dropout,
                                 backend=layout.backend)
        else:
            if dropout:
                raise ValueError("attention dropout is not supported in shared-prompt rows; set share_prompt=False")
            out = shared_prompt_sink_attention(q, k, v, layout, scale=scaling, sinks=sinks, window=window)
    elif not layout.shared:
        out = packed_attention(q, k, v, layout.packed, scale=scaling, window=window, softcap=cap, dropout=dropout,
                               backend=layout.backend, keep_pieces=keep_pieces)
    else:
        if dropout:
            raise ValueError("attention dropout is not supported in shared-prompt rows; set share_prompt=False")
        backend = layout.shared_backend(q.is_cuda, window, cap)
        if backend == "flex":
            out = shared_prompt_flex(q, k, v, layout, scale=scaling, window=window, softcap=cap)
        elif backend == "sdpa":
            if window or cap:
                raise ValueError("the sdpa backend has no sliding window or soft-cap; use 'flex' for this model")
            out = shared_prompt_sdpa(q, k, v, layout, scale=scaling, keep_pieces=keep_pieces)
        elif backend == "reference":
            out = shared_prompt_reference(q, k, v, layout, scale=scaling, window=window, softcap=cap)
        else:
            raise ValueError(f"shared-prompt rows run on the 'flex', 'sdpa' or 'reference' backend, not {backend!r}")
    if isinstance(out, DocumentOutputs):
        return out, None
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


def _per_group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, *, scale: float,
                         window: int | None, probabilities) -> torch.Tensor:
    """Eager attention one group (one document of the row) at a time under the shared-prompt mask:
    ``probabilities(scores, allowed)`` turns a group's ``(heads, n, n)`` scores and mask into weights."""
    groups = q.shape[1] // k.shape[1]
    bounds = layout.packed.cu_seqlens.tolist()
    seg, pos = layout.seg, layout.position_ids
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qd = q[start:end].transpose(0, 1)
        kd = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vd = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = torch.matmul(qd, kd.transpose(1, 2)) * scale
        allowed = _allowed(seg[start:end], seg[start:end], pos[start:end], pos[start:end], window)
        probs = probabilities(scores, allowed)
        outs.append(torch.matmul(probs.to(vd.dtype), vd).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def shared_prompt_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, *, scale: float,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Eager attention per group with the shared-prompt mask (the arithmetic of swiftune's reference)."""

    def probabilities(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed, float("-inf"))
        return F.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)

    return _per_group_attention(q, k, v, layout, scale=scale, window=window, probabilities=probabilities)


def _shared_block_mask(layout: RowLayout, window: int | None, device: torch.device, *, sink_slot: bool = False):
    """The shared-prompt rule as a flex block mask over the row; ``sink_slot``: over ``T + 1`` keys, the
    last (the sink slot of :func:`~swiftune.attention.sinks.flex_sink_with_mask`) open to every query."""
    key = ("shared_sink_block_mask" if sink_slot else "shared_block_mask", window)
    if key not in layout.cache:
        total = layout.packed.num_tokens
        keys = total + int(sink_slot)
        padded = -(-keys // 128) * 128  # whole 128-token tiles; the tail is its own document (-1)
        doc = torch.full((padded,), -1, dtype=torch.int32, device=device)
        doc[:total] = layout.packed.doc_ids()
        seg = torch.zeros(padded, dtype=torch.int32, device=device)
        seg[:total] = layout.seg
        pos = torch.zeros(padded, dtype=torch.int32, device=device)
        pos[:total] = layout.position_ids.to(torch.int32)
        sink = torch.tensor(total, dtype=torch.int32, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            ok = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx) & ((seg[kv_idx] == 0) | (seg[kv_idx] == seg[q_idx]))
            if window:
                ok = ok & (pos[q_idx] - pos[kv_idx] < window)
            return ok | (kv_idx == sink) if sink_slot else ok

        layout.cache[key] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=total, KV_LEN=keys, device=device,
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


def shared_prompt_sink_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, *, scale: float, sinks: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Eager attention per group with the shared-prompt mask and the sink column (gpt-oss): the mask of
    :func:`shared_prompt_reference`, the softmax of :func:`~swiftune.attention.sinks.reference_sink_attention`
    (transformers' gpt-oss eager arithmetic). A completion's row of scores holds its prompt and its own
    tokens, each at its unshared distance, plus ``sinks[h]``: the unshared softmax exactly."""
    return _per_group_attention(
        q, k, v, layout, scale=scale, window=window,
        probabilities=lambda scores, allowed: dense_sink_scores(scores.masked_fill(~allowed, float("-inf")), sinks))


def shared_prompt_sink_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, *, scale: float, sinks: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """``flex_attention`` over the whole row with the shared-prompt block mask plus the sink slot
    (:func:`~swiftune.attention.sinks.flex_sink_with_mask`; GPU path, forward-only off CUDA)."""
    if flex_attention is None:  # pragma: no cover
        raise RuntimeError("flex attention needs torch >= 2.5")
    mask = _shared_block_mask(layout, window, q.device, sink_slot=True)
    return flex_sink_with_mask(q, k, v, mask, scale=scale, sinks=sinks)


def shared_prompt_sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, *, scale: float, sinks: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """A shared-prompt row with attention sinks through :meth:`RowLayout.shared_sink_backend`."""
    backend = layout.shared_sink_backend(q.is_cuda)
    if backend == "flex":
        if not q.is_cuda and torch.is_grad_enabled() and (q.requires_grad or sinks.requires_grad):
            raise ValueError("flex attention has no backward off CUDA; use backend='reference'")
        return shared_prompt_sink_flex(q, k, v, layout, scale=scale, sinks=sinks, window=window)
    return shared_prompt_sink_reference(q, k, v, layout, scale=scale, sinks=sinks, window=window)


def shared_prompt_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, *, scale: float, keep_pieces: bool = False,
) -> torch.Tensor | DocumentOutputs:
    """Each completion as the dense causal sequence ``prompt + completion`` (:func:`dense_causal_attention`).

    The first completion of a group follows its prompt on the flat axis, so ``prompt + completion``
    is a slice and its output covers the prompt's tokens too; every later completion's keys and
    values are gathered after a copy of the prompt's, and it keeps only its own outputs. Its queries
    are not gathered: a query's output depends on its own vector and the keys, never on the queries
    before it, so the ``P`` prompt positions of the square causal call may hold any queries whose
    outputs are dropped. They hold the ``P`` tokens just before the completion on the flat axis,
    which makes the call's queries one slice of ``q`` (a view: no ``[completion, q_dim]`` copy made
    and saved for backward per layer) and keeps the square ``is_causal`` call, so cuDNN's kernel,
    unchanged. The dropped rows' output gradient is zero, so their query gradient and their share
    of the key/value gradients are exactly zero. Gradients reach the shared prompt's k/v from every
    completion through the copies. With
    ``keep_pieces`` the sequences' outputs may come back apart (:mod:`swiftune.attention.pieces`)."""
    if layout.sequences is None:
        raise ValueError("this RowLayout has no host-side sequence table; build it with build_policy_row")
    with kept_attention_outputs():  # a checkpointed layer that keeps them: stored, or served in its recompute
        pieces = _completion_sequences_sdpa(q, k, v, layout, scale)
    return document_outputs(pieces, keep_pieces)


def _completion_sequences_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout,
                               scale: float) -> list[torch.Tensor]:
    # per call: its queries' range, its keys' and values' ranges (concatenated when two), and how many
    # leading outputs it drops
    calls: list[tuple[tuple[int, int], list[tuple[int, int]], int]] = []
    emitted = 0  # flat tokens whose outputs the calls so far cover
    for ps, pe, cs, ce in layout.sequences:
        if ps == emitted and cs == pe:  # a group's first completion: prompt + completion is one slice
            calls.append(((ps, ce), [(ps, ce)], 0))
        elif cs == emitted and pe <= cs:  # a later one: gather the prompt, keep the completion's outputs
            if cs == ce:
                continue
            # keys and values: the prompt's, then the completion's (copies); queries: the pe - ps tokens
            # before the completion and the completion, the first ones standing in for the prompt's
            # queries (their outputs are dropped, so their gradient is exactly zero)
            calls.append(((cs - (pe - ps), ce), [(ps, pe), (cs, ce)], pe - ps))
        else:
            raise ValueError(f"the sequence table does not tile the row in order at {(ps, pe, cs, ce)} "
                             f"(outputs so far end at {emitted})")
        emitted = ce
    if emitted != q.shape[0]:
        raise ValueError(f"the sequence table covers {emitted} of the row's {q.shape[0]} tokens")
    queries = row_pieces(q, [query_range for query_range, _, _ in calls])
    kv_ranges = [r for _, ranges, _ in calls for r in ranges]
    key_pieces, value_pieces = iter(row_pieces(k, kv_ranges)), iter(row_pieces(v, kv_ranges))
    pieces: list[torch.Tensor] = []
    for query, (_, ranges, dropped) in zip(queries, calls):
        ks, vs = ([next(it) for _ in ranges] for it in (key_pieces, value_pieces))
        ks, vs = (t[0] if len(t) == 1 else torch.cat(t) for t in (ks, vs))
        pieces.append(dense_causal_attention(query, ks, vs, scale=scale)[dropped:])
    return pieces
