"""Shared launch-time helpers for swiftune's Triton kernels.

Three ways to run every kernel:

* CUDA tensors           -> the compiled Triton kernel;
* CPU tensors, interpreter -> the same Triton kernel through ``TRITON_INTERPRET=1``
  (used by the tests; the variable must be set before swiftune is imported,
  because ``triton.jit`` decides at decoration time what a kernel is);
* CPU tensors, otherwise -> the plain-PyTorch reference (fast on CPU).

Nothing here reads environment variables at call time: whether the kernels are
interpreted is a property of the decorated kernel object itself.
"""

from __future__ import annotations

from typing import Literal

import torch

try:  # Triton is Linux-only; everything still works through the references without it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

Backend = Literal["auto", "triton", "reference"]

INT32_MAX = 2**31 - 1


def kernel_is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated while ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    if not HAS_TRITON:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(kernel, InterpretedFunction)


def max_offset(t: torch.Tensor) -> int:
    """Largest element offset a kernel computes into ``t`` (covers non-contiguous views)."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether any tensor's offsets overflow int32: then kernels compile their 64-bit variant."""
    return any(max(t.numel(), max_offset(t)) > INT32_MAX for t in tensors)


def choose_backend(backend: Backend, kernel: object, named: dict[str, torch.Tensor]) -> str:
    """Resolve ``backend`` for tensors ``named`` (argument name -> tensor).

    Returns ``"triton"`` or ``"reference"``; raises a ``ValueError`` naming the argument when the
    request cannot be met (mixed devices, CPU tensors for a compiled kernel). ``"auto"`` takes the
    reference for float64 tensors (the kernels compute in float32).
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    items = list(named.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}: move them to one device"
            )
    if backend == "reference":
        return "reference"
    if backend == "auto" and any(t.dtype == torch.float64 for _, t in items):
        return "reference"  # the kernels compute in float32; float64 inputs get float64 math, as the losses do
    if first.device.type == "cuda":
        if not HAS_TRITON:
            if backend == "triton":
                raise ValueError("backend='triton' needs the triton package; install it or use backend='reference'")
            return "reference"
        if kernel_is_interpreted(kernel):
            raise ValueError(
                f"{first_name} is a CUDA tensor but TRITON_INTERPRET=1 was set when swiftune was imported; "
                "unset it to run compiled kernels"
            )
        return "triton"
    if first.device.type == "cpu" and kernel_is_interpreted(kernel):
        return "triton"
    if backend == "triton":
        raise ValueError(
            f"{first_name} is on {first.device}: the Triton kernel runs on CUDA tensors, or on CPU tensors only "
            "when TRITON_INTERPRET=1 is set before importing swiftune; use backend='reference' on CPU"
        )
    return "reference"


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{name} must be a floating tensor (fp16, bf16, fp32 or fp64), got {t.dtype}")


def autograd_owner(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor that owns ``t``'s memory *as autograd tracks it*, or ``None`` when an in-place
    kernel must not write it.

    An in-place kernel wrapped in an ``autograd.Function`` may write a view's owner only when a
    write to the owner is replayed onto the view's history. That holds for a view made in grad
    mode by an ordinary differentiable op (``view``, ``transpose``, ...: creation meta
    ``DEFAULT``) of an owner that requires grad exactly when the view does. It does not hold for
    a view returned by a custom Function (its ``_base`` is a tensor made inside ``forward``,
    outside the graph: writing it would cut the view's gradient off), nor for views made under
    ``no_grad`` of tensors that require grad. Leaves that require grad are never written.
    Tensors outside autograd (``no_grad`` decoding) are their own owners when not a view.
    """
    needs_grad = torch.is_grad_enabled() and t.requires_grad
    if t.is_leaf and t.requires_grad:
        return None
    if not t._is_view():
        return t
    base = t._base
    if base.is_leaf and base.requires_grad:
        return None
    if base.requires_grad != t.requires_grad:
        return None
    if needs_grad:
        if base.grad_fn is None or _creation_meta(t) != "DEFAULT":
            return None
    return base


def _creation_meta(t: torch.Tensor) -> str:
    """Autograd's record of how view ``t`` was made (``DEFAULT`` for ordinary differentiable
    views); ``"UNKNOWN"`` where this torch has no such query, which callers treat as unsafe."""
    query = getattr(torch._C._autograd, "_get_creation_meta", None)
    if query is None:  # pragma: no cover - present in every supported torch (2.11-2.14)
        return "UNKNOWN"
    return str(query(t)).rsplit(".", 1)[-1]


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
