"""Variable-length causal attention over packed documents, five ways.

Every backend takes the flat layout of :mod:`swiftune.attention.packing`: ``q [T, Hq, D]``,
``k, v [T, Hk, D]`` (``Hq % Hk == 0``: grouped-query attention) and a :class:`PackedBatch`, and
returns ``[T, Hq, D]``. For a query token ``i`` of document ``d`` the keys it sees are the tokens
``j`` of the same document with ``j <= i`` and, with a sliding window ``W``, ``i - j < W`` (the
convention of transformers' masks: a token sees itself and the ``W - 1`` before it). Scores are
``s = scale * q.k``, soft-capped as ``cap * tanh(s / cap)`` when ``softcap`` is set (Gemma 2).

* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash kernels in PyTorch, CUDA, fp16/bf16).
  Its signature changed between releases (``is_causal`` / ``window_size`` / ``enable_gqa``), so
  the parameters it has are read once at import and the call adapts; no soft-capping.
* ``flash_attn``: ``flash_attn_varlen_func`` of the flash-attn package, when installed.
* ``flex``: ``flex_attention`` with a document (+ window) block mask and a soft-cap score_mod;
  compiled on CUDA, where it costs O(T) memory plus an O((T/128)^2) block table.
* ``sdpa``: each document separately through ``F.scaled_dot_product_attention(is_causal=True)``,
  GQA in the kernel. On Hopper PyTorch has cuDNN's attention behind it, faster than torch's
  varlen (FlashAttention-2) and flex on long documents (the figures are in docs/benchmarks.md);
  one call per document, so ``auto`` takes it only for long documents (:func:`prefers_sdpa`).
  No sliding window, no soft-capping.
* ``reference``: each document separately with eager softmax attention; for CPU and tests.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kernel_choice import SDPA_MIN_MEAN_DOC_TOKENS, layout_attention_kernel, prefers_sdpa
from .kept_outputs import kept_attention_outputs
from .packing import PackedBatch
from .pieces import DocumentOutputs, document_outputs, row_pieces

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

_SDPA_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters  # torch >= 2.6

BACKENDS = ("varlen", "flash_attn", "flex", "sdpa", "reference")

__all__ = [
    "BACKENDS",
    "BACKEND_FUNCTIONS",
    "SDPA_MIN_MEAN_DOC_TOKENS",
    "backend_available",
    "causal_window_mask",
    "dense_causal_attention",
    "document_block_mask",
    "flex_head_groups",
    "flex_in_head_groups",
    "flex_token_major",
    "layout_attention_kernel",
    "packed_attention",
    "planner_attention_terms",
    "prefers_sdpa",
    "resolve_backend",
    "unsupported_reason",
    "varlen_expands_kv",
]

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None
    _VARLEN_PARAMS = frozenset()

try:
    from flash_attn import flash_attn_varlen_func as _flash_varlen

    _FLASH_PARAMS = frozenset(inspect.signature(_flash_varlen).parameters)
except Exception:  # not installed, or installed against another torch/CUDA
    _flash_varlen = None
    _FLASH_PARAMS = frozenset()

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    create_block_mask = flex_attention = None

@functools.cache
def _compiled_flex() -> Callable:
    # Default dynamic=None: the first shape compiles static, a second one recompiles dynamic,
    # so padding-free batches of ever-changing length do not exhaust the recompile limit.
    return torch.compile(flex_attention)


def flex_fn(device: torch.device) -> Callable:
    """flex_attention, compiled on CUDA (eager flex materialises T x T scores: fine for CPU tests only)."""
    return _compiled_flex() if device.type == "cuda" else flex_attention


# torch's flex_attention kernels compute their q/k/v/out offsets in int32: a tensor of 2^31 elements or more
# reads and writes outside itself (pytorch/pytorch#190857; gpt-oss's 64 x 64 query heads pass it at 524,288
# tokens a step, a CUDA illegal memory access in the backward). Longer steps run in groups of K/V heads.
FLEX_MAX_ELEMENTS = 2**31 - 1


def flex_head_groups(tokens: int, q_heads: int, kv_heads: int, dim: int) -> list[tuple[int, int]]:
    """K/V head ranges ``[h0, h1)`` whose query heads, as a contiguous ``[tokens, (h1 - h0) g, dim]``
    tensor, hold at most :data:`FLEX_MAX_ELEMENTS` elements: one range (all heads) when the whole q does."""
    per_kv_head = tokens * (q_heads // kv_heads) * dim
    heads = FLEX_MAX_ELEMENTS // per_kv_head
    if heads >= kv_heads:
        return [(0, kv_heads)]
    if heads == 0:
        raise ValueError(
            f"{tokens} tokens a step is more than flex attention can index: one K/V head's "
            f"{q_heads // kv_heads} query heads of dimension {dim} hold {per_kv_head} elements, and its kernels "
            f"address at most {FLEX_MAX_ELEMENTS}; use fewer tokens a step (shorter rows, or fewer rows)")
    return [(h0, min(h0 + heads, kv_heads)) for h0 in range(0, kv_heads, heads)]


def flex_in_head_groups(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor:
    """``attend(q, k, v, first_q_head)`` on token-major ``q [T, Hq, D]``, ``k, v [T', Hk, D]``, called once
    when q fits flex's int32 offsets, else once per group of K/V heads (:func:`flex_head_groups`) with each
    group's slices made contiguous, the outputs joined along the heads. Attention is per head, so the groups'
    results are the whole call's; autograd carries the gradients through the slices."""
    groups = flex_head_groups(q.shape[0], q.shape[1], k.shape[1], q.shape[2])
    if len(groups) == 1:
        return attend(q, k, v, 0)
    g = q.shape[1] // k.shape[1]
    widths = [h1 - h0 for h0, h1 in groups]
    # split, not slicing: split's backward joins the groups' gradients into one tensor, where each slice's
    # backward would write a zero-filled gradient of the whole q to be summed
    qs, ks, vs = (t.split([w * m for w in widths], dim=1) for t, m in ((q, g), (k, 1), (v, 1)))
    return torch.cat([attend(qg.contiguous(), kg.contiguous(), vg.contiguous(), h0 * g)
                      for qg, kg, vg, (h0, _) in zip(qs, ks, vs, groups)], dim=1)


def flex_token_major(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, *, scale: float, softcap: float | None = None,
) -> torch.Tensor:
    """flex_attention of token-major ``[T, H, D]`` q/k/v (one flat row) under ``block_mask``, with
    Gemma 2's soft-cap when given; GQA when q has more heads than k. Returns ``[T, Hq, D]``. A q past
    flex's int32 offsets runs in groups of heads (:func:`flex_in_head_groups`)."""
    score_mod = softcap_score_mod(softcap, q.device)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_head: int) -> torch.Tensor:
        with warnings.catch_warnings():
            # Off CUDA flex runs eagerly (tests only) and warns that it materialises the scores.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_fn(q.device)(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                score_mod=score_mod,
                block_mask=block_mask,
                scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
                # Rows under 128 tokens would otherwise compile inductor's decoding kernel, a forward-only
                # kernel for short queries that has no valid configuration for some head sizes (the
                # built-in GRPO model's short rows failed with NoValidChoicesError on torch 2.11).
                kernel_options=FLEX_TRAINING_KERNEL,
            )
        return out.squeeze(0).transpose(0, 1)

    return flex_in_head_groups(attend, q, k, v)


FLEX_TRAINING_KERNEL = {"FORCE_USE_FLEX_ATTENTION": True}


def softcap_score_mod(softcap: float | None, device: torch.device) -> Callable | None:
    """Gemma 2's ``c * tanh(score / c)`` as a flex ``score_mod`` (None without soft-capping).

    ``c`` is a device tensor, not a Python float: once flex has been recompiled for dynamic shapes,
    dynamo lifts captured floats to CPU scalar tensors, which the CUDA kernel cannot read.
    """
    if not softcap:
        return None
    cap = torch.tensor(float(softcap), device=device, dtype=torch.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


# --------------------------------------------------------------------------- capabilities


def backend_available(name: str, device: torch.device | str) -> bool:
    """Whether backend ``name`` can run on ``device`` in this environment."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS} or 'auto'")
    device = torch.device(device)
    if name in ("reference", "sdpa"):
        return True
    if name == "flex":
        return flex_attention is not None
    if device.type != "cuda":
        return False
    if name == "varlen":
        return _varlen_attn is not None
    return _flash_varlen is not None  # flash_attn


def unsupported_reason(
    name: str, q: torch.Tensor, k: torch.Tensor, window: int | None, softcap: float | None, dropout: float
) -> str | None:
    """Why backend ``name`` cannot compute this call (``None`` when it can)."""
    if not backend_available(name, q.device):
        return f"{name} is not available on {q.device} here"
    if name == "varlen":
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"varlen_attn needs fp16/bf16, got {q.dtype}"
        if softcap:
            return "varlen_attn has no attention soft-capping"
        if window and "window_size" not in _VARLEN_PARAMS:
            return "this torch's varlen_attn has no window_size (sliding window)"
        if dropout:
            return "varlen_attn has no attention dropout"
    if name == "flash_attn":
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"flash_attn needs fp16/bf16, got {q.dtype}"
        if softcap and "softcap" not in _FLASH_PARAMS:
            return "this flash_attn has no softcap"
    if name == "sdpa":
        if window:
            return "per-document sdpa has no sliding window"
        if softcap:
            return "per-document sdpa has no attention soft-capping"
    if name == "flex":
        if dropout:
            return "flex attention has no attention dropout"
        if q.device.type != "cuda" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return "flex attention has no backward off CUDA"
    return None


def resolve_backend(
    name: str, q: torch.Tensor, k: torch.Tensor, window: int | None, softcap: float | None, dropout: float,
    packed: PackedBatch | None = None,
) -> str:
    """Pick the backend for one call: ``name`` itself (checked), or the best one for ``"auto"``.

    ``auto`` on CUDA: ``sdpa`` when ``packed``'s documents are long (:func:`prefers_sdpa`), else
    flash_attn, then varlen, then flex, then sdpa (whichever first supports the call's dtype,
    window, soft-cap and dropout); on CPU: reference.
    """
    if name != "auto":
        reason = unsupported_reason(name, q, k, window, softcap, dropout)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} cannot run this layer: {reason}")
        return name
    if q.device.type == "cuda":
        long_docs = packed is not None and prefers_sdpa(packed.num_tokens, packed.num_docs)
        order = ("sdpa", "flash_attn", "varlen", "flex") if long_docs else ("flash_attn", "varlen", "flex", "sdpa")
    else:
        order = ("reference",)
    for candidate in order:
        if unsupported_reason(candidate, q, k, window, softcap, dropout) is None:
            return candidate
    raise ValueError(
        f"no packed attention backend supports this layer on {q.device} (dtype {q.dtype}, window {window}, "
        f"softcap {softcap}, dropout {dropout}); install flash-attn or use backend='reference'"
    )


# --------------------------------------------------------------------------- backends


def document_bounds(packed: PackedBatch) -> list[tuple[int, int]]:
    """``[(start, end)]`` of every document on the flat axis (one host sync per forward, cached)."""
    if "bounds" not in packed.cache:
        cu = packed.cu_seqlens.tolist()
        packed.cache["bounds"] = list(zip(cu[:-1], cu[1:]))
    return packed.cache["bounds"]


def causal_window_mask(n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[n, n]`` True where query ``i`` may attend key ``j`` of the same document: ``j <= i``, and
    ``i - j < window`` for a sliding window."""
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(n, device=device).unsqueeze(0)
    allowed = j <= i
    return allowed & (i - j < window) if window else allowed


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Each document alone, eager attention with the softmax in (at least) float32.

    Mirrors transformers' ``eager_attention_forward``: scores in the input dtype, soft-cap,
    causal (+ window) mask, softmax in float32 cast back, dropout, then ``p @ v``.
    """
    groups = q.shape[1] // k.shape[1]
    outs = []
    for start, end in document_bounds(packed):
        qd = q[start:end].transpose(0, 1)  # [H, L, D]
        kd = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vd = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = torch.matmul(qd, kd.transpose(1, 2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~causal_window_mask(end - start, window, q.device), float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        if dropout:
            probs = F.dropout(probs, p=dropout, training=True)
        outs.append(torch.matmul(probs, vd).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def document_block_mask(packed: PackedBatch, window: int | None, device: torch.device, *,
                        sink_slot: bool = False) -> BlockMask:
    """The document (+ window) BlockMask of this forward, built once per window size. With
    ``sink_slot`` (attention sinks, :mod:`.sinks`): over ``T + 1`` keys, the last one open to every query."""
    key = ("flex_sink_block_mask" if sink_slot else "flex_block_mask", window)
    if key not in packed.cache:
        total = packed.num_tokens
        kv_len = total + 1 if sink_slot else total
        # Pad the ids to whole 128-token blocks with -1 so that mask_mod never indexes past the
        # end when the mask is evaluated on block-aligned tiles.
        padded = -(-kv_len // 128) * 128
        doc = torch.full((padded,), -1, dtype=torch.int32, device=device)
        doc[:total] = packed.doc_ids()

        def same_document(b, h, q_idx, kv_idx):
            same = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
            if window:
                same = same & (q_idx - kv_idx < window)
            return same

        mask_mod = same_document
        if sink_slot:
            sink = torch.tensor(total, dtype=torch.int32, device=device)

            def same_document_or_sink(b, h, q_idx, kv_idx):
                return same_document(b, h, q_idx, kv_idx) | (kv_idx == sink)

            mask_mod = same_document_or_sink
        packed.cache[key] = create_block_mask(
            mask_mod, B=None, H=None, Q_LEN=total, KV_LEN=kv_len, device=device, _compile=device.type == "cuda"
        )
    return packed.cache[key]


def flex_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """flex_attention over the whole flat axis with a block-sparse document mask."""
    if dropout:
        raise ValueError("flex attention has no attention dropout")
    return flex_token_major(q, k, v, document_block_mask(packed, window, q.device), scale=scale, softcap=softcap)


def varlen_expands_kv() -> bool:
    """Whether this torch's ``varlen_attn`` lacks GQA (torch 2.11), so K/V heads are repeated to the
    query heads before the call (and saved so for backward: the memory planner counts them)."""
    return "enable_gqa" not in _VARLEN_PARAMS


def planner_attention_terms(kernel: str | None, max_doc_tokens: int | None = None) -> dict[str, Any]:
    """The memory planner's attention terms (``TrainSetup.kv_expanded``, ``float32_dq``,
    ``attention_out_copy``, ``float32_dq_tokens``, ``attention_group_elements``) for the kernel a forward
    runs:

    * ``"flex"`` keeps the K/V heads and writes dq in the activation dtype; a q past its int32 offsets
      runs in groups of heads (:func:`flex_in_head_groups`, ``attention_group_elements``);
    * ``"sdpa"`` (one call per document, :func:`sdpa_packed_attention`: GQA in the kernel) keeps
      the K/V heads too, and the documents' outputs, concatenated for the output projection, are
      saved twice (``attention_out_copy``; documents of ``PIECE_MIN_TOKENS`` or more are projected
      one by one instead, :mod:`swiftune.attention.pieces`, which saves no copy: the term stays until
      the GPU's kernels are shown to share the storage, ``tests/test_attention_pieces.py``'s CUDA
      case); its float32 dq exists for one document at a time: for
      ``max_doc_tokens`` tokens when the longest document is known, else for the whole row (one
      long document's backward holds it for all of its tokens at once);
    * anything else (``None``: not known) is planned as torch's varlen: K/V expanded where it has
      no GQA, a float32 dq accumulator; this also covers sdpa's no-GQA retry. (GRPO's shared-prompt
      sdpa rows say ``"sdpa"``: their prompt k/v copies are not a term of their own, and were
      covered by the sdpa terms, see ``attention.shared_prompt.RowLayout.attention_kernel``.)
    """
    if kernel == "flex":
        return {"kv_expanded": False, "float32_dq": False, "attention_group_elements": FLEX_MAX_ELEMENTS}
    if kernel == "sdpa":
        return {"kv_expanded": False, "float32_dq": True, "attention_out_copy": True,
                "float32_dq_tokens": max_doc_tokens}
    return {"kv_expanded": varlen_expands_kv(), "float32_dq": True}


def varlen_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``, adapted to the signature of this torch."""
    if softcap or dropout:
        raise ValueError("varlen_attn supports neither soft-capping nor dropout")
    kwargs: dict = {}
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scale
    else:  # older signature: fold the scale into q (the kernel uses 1/sqrt(D))
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in _VARLEN_PARAMS:
        # (left, right) = (W - 1, 0): a token sees itself and the W - 1 before it; (-1, 0) = causal.
        kwargs["window_size"] = (window - 1, 0) if window else (-1, 0)
    elif window:
        raise ValueError("this torch's varlen_attn has no window_size")
    if "is_causal" in _VARLEN_PARAMS:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if not varlen_expands_kv():
            kwargs["enable_gqa"] = True
        else:  # torch 2.11: expand the KV heads (O(T) memory, like the activations themselves)
            groups = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    cu = packed.cu_seqlens
    n = packed.max_seqlen
    return _varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, n, n, **kwargs)


def flash_attn_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func`` (GQA, window and soft-cap are native)."""
    kwargs: dict = {"dropout_p": dropout, "softmax_scale": scale, "causal": True}
    if window:
        kwargs["window_size"] = (window - 1, 0)
    if softcap:
        kwargs["softcap"] = float(softcap)
    cu = packed.cu_seqlens
    n = packed.max_seqlen
    return _flash_varlen(q, k, v, cu, cu, n, n, **kwargs)


def _fused_sdpa_kernels(device: torch.device, cudnn_first: bool = True):
    """On CUDA, sdpa restricted to its fused kernels, cuDNN's first (never the math fallback,
    which would build ``L x L`` scores: at long context an out-of-memory instead of an error)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    fused = [SDPBackend.CUDNN_ATTENTION, *fused] if cudnn_first else [*fused, SDPBackend.CUDNN_ATTENTION]
    return sdpa_kernel(fused, set_priority=True) if _SDPA_SET_PRIORITY else sdpa_kernel(fused)


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, dropout: float = 0.0,
) -> torch.Tensor:
    """One causal sequence, token-major ``q [L, Hq, D]``, ``k, v [L, Hk, D]`` -> ``[L, Hq, D]``,
    through ``F.scaled_dot_product_attention`` with GQA in the kernel.

    If the call fails (no fused kernel of this torch takes grouped K/V heads, or cuDNN refuses the
    shape), it is made again with the K/V heads repeated to the query heads (memory O(L), like the
    activations) and FlashAttention first."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, L, D] views
    gqa = q.shape[1] != k.shape[1]
    try:
        with _fused_sdpa_kernels(q.device):
            out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=dropout, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
    except RuntimeError as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        if gqa:
            groups = q.shape[1] // k.shape[1]
            kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
        with _fused_sdpa_kernels(q.device, cudnn_first=False):
            out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=dropout, is_causal=True, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def sdpa_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    keep_pieces: bool = False,
) -> torch.Tensor | DocumentOutputs:
    """Every document alone through :func:`dense_causal_attention`; outputs concatenated, or with
    ``keep_pieces`` left apart for a caller that projects each one (:mod:`swiftune.attention.pieces`)."""
    if window or softcap:
        raise ValueError("per-document sdpa supports neither a sliding window nor soft-capping")
    with kept_attention_outputs():  # a checkpointed layer that keeps them: stored, or served in its recompute
        bounds = [(a, b) for a, b in document_bounds(packed) if b > a]
        outs = [dense_causal_attention(qd, kd, vd, scale=scale, dropout=dropout)
                for qd, kd, vd in zip(*(row_pieces(t, bounds) for t in (q, k, v)))]
    if not outs:
        return q.new_zeros(q.shape)
    return document_outputs(outs, keep_pieces)


BACKEND_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "varlen": varlen_packed_attention,
    "flash_attn": flash_attn_packed_attention,
    "flex": flex_packed_attention,
    "sdpa": sdpa_packed_attention,
    "reference": reference_attention,
}


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    backend: str = "auto",
    keep_pieces: bool = False,
) -> torch.Tensor | DocumentOutputs:
    """Causal attention within each document of a packed batch.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hk, D]`` with ``Hq % Hk == 0``, the real tokens in flat
            order (see :meth:`PackedBatch.unpad`).
        packed: the document layout (``cu_seqlens``) of this forward.
        scale: score scale, default ``D ** -0.5``.
        window: sliding window (a token sees itself and ``window - 1`` tokens before), or None.
        softcap: attention logit soft-cap (``cap * tanh(s / cap)``), or None.
        dropout: attention-probability dropout (reference, sdpa and flash_attn).
        backend: one of :data:`BACKENDS` or ``"auto"``.
        keep_pieces: when the backend is ``sdpa``, the documents' outputs may come back apart
            (:class:`~swiftune.attention.pieces.DocumentOutputs`), for a caller that projects each.

    Returns:
        ``[T, Hq, D]`` in q's dtype, or with ``keep_pieces`` possibly its pieces.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"expected q [T, Hq, D], k/v [T, Hk, D] with Hq % Hk == 0; got {q.shape}, {k.shape}, {v.shape}"
        )
    if scale is None:
        scale = q.shape[-1] ** -0.5
    window = int(window) if window else None
    softcap = float(softcap) if softcap else None
    name = resolve_backend(backend, q, k, window, softcap, dropout, packed)
    if name == "sdpa":
        return sdpa_packed_attention(q, k, v, packed, scale=scale, window=window, softcap=softcap, dropout=dropout,
                                     keep_pieces=keep_pieces)
    return BACKEND_FUNCTIONS[name](q, k, v, packed, scale=scale, window=window, softcap=softcap, dropout=dropout)
