"""Model layer: patch transformers models in place, load them, add LoRA adapters, and the
memory savers for long contexts (offloaded checkpointing, tiled MLP)."""

from .checkpointing import (
    CheckpointBudgetError,
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    offload_stats,
    release_host_memory,
)
from .loading import FastModel, enable_gradient_checkpointing, ensure_pad_token
from .patching import FAMILIES, causal_lm_of, is_patched, patch_model, unpatch_model
from .tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, tiled_mlp_forward

__all__ = [
    "FAMILIES",
    "CheckpointBudgetError",
    "FastModel",
    "causal_lm_of",
    "disable_offloaded_checkpointing",
    "disable_tiled_mlp",
    "enable_gradient_checkpointing",
    "enable_offloaded_checkpointing",
    "enable_tiled_mlp",
    "ensure_pad_token",
    "is_patched",
    "offload_stats",
    "patch_model",
    "release_host_memory",
    "tiled_mlp_forward",
    "unpatch_model",
]
