"""Fused Triton kernels, each with a plain-PyTorch reference and a backward pass, but for the
decoding-only kernels ``add_rms_norm`` / ``add_rms_norm_fp8``, ``decode_qkv``, ``fp8_weight_only_matmul``, ``glu_fp8``,
``lora_decode_add_`` and ``nf4_weight_only_matmul`` (no autograd)."""

from .decode_qkv import decode_qkv, decode_qkv_reference
from .fp8_matmul import fp8_weight_only_matmul, fp8_weight_only_matmul_reference
from .fp8_quant import fp8_quantize_rowwise, fp8_quantize_rowwise_reference
from .lora_decode import lora_decode_add_, lora_decode_add_reference
from .nf4_matmul import NF4Weight, nf4_weight_only_matmul, nf4_weight_only_matmul_reference
from .glu import gated_linear_unit, geglu, geglu_reference, glu_fp8, swiglu, swiglu_reference
from .rms_norm import add_rms_norm, add_rms_norm_fp8, add_rms_norm_reference, rms_norm, rms_norm_reference
from .rope import rope_qk, rope_qk_reference

__all__ = [
    "add_rms_norm",
    "add_rms_norm_fp8",
    "add_rms_norm_reference",
    "decode_qkv",
    "decode_qkv_reference",
    "fp8_weight_only_matmul",
    "fp8_weight_only_matmul_reference",
    "fp8_quantize_rowwise",
    "fp8_quantize_rowwise_reference",
    "lora_decode_add_",
    "lora_decode_add_reference",
    "NF4Weight",
    "nf4_weight_only_matmul",
    "nf4_weight_only_matmul_reference",
    "geglu",
    "geglu_reference",
    "gated_linear_unit",
    "glu_fp8",
    "rms_norm",
    "rms_norm_reference",
    "rope_qk",
    "rope_qk_reference",
    "swiglu",
    "swiglu_reference",
]
