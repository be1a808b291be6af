"""Packed, contamination-free attention: no token attends across a document boundary.

``cu_seqlens`` comes from ``position_ids`` (restarting at every document) or from a 2-D padding
mask, once per forward; the GPU backends (``varlen``, ``flash_attn``, ``flex``) cost O(T) memory.

Modules, lowest first: :mod:`.kernel_choice` (which kernel ``auto`` takes for a layout),
:mod:`.packing` (the document layout), :mod:`.backends` (the kernels), :mod:`.hf` (packed
attention as a transformers attention function), :mod:`.shared_prompt` (GRPO's shared-prompt
rows), :mod:`.kv_cache` (the rollout engine's cache attention) and :mod:`.registry` (every
registration with transformers).
"""

from .backends import BACKENDS, backend_available, packed_attention, resolve_backend
from .hf import (
    ATTENTION_NAME,
    PACKED_KWARG,
    has_packed_context,
    install_packed_context,
    packed_attention_forward,
    packed_attention_mask,
)
from .packing import PackedBatch, build_packed_batch, cu_seqlens_from_position_ids
from .registry import (
    GRPO_ATTENTION_NAME,
    PACKED_ATTENTION_IMPLEMENTATIONS,
    ROLLOUT_ATTENTION_NAME,
    register_grpo_attention,
    register_packed_attention,
    register_rollout_attention,
)
from .shared_prompt import LAYOUT_KWARG, RowLayout, grpo_attention_forward

__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "GRPO_ATTENTION_NAME",
    "LAYOUT_KWARG",
    "PACKED_ATTENTION_IMPLEMENTATIONS",
    "PACKED_KWARG",
    "PackedBatch",
    "ROLLOUT_ATTENTION_NAME",
    "RowLayout",
    "backend_available",
    "build_packed_batch",
    "cu_seqlens_from_position_ids",
    "grpo_attention_forward",
    "has_packed_context",
    "install_packed_context",
    "packed_attention",
    "packed_attention_forward",
    "packed_attention_mask",
    "register_grpo_attention",
    "register_packed_attention",
    "register_rollout_attention",
    "resolve_backend",
]
