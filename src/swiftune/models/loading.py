"""Deprecated alias of swiftune.training.loading; removed after the next release."""

from ..training.loading import (  # noqa: F401
    FastModel,
    default_dtype,
    enable_gradient_checkpointing,
    ensure_pad_token,
    first_nonfinite_tensor,
)
