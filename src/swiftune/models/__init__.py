"""Model layer: patch transformers models in place, load them, add LoRA adapters."""

from .loading import FastModel, enable_gradient_checkpointing, ensure_pad_token
from .patching import FAMILIES, is_patched, patch_model, unpatch_model

__all__ = [
    "FAMILIES",
    "FastModel",
    "enable_gradient_checkpointing",
    "ensure_pad_token",
    "is_patched",
    "patch_model",
    "unpatch_model",
]
