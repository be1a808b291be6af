"""Deprecated alias of swiftune.rl.rollout.layers; removed after the next release."""

from .rollout.layers import PRE_NORM_FAMILIES, decode_attention, fused_prenorm_supported, prenorm_layers

__all__ = ["PRE_NORM_FAMILIES", "decode_attention", "fused_prenorm_supported", "prenorm_layers"]
