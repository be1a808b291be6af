"""Fused Triton kernels, each with a plain-PyTorch reference and a backward pass."""

from .glu import geglu, geglu_reference, swiglu, swiglu_reference
from .rms_norm import rms_norm, rms_norm_reference
from .rope import rope_qk, rope_qk_reference

__all__ = [
    "geglu",
    "geglu_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope_qk",
    "rope_qk_reference",
    "swiglu",
    "swiglu_reference",
]
