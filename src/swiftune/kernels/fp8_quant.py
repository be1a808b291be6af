"""Per-row (per-token) FP8 quantisation in one kernel: absmax, scale, divide, round to e4m3.

For each row ``x`` (the last axis) of length ``n``, optionally multiplied first by a float32
column vector ``c`` (the backward of an FP8 linear folds the weight's per-row scales into the
upstream gradient this way, ``g * s^T``, without a float32 copy of ``g``)::

    v     = x * c                                    (float32, one rounding; v = x when c is None)
    amax  = max_k |v_k|                              (exact)
    scale = amax / 448   if that is > 0, else 1      (float32, IEEE division; 448 = e4m3's largest finite)
    q     = _round_e4m3(clamp(v / scale, -448, 448))  (IEEE division, round to nearest even)

so that ``v ~= q * scale`` with the row's largest magnitude mapped to 448 exactly (nothing
saturates). A row of zeros (or one whose ``amax / 448`` underflows float32) gets ``scale = 1`` and
codes of zero, never a NaN. Quantisation is not differentiable (the codes are a value, not a
function anyone trains through): no backward; the FP8 linear's backward quantises its gradient
with this same kernel.

The kernel runs one program per row in two passes over the row in ``BLOCK``-wide chunks (a row
that fits one chunk is loaded once): pass one reduces ``amax``, pass two divides, rounds and
stores. It reads ``x`` once (twice from cache for wide rows) and writes 1 byte an element plus 4
bytes a row, where the unfused torch ops write and read a float32 copy of ``x``.

The rounding to e4m3 is done in float32 arithmetic before the cast (``_round_e4m3``), so the
cast only ever sees values e4m3 holds exactly: the bytes are then those of ``torch``'s
``.to(torch.float8_e4m3fn)`` on every backend. (The Triton interpreter's own float32 -> e4m3
conversion drops the carry of a rounding that overflows the mantissa, e.g. 125.4 -> 64, and rounds
ties away from zero; compiled Triton rounds correctly, but one code path is what the CPU tests
check.) Divisions use ``div_rn``: compiled Triton's ``/`` on float32 is the approximate
``div.full.f32``, which would differ from torch's IEEE division in the last bit.
"""

from __future__ import annotations

import torch

from .launch import Backend, check_float, choose_backend, needs_int64, next_pow2, tl, triton

__all__ = ["FP8_E4M3_MAX", "e4m3_codes", "e4m3_scale", "fp8_quantize_rowwise", "fp8_quantize_rowwise_reference"]

FP8_E4M3_MAX = 448.0
_MAX_BLOCK = 4096  # widest chunk one program holds in registers (Qwen3-8B's hidden size)


def fp8_quantize_rowwise_reference(x: torch.Tensor, col_scale: torch.Tensor | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch, the unfused ops: ``(q, scale)`` with ``q`` e4m3 of ``x``'s shape and ``scale``
    float32 ``[..., 1]`` (see the module docstring). Makes a float32 copy of ``x``."""
    v = x.to(torch.float32, memory_format=torch.contiguous_format)  # the codes come out row-major
    if col_scale is not None:
        v = v * col_scale.reshape(-1).to(torch.float32)
    amax = v.abs().amax(dim=-1, keepdim=True)
    # a tensor divisor: torch on CUDA turns division by a Python number into a multiply by its float32
    # reciprocal (off by an ulp about half the time); an elementwise tensor division is IEEE everywhere
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (v / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


if triton is not None:

    @triton.jit
    def _round_e4m3(v):
        """``v`` (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32."""
        bits = v.to(tl.int32, bitcast=True)
        mag_bits = bits & 0x7FFFFFFF
        sign = bits ^ mag_bits  # the sign bit alone (no 0x80000000 literal: it does not fit int32)
        # normal e4m3 (|v| >= 2^-6): keep 3 of float32's 23 mantissa bits, round to nearest even;
        # a carry out of the mantissa moves into the exponent, as it must
        kept = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & -1048576  # & 0xFFF00000
        normal = kept.to(tl.float32, bitcast=True)
        # subnormal e4m3 (|v| < 2^-6): multiples of 2^-9. Adding 2^14 (whose float32 ulp is 2^-9)
        # rounds to one of them, to nearest even; subtracting it again is exact
        mag = mag_bits.to(tl.float32, bitcast=True)
        sub = (mag + 16384.0) - 16384.0
        r = tl.where(mag < 0.015625, sub, normal)
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_scale(amax):
        """A row's scale from its largest magnitude (float32): ``amax / 448`` (IEEE division), 1 where that is 0."""
        scale = tl.math.div_rn(amax, 448.0)
        return tl.where(scale > 0.0, scale, 1.0)

    @triton.jit
    def e4m3_codes(v, scale):
        """``v / scale`` (float32, IEEE division) clamped to e4m3's range and rounded to its nearest value, in
        float32 (cast it to the codes' dtype to store)."""
        return _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0))

    @triton.jit
    def _fp8_quant_kernel(
        x_ptr, c_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q,
        BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, HAS_C: tl.constexpr, INT64: tl.constexpr,
    ):
        row = tl.program_id(0)
        if INT64:
            row = row.to(tl.int64)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * stride_q
        cols = tl.arange(0, BLOCK)
        if ONE_BLOCK:
            mask = cols < n_cols
            v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_C:
                v = v * tl.load(c_ptr + cols, mask=mask, other=0.0)
            amax = tl.max(tl.abs(v), axis=0)
        else:
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                v = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_C:
                    v = v * tl.load(c_ptr + start + cols, mask=mask, other=0.0)
                acc = tl.maximum(acc, tl.abs(v))
            amax = tl.max(acc, axis=0)
        scale = e4m3_scale(amax)
        tl.store(s_ptr + row, scale)
        if ONE_BLOCK:
            tl.store(q_row + cols, e4m3_codes(v, scale).to(q_ptr.dtype.element_ty), mask=mask)
        else:
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                v = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_C:
                    v = v * tl.load(c_ptr + start + cols, mask=mask, other=0.0)
                tl.store(q_row + start + cols, e4m3_codes(v, scale).to(q_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    _fp8_quant_kernel = _round_e4m3 = e4m3_scale = e4m3_codes = None


def fp8_quantize_rowwise(x: torch.Tensor, col_scale: torch.Tensor | None = None, *,
                         backend: Backend = "auto", _force_int64: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``x * col_scale ~= q * scale``: ``q`` ``float8_e4m3fn`` of ``x``'s shape
    (contiguous), ``scale`` float32 ``[..., 1]``, one scale per row (the last axis).

    ``col_scale``: optional float32-castable vector of ``x.shape[-1]`` multiplied in first (in
    float32). Finite inputs only (a NaN or inf gives an undefined row). No autograd. The bytes
    equal :func:`fp8_quantize_rowwise_reference`'s on every backend.
    """
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension to quantise per row, got shape {tuple(x.shape)}")
    n_cols = x.shape[-1]
    named = {"x": x}
    if col_scale is not None:
        check_float("col_scale", col_scale)
        if col_scale.numel() != n_cols:
            raise ValueError(f"col_scale must have x's last dimension ({n_cols}) elements, got {tuple(col_scale.shape)}")
        named["col_scale"] = col_scale
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("fp8_quantize_rowwise has no backward: quantise a detached tensor (or under no_grad)")
    if choose_backend(backend, _fp8_quant_kernel, named) == "reference":
        return fp8_quantize_rowwise_reference(x, col_scale)
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return q, scale
    c = col_scale.reshape(-1).to(torch.float32).contiguous() if col_scale is not None else x2
    block = min(next_pow2(n_cols), _MAX_BLOCK)
    _fp8_quant_kernel[(n_rows,)](
        x2, c, q, scale, n_cols, x2.stride(0), n_cols,
        BLOCK=block, ONE_BLOCK=n_cols <= block, HAS_C=col_scale is not None,
        INT64=_force_int64 or needs_int64(x2, q), num_warps=4 if block <= 1024 else 8,
    )
    return q, scale
