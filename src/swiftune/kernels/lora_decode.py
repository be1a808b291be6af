"""A LoRA adapter's product added to its base product in one kernel, for decode steps (a few rows).

For ``x [M, K]`` (the projection's input), ``A [R, K]``, ``B [N, R]`` (the adapter's weights, both in the
adapter's dtype) and the base product ``y [M, N]``::

    h = round_a(x A^T)                 (x cast to A's dtype, exact for bf16 -> float32; float32 accumulation)
    y = round_y(y + scaling * (h B^T))  (float32 accumulation, one rounding to y's dtype)

which is what swiftune's LoRA forward computes in two matmuls and, for float32 adapters over bf16 bases (PEFT's
default), three casts around an ``addmm``: ``addmm(y.float(), h, B^T, alpha=scaling).to(y.dtype)``. Run as those
ops, an adapted projection costs five launches a decode step; at a few rows each is a few microseconds of
almost no work, so they, not bytes, make a runtime-adapted decode step slower than a merged one. Here it is one.

One program per block of ``BLOCK_N`` output columns and of 16 rows: it accumulates its rows of ``h`` itself
(``K / BLOCK_K`` steps over ``x`` and ``A``; the programs of a row block read the same ``x`` and ``A``, from L2
after the first), then its columns of ``h B^T``, and rewrites its block of ``y`` in place
(``y`` may be a column slice of a wider product: rows ``stride`` apart). The sums run in another order than
cuBLAS', so results equal the ops' to float32 rounding before the final rounding (a bf16 result can differ by
an ulp where that rounding is near a tie). Float32 operands multiply in IEEE float32 (``input_precision="ieee"``:
not TF32, which torch's float32 ``mm`` does not use either); bf16 adapters on the tensor cores, float32
accumulation. No autograd (decode steps run under ``no_grad``).
"""

from __future__ import annotations

import torch

from .launch import Backend, choose_backend, kernel_is_interpreted, next_pow2, tl, triton

__all__ = ["LORA_DECODE_MAX_ROWS", "lora_decode_add_", "lora_decode_add_reference"]

#: most rows (tokens) one call takes: the decode steps' range
LORA_DECODE_MAX_ROWS = 64
_BLOCK_M = 16
_BLOCK_N = 128
_BLOCK_K = 128


def lora_decode_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              scaling: float) -> torch.Tensor:
    """Plain PyTorch, the ops the kernel replaces: ``y`` rewritten with ``y + scaling * (x A^T) B^T`` (module
    docstring); returns ``y``."""
    h = torch.mm(x.to(a.dtype), a.t())
    y.copy_(torch.addmm(y.to(a.dtype), h, b.t(), alpha=scaling))
    return y


if triton is not None:

    @triton.jit
    def _lora_decode_kernel(x_ptr, a_ptr, b_ptr, y_ptr, M, K, N, R, s_x, s_a, s_b, s_y, scaling,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_N: tl.constexpr, F32: tl.constexpr):
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        row_ok, col_ok, rank_ok = rows < M, cols < N, ranks < R
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xt = tl.load(x_ptr + rows[:, None] * s_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptr + ranks[:, None] * s_a + ks[None, :], mask=rank_ok[:, None] & k_ok[None, :], other=0.0)
            xt = xt.to(a_ptr.dtype.element_ty)  # x as the adapter's dtype (exact from bf16 to float32)
            if F32:  # float32 operands, IEEE products (a bf16 adapter's products are exact in float32)
                h += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
            else:
                h += tl.dot(xt, tl.trans(at))
        h = h.to(a_ptr.dtype.element_ty)  # as torch.mm's result in the adapter's dtype
        bt = tl.load(b_ptr + cols[None, :] * s_b + ranks[:, None], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        if F32:
            d = tl.dot(h.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(h, bt)
        y_at = y_ptr + rows[:, None] * s_y + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + scaling * d).to(y_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    _lora_decode_kernel = None


def lora_decode_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, *,
                     backend: Backend = "auto") -> torch.Tensor:
    """``y`` rewritten in place with ``y + scaling * (x A^T) B^T`` (module docstring) and returned.

    ``y`` ``[M, N]`` (bf16, fp16 or fp32; unit column stride, any row stride: a column slice of a wider product
    is fine), ``x`` ``[M, K]`` (a float dtype that casts exactly to the adapter's, or the adapter's), ``a``
    ``[R, K]`` and ``b`` ``[N, R]`` in one float dtype (the adapter's), ``M`` at most
    :data:`LORA_DECODE_MAX_ROWS`. No autograd."""
    if y.dim() != 2 or x.dim() != 2 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"y, x, a, b must be 2-D, got {y.dim()}, {x.dim()}, {a.dim()}, {b.dim()} dimensions")
    (m, n), (r, k) = y.shape, a.shape
    if x.shape != (m, k) or b.shape != (n, r):
        raise ValueError(f"shapes do not chain: y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)} (want x [M, K], a [R, K], b [N, R], y [M, N])")
    if a.dtype != b.dtype or not a.is_floating_point():
        raise TypeError(f"a and b must share one float dtype (the adapter's), got {a.dtype} and {b.dtype}")
    if m > LORA_DECODE_MAX_ROWS:
        raise ValueError(f"lora_decode_add_ takes at most {LORA_DECODE_MAX_ROWS} rows (decode steps), got {m}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (y, x, a, b)):
        raise RuntimeError("lora_decode_add_ has no backward: call it under torch.no_grad() (decoding)")
    if choose_backend(backend, _lora_decode_kernel, {"y": y, "x": x, "a": a, "b": b}) == "reference":
        return lora_decode_add_reference(y, x, a, b, scaling)
    if m == 0 or n == 0:
        return y
    x, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, a, b))
    if y.stride(-1) != 1:
        raise ValueError("y must have a unit column stride (a row-major product or a column slice of one)")
    # 16 rows a program (tl.dot's least): each program's K loop costs the same at 8 rows or 64, more rows take
    # more programs side by side (float32 adapters' IEEE products run on the FMA units: per-program work is latency)
    _lora_decode_kernel[(triton.cdiv(n, _BLOCK_N), triton.cdiv(m, _BLOCK_M))](
        x, a, b, y, m, k, n, r, x.stride(0), a.stride(0), b.stride(0), y.stride(0), float(scaling),
        BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K, BLOCK_R=max(16, next_pow2(r)), BLOCK_N=_BLOCK_N,
        # float32 adapters multiply in IEEE float32 (not TF32); so does everything under the interpreter, whose
        # bf16 dot is not the compiled one's
        F32=a.dtype == torch.float32 or kernel_is_interpreted(_lora_decode_kernel), num_warps=4,
    )
    return y
