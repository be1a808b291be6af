"""Packed, contamination-free attention: no token attends across a document boundary.

``cu_seqlens`` comes from ``position_ids`` (restarting at every document) or from a 2-D padding
mask, once per forward; the GPU backends (``varlen``, ``flash_attn``, ``flex``) cost O(T) memory.
"""

from .backends import BACKENDS, backend_available, packed_attention, resolve_backend
from .hf import (
    ATTENTION_NAME,
    PACKED_KWARG,
    has_packed_context,
    install_packed_context,
    packed_attention_forward,
    packed_attention_mask,
    register_packed_attention,
)
from .packing import PackedBatch, build_packed_batch, cu_seqlens_from_position_ids

__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "PACKED_KWARG",
    "PackedBatch",
    "backend_available",
    "build_packed_batch",
    "cu_seqlens_from_position_ids",
    "has_packed_context",
    "install_packed_context",
    "packed_attention",
    "packed_attention_forward",
    "packed_attention_mask",
    "register_packed_attention",
    "resolve_backend",
]
