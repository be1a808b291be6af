"""Deprecated alias of swiftune.kernels.launch; removed after the next release."""

from .launch import (  # noqa: F401
    HAS_TRITON,
    INT32_MAX,
    Backend,
    autograd_owner,
    check_float,
    choose_backend,
    kernel_is_interpreted,
    max_offset,
    needs_int64,
    next_pow2,
    tl,
    triton,
)
