"""Packed attention inside transformers models, through transformers' public registries.

Three pieces, none of which edits a model's source (:mod:`swiftune.attention.registry` registers
the first two):

* :func:`packed_attention_forward` is registered in ``AttentionInterface`` as ``"swiftune_packed"``;
  a model whose ``config._attn_implementation`` names it calls it from every attention layer with
  ``query [B, Hq, S, D]``, ``key/value [B, Hk, S, D]`` and the layer's kwargs (``position_ids``,
  ``sliding_window``, ``softcap``, ...).
* :func:`packed_attention_mask` is registered under the same name in ``AttentionMaskInterface``.
  transformers builds each forward's mask through it; it returns the 2-D padding mask as it came
  (or ``None``), so no 4-D ``[B, 1, S, S]`` mask is ever allocated. (Leaving the name out of the
  mask registry is not an option: transformers then drops the 2-D mask altogether.)
* :func:`install_packed_context` adds a forward pre-hook to the decoder stack that computes the
  :class:`PackedBatch` (``cu_seqlens``, one host sync) once per forward and passes it to every
  layer as the keyword argument ``swiftune_packed``: transformers forwards unknown keyword
  arguments from the decoder to each layer and on to the attention function. Without the hook
  the attention function derives the layout itself, per layer.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .backends import packed_attention
from .packing import PackedBatch, build_packed_batch
from .pieces import PIECES_KWARG, DocumentOutputs
from .sinks import dense_sink_scores, sink_attention

ATTENTION_NAME = "swiftune_packed"
PACKED_KWARG = "swiftune_packed"


def packed_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask builder for ``AttentionMaskInterface``: the 2-D padding mask itself, never ``[S, S]``.

    Causality, documents and windows are applied by the attention kernels from ``position_ids``.
    The mask is sliced from the right to ``kv_length`` like transformers' flash-attention mask
    (a sliding-window cache keeps only the last keys).
    """
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


def _dense_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
    dropout: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager attention for what the packed path does not cover: decoding with a KV cache
    (fewer queries than keys; then ``S_q x S_k`` is small), or a caller's own 4-D mask.

    Queries are aligned to the last keys (the cache convention); ``sinks`` (gpt-oss) add one logit
    per head to every softmax. Returns ``[B, S, Hq, D]``.
    """
    bsz, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    groups = heads // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask[..., :kv_len], float("-inf"))
        else:
            scores = scores + attention_mask[..., :kv_len]
    else:
        i = torch.arange(q_len, device=query.device).unsqueeze(1) + (kv_len - q_len)
        j = torch.arange(kv_len, device=query.device).unsqueeze(0)
        allowed = j <= i
        if sliding_window:
            allowed = allowed & (i - j < sliding_window)
        allowed = allowed.expand(bsz, 1, q_len, kv_len)
        if attention_mask is not None:
            allowed = allowed & (attention_mask[:, None, None, -kv_len:] != 0)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        probs = dense_sink_scores(scores.float(), sinks)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = torch.nan_to_num(probs).to(query.dtype)  # fully masked rows (padding) give zeros, not NaN
    if dropout:
        probs = nn.functional.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


_NO_ATTENTION_WEIGHTS = (
    "swiftune's packed attention returns no attention weights (output_attentions=True gives none, as transformers' "
    "sdpa and flash attention): load the model with FastModel.from_pretrained(..., patch=False, "
    "attn_implementation='eager') or call swiftune.models.unpatch_model(model) to get them")


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal attention within each packed document.

    ``s_aux``: gpt-oss's attention sinks (one logit per query head, :mod:`swiftune.attention.sinks`).
    Returns ``(attn_output [B, S, Hq, D], None)`` like transformers' own attention functions.
    Padding positions of a 2-D-masked batch get zeros. A caller that passes ``swiftune_output_pieces=True``
    (:data:`~swiftune.attention.pieces.PIECES_KWARG`) may get long documents' outputs apart instead,
    as :class:`~swiftune.attention.pieces.DocumentOutputs` ``[L_i, Hq, D]``.
    """
    bsz, heads, q_len, head_dim = query.shape
    if kwargs.get("output_attentions"):  # as transformers' sdpa and flash attention: said, not silently empty
        warnings.warn(_NO_ATTENTION_WEIGHTS, stacklevel=2)
    if scaling is None:
        scaling = head_dim**-0.5
    if not getattr(module, "is_causal", True):
        raise ValueError("swiftune packed attention is causal; this layer is bidirectional")
    if key.shape[2] != q_len or (attention_mask is not None and attention_mask.dim() != 2):
        out = _dense_attention(module, query, key, value, attention_mask, scaling, sliding_window, softcap, dropout,
                               sinks=s_aux)
        return out, None

    packed = kwargs.get(PACKED_KWARG)
    if not isinstance(packed, PackedBatch) or packed.batch_size != bsz or packed.seq_len != q_len:
        packed = build_packed_batch(bsz, q_len, kwargs.get("position_ids"), attention_mask, device=query.device)

    # [B, H, S, D] -> [B, S, H, D] is free for projections laid out as view(B, S, H, D).transpose(1, 2).
    q = packed.unpad(query.transpose(1, 2))
    k = packed.unpad(key.transpose(1, 2))
    v = packed.unpad(value.transpose(1, 2))
    if s_aux is not None:
        if softcap:
            raise ValueError("attention sinks with a soft-cap: no family has both, and no backend computes it")
        out = sink_attention(q, k, v, packed, scale=scaling, sinks=s_aux, window=sliding_window, dropout=dropout,
                             backend=packed.backend)
        return packed.pad(out), None
    # the caller projects per-document outputs itself (swiftune.attention.pieces); a padded batch cannot
    keep_pieces = bool(kwargs.get(PIECES_KWARG)) and packed.indices is None
    out = packed_attention(
        q, k, v, packed, scale=scaling, window=sliding_window, softcap=softcap, dropout=dropout, backend=packed.backend,
        keep_pieces=keep_pieces,
    )
    if isinstance(out, DocumentOutputs):
        return out, None
    return packed.pad(out), None


_NAMED_INPUTS = ("input_ids", "attention_mask", "position_ids")


class PackedContextHook:
    """Forward pre-hook of the decoder stack: compute the PackedBatch once for all layers.

    It carries the model's attention backend itself (``install_packed_context`` updates it), so
    nothing is stamped on the transformers module.
    """

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if getattr(module.config, "_attn_implementation", None) != ATTENTION_NAME:
            return None
        named = dict(zip(_NAMED_INPUTS, args))
        named.update({k: kwargs[k] for k in _NAMED_INPUTS if k in kwargs})
        ids = named.get("input_ids")
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None or ref.dim() < 2:
            return None
        bsz, seq_len = ref.shape[0], ref.shape[1]
        mask = named.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (bsz, seq_len)):
            return None  # a 4-D / per-layer-type mask, or decoding against a longer cache: layers fall back
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            return None  # decoding: queries attend to cached keys, not a packed layout
        packed = build_packed_batch(bsz, seq_len, named.get("position_ids"), mask, device=ref.device,
                                    backend=self.backend)
        kwargs = dict(kwargs)
        kwargs[PACKED_KWARG] = packed
        return args, kwargs


def packed_context_hook(decoder: nn.Module) -> PackedContextHook | None:
    """The hook :func:`install_packed_context` registered on ``decoder``, or ``None``."""
    for hook in decoder._forward_pre_hooks.values():
        if isinstance(hook, PackedContextHook):
            return hook
    return None


def install_packed_context(decoder: nn.Module, backend: str = "auto") -> None:
    """Make ``decoder`` (the model's layer stack, e.g. ``LlamaModel``) compute the packed layout
    once per forward and hand it to every layer; calling it again only updates ``backend``."""
    hook = packed_context_hook(decoder)
    if hook is None:
        decoder.register_forward_pre_hook(PackedContextHook(backend), with_kwargs=True)
    else:
        hook.backend = backend


def has_packed_context(decoder: nn.Module) -> bool:
    """Whether :func:`install_packed_context` was applied to ``decoder``."""
    return packed_context_hook(decoder) is not None
