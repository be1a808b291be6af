"""A LoRA adapter's product added to its base product in two kernel launches, for decode steps (a few rows).

For ``x [M, K]`` (the projection's input), ``A [R, K]``, ``B [N, R]`` (the adapter's weights, both in the
adapter's dtype) and the base product ``y [M, N]``::

    h = round_a(x A^T)                 (x cast to A's dtype, exact for bf16 -> float32; float32 accumulation)
    y = round_y(y + scaling * (h B^T))  (float32 accumulation, one rounding to y's dtype)

which is what swiftune's LoRA forward computes in two matmuls and, for float32 adapters over bf16 bases (PEFT's
default), three casts around an ``addmm``: ``addmm(y.float(), h, B^T, alpha=scaling).to(y.dtype)``. Run as those
ops, an adapted projection costs five launches a decode step; at a few rows each is a few microseconds of
almost no work, so they, not bytes, make a runtime-adapted decode step slower than a merged one. Here it is two:

* down: one program per block of 16 rows and ``BLOCK_K`` input columns writes its part of ``x A^T`` (float32,
  ``[K / BLOCK_K, M, R]``): the ``K`` sum spread over as many programs as there are blocks of ``K``;
* up: one program per block of 16 rows and ``BLOCK_N`` output columns sums the parts into its rows of ``h``,
  rounds them to the adapter's dtype, multiplies its columns of ``B`` and rewrites its block of ``y`` in place
  (``y`` may be a column slice of a wider product: rows ``stride`` apart).

One launch, each column block summing ``x A^T`` over all of ``K`` itself, repeats that sum ``N / BLOCK_N`` times
in serial loops; with float32 adapters, on the FMA units, it was slower than the five ops (docs/rollout.md).
The sums run in another order than cuBLAS', so results equal the ops' to float32 rounding before the final
rounding (a bf16 result can differ by an ulp where that rounding is near a tie). Float32 operands multiply in
IEEE float32 (``input_precision="ieee"``: not TF32, which torch's float32 ``mm`` does not use either); bf16
adapters on the tensor cores, float32 accumulation. No autograd (decode steps run under ``no_grad``).
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
    def _lora_down_kernel(x_ptr, a_ptr, part_ptr, M, K, R, s_x, s_a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_R: tl.constexpr, F32: tl.constexpr):
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        ranks = tl.arange(0, BLOCK_R)
        k_ok = ks < K
        xt = tl.load(x_ptr + rows[:, None] * s_x + ks[None, :], mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + ranks[:, None] * s_a + ks[None, :], mask=(ranks < R)[:, None] & k_ok[None, :], other=0.0)
        xt = xt.to(a_ptr.dtype.element_ty)  # x as the adapter's dtype (exact from bf16 to float32)
        if F32:  # float32 operands, IEEE products (a bf16 adapter's products are exact in float32)
            h = tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
        else:
            h = tl.dot(xt, tl.trans(at))
        # part [K blocks, M blocks x BLOCK_M, BLOCK_R]: padded rows and ranks hold zeros, read by no one
        base = (tl.program_id(0) * tl.num_programs(1) * BLOCK_M + rows) * BLOCK_R
        tl.store(part_ptr + base[:, None] + ranks[None, :], h)

    @triton.jit
    def _lora_up_add_kernel(part_ptr, b_ptr, y_ptr, M, N, R, k_blocks, s_b, s_y, scaling, BLOCK_M: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        row_ok, col_ok = rows < M, cols < N
        padded_rows = tl.num_programs(1) * BLOCK_M
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for kb in range(0, k_blocks):
            h += tl.load(part_ptr + ((kb * padded_rows + rows) * BLOCK_R)[:, None] + ranks[None, :])
        h = h.to(b_ptr.dtype.element_ty)  # as torch.mm's result in the adapter's dtype
        bt = tl.load(b_ptr + cols[None, :] * s_b + ranks[:, None], mask=(ranks < R)[:, None] & col_ok[None, :],
                     other=0.0)
        if F32:
            d = tl.dot(h.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(h, bt)
        y_at = y_ptr + rows[:, None] * s_y + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + scaling * d).to(y_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    _lora_down_kernel = _lora_up_add_kernel = None


def lora_decode_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, *,
                     backend: Backend = "auto") -> torch.Tensor:
    """``y`` rewritten in place with ``y + scaling * (x A^T) B^T`` (module docstring, two launches) and returned.

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
    if choose_backend(backend, _lora_down_kernel, {"y": y, "x": x, "a": a, "b": b}) == "reference":
        return lora_decode_add_reference(y, x, a, b, scaling)
    if m == 0 or n == 0:
        return y
    x, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, a, b))
    if y.stride(-1) != 1:
        raise ValueError("y must have a unit column stride (a row-major product or a column slice of one)")
    # 16 rows a program (tl.dot's least; up to 64 rows, four blocks side by side)
    row_blocks, k_blocks, block_r = triton.cdiv(m, _BLOCK_M), triton.cdiv(k, _BLOCK_K), max(16, next_pow2(r))
    # float32 adapters multiply in IEEE float32 (not TF32); so does everything under the interpreter, whose bf16
    # dot is not the compiled one's
    f32 = a.dtype == torch.float32 or kernel_is_interpreted(_lora_down_kernel)
    parts = torch.empty(k_blocks, row_blocks * _BLOCK_M, block_r, dtype=torch.float32, device=y.device)
    _lora_down_kernel[(k_blocks, row_blocks)](
        x, a, parts, m, k, r, x.stride(0), a.stride(0), BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K, BLOCK_R=block_r, F32=f32,
        num_warps=4,
    )
    _lora_up_add_kernel[(triton.cdiv(n, _BLOCK_N), row_blocks)](
        parts, b, y, m, n, r, k_blocks, b.stride(0), y.stride(0), float(scaling), BLOCK_M=_BLOCK_M, BLOCK_R=block_r,
        BLOCK_N=_BLOCK_N, F32=f32, num_warps=4,
    )
    return y
