"""Model layer: patch transformers models in place (fused kernels, packed attention) and the
tiled MLP, a module transformation for long contexts.

Loading, LoRA adapters and offloaded checkpointing are training runtime
(:mod:`swiftune.training`); the names below that come from there are deprecated aliases, resolved
on first use so that this package never imports the layer above it at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

from .patching import FAMILIES, causal_lm_of, is_patched, patch_model, unpatch_model
from .tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, tiled_mlp_forward

# Deprecated: moved to swiftune.training; removed after the next release.
_MOVED_TO_TRAINING = {
    "CheckpointBudgetError": "swiftune.training.checkpointing",
    "disable_offloaded_checkpointing": "swiftune.training.checkpointing",
    "enable_offloaded_checkpointing": "swiftune.training.checkpointing",
    "offload_stats": "swiftune.training.checkpointing",
    "release_host_memory": "swiftune.training.checkpointing",
    "FastModel": "swiftune.training.loading",
    "enable_gradient_checkpointing": "swiftune.training.loading",
    "ensure_pad_token": "swiftune.training.loading",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_TRAINING:
        return getattr(importlib.import_module(_MOVED_TO_TRAINING[name]), name)
    raise AttributeError(f"module 'swiftune.models' has no attribute {name!r}")


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
