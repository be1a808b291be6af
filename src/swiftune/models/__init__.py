"""Model layer: patch transformers models in place (fused kernels, packed attention) and the
tiled MLP, a module transformation for long contexts.

Loading, LoRA adapters and offloaded checkpointing are training runtime
(:mod:`swiftune.training`), the layer above this one.
"""

from __future__ import annotations

from .families import FAMILIES
from .patching import causal_lm_of, is_patched, patch_model, unpatch_model
from .tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, tiled_mlp_forward

__all__ = [
    "FAMILIES",
    "causal_lm_of",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
    "is_patched",
    "patch_model",
    "tiled_mlp_forward",
    "unpatch_model",
]
