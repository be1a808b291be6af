"""Fused Triton kernels, each with a plain-PyTorch reference and (but ``add_rms_norm``, a
decoding-only kernel) a backward pass."""

from .glu import geglu, geglu_reference, swiglu, swiglu_reference
from .rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from .rope import rope_qk, rope_qk_reference

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "geglu",
    "geglu_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope_qk",
    "rope_qk_reference",
    "swiglu",
    "swiglu_reference",
]
