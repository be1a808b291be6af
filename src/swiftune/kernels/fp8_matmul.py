"""Weight-only FP8 matmul for decoding: ``y = x (Q * s)^T + b``, the e4m3 weight read once.

Math. ``x`` ``[M, K]`` (bf16, fp16 or fp32), ``Q`` ``[N, K]`` e4m3 codes, ``s`` ``[N]`` float32 scales
(one per output row, :class:`swiftune.models.fp8_linear.FP8Linear`'s), ``b`` ``[N]`` optional::

    y[m, n] = round_x.dtype( s[n] * sum_k x[m, k] Q[n, k] + b[n] )       (float32 inside)

The scale of output ``n`` is constant along the summed axis, so it factors out of the sum: the kernel
multiplies by the codes themselves and scales each accumulator once, in the epilogue (``sum_k x Q s``
and ``s sum_k x Q`` differ by float32 rounding only). Every e4m3 value is exact in bf16 and fp16
(3 mantissa bits, magnitudes 2^-9 .. 448), so decoding a code to x's dtype loses nothing, and the
product of a bf16 ``x`` and a code (8 and 4 significant bits) is exact in ``tl.dot``'s float32
accumulator: the only roundings are float32 additions and the final cast. Activations are never
quantised (``torch._scaled_mm``'s path rounds them to e4m3 too). No backward: this is for decoding,
under ``torch.no_grad`` (the FP8 linear's training path keeps ``torch._scaled_mm``).

Decoding a code ``c`` (sign ``c >> 7``, exponent ``e = (c >> 3) & 15`` with bias 7, mantissa ``m = c & 7``)::

    e > 0            (-1)^sign 2^(e - 7) (1 + m / 8)   float32 bits: sign << 31 | (e + 120) << 23 | m << 20
    e = 0            (-1)^sign m 2^-9                  subnormals and +-0 (2^-6 * m / 8)
    c & 0x7F = 0x7F  NaN                               (e4m3fn has no infinities)

On GPUs with FP8 conversion instructions (compute capability >= 8.9) the kernel reads the codes as
``float8e4nv`` and converts them in hardware; elsewhere (older GPUs, and the Triton interpreter,
whose own e4m3 conversion turns the NaN codes into 480) it reads bytes (``Q.view(torch.uint8)``) and
decodes them with the integer formula above. Both give the same values (the tests check every byte).
A bf16 result is rounded to nearest even in float32 bits before the store when interpreted: the
interpreter's float32 -> bf16 cast truncates, compiled Triton's rounds.

Memory traffic. At decode ``M`` is the batch's rows (1..64) and the product is bound by reading the
weight: ``N K`` bytes of codes against ``2 M K`` bytes of x and ``2 M N`` of y (M = 64, K = N =
4096: 16.8 MB, 0.5 MB, 0.5 MB). Every code is read from HBM exactly once, so the floor is ``N K /
bandwidth``, half of a bf16 weight's. ``torch._scaled_mm`` at these M reads the same codes but adds a
launch that quantises x, and its FP8 tiles are shaped for large M. A program computes a ``[BLOCK_M,
BLOCK_N]`` tile of y (``BLOCK_M``: M to a power of two, at least 16 for ``tl.dot``) and reads x's
rows once per column tile, from L2: ``(N / BLOCK_N) 2 M K`` bytes, at most the weight's ``N K``
when ``BLOCK_N >= 2 M``, which the default tiles keep.

Split K. When the column tiles alone leave SMs idle (the k/v projections' N = 1024, or N = 4096 at
wide tiles), K is cut into ``SPLIT`` ranges: each program writes its float32 partial sums
(``4 SPLIT M N`` bytes, at most half the weight's bytes, mostly read back from L2); a second kernel
(or, with ``reduce_in_launch=True``, the program of each tile that finishes last) adds the partials in a
fixed order, scales, adds the bias and rounds, so the result is deterministic: a CUDA graph replay equals
the eager run bit for bit. The launcher reads no device value (no host sync), so the rollout engine's CUDA
graphs capture it.
"""

from __future__ import annotations

from typing import Literal

import torch

from ._fp8_common import (
    REDUCE_BLOCK,
    check_fp8_weight,
    check_no_grad,
    check_pow2,
    check_scale_and_bias,
    check_split_k,
    choose_split_k,
    split_k_ranges,
    tile_counters,
)
from .launch import Backend, check_float, choose_backend, kernel_is_interpreted, needs_int64, next_pow2, tl, triton

__all__ = ["fp8_weight_only_matmul", "fp8_weight_only_matmul_reference"]

Decode = Literal["auto", "native", "bits"]

_BLOCK_K = 128  # codes of one row a program reads per step: 128 bytes, a full cache line


def fp8_weight_only_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: ``x (Q * s)^T + b`` with the weight dequantised in float32 (float64 for a
    float64 ``x``), the result cast to ``x``'s dtype. Makes a float32 copy of the weight."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.view(torch.float8_e4m3fn).to(acc) * scale.reshape(-1, 1).to(acc)
    y = x.to(acc) @ w.t()
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


if triton is not None:

    from ._fp8_common import (
        decode_e4m3,
        load_k_step,
        output_tile,
        reduce_tile_if_last,
        split_k_reduce_kernel,
        store_partial_tile,
        store_scaled_tile,
    )

    @triton.jit
    def _fp8_wo_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, c_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
        ROUND_BF16: tl.constexpr, INT64: tl.constexpr, REDUCE_HERE: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m, offs_n, mask_m, mask_n = output_tile(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, INT64)
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_per_split
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        w_rows = w_ptr + offs_n[:, None] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            x, code = load_k_step(x_rows, w_rows, k_start + k0 + offs_k, mask_m, mask_n, K, EVEN_K)
            if NATIVE_FP8:
                w = code.to(tl.float32) if DOT_F32 else code.to(x.dtype)
            else:
                w = decode_e4m3(code)
                if not DOT_F32:
                    w = w.to(x.dtype)  # exact: every e4m3 value is a bf16 and an fp16
            if DOT_F32:  # float32 x, or the interpreter (whose half-precision arithmetic is unreliable)
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if SPLIT == 1:
            store_scaled_tile(acc, s_ptr, s_ptr, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, False,
                              HAS_BIAS, ROUND_BF16)
        else:
            store_partial_tile(p_ptr, acc, pid_k, M, N, offs_m, offs_n, mask_m, mask_n)
            if REDUCE_HERE:
                reduce_tile_if_last(p_ptr, c_ptr, pid_m * tl.num_programs(0) + pid_n, s_ptr, s_ptr, b_ptr, y_ptr,
                                    M, N, offs_m, offs_n, mask_m, mask_n, stride_ym, BLOCK_M, BLOCK_N, SPLIT,
                                    False, HAS_BIAS, ROUND_BF16)

else:  # pragma: no cover
    _fp8_wo_kernel = None


def _native_fp8(device: torch.device, interpreted: bool) -> bool:
    """Whether the GPU converts e4m3 in hardware (compute capability >= 8.9: Ada, Hopper, later)."""
    return device.type == "cuda" and not interpreted and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None, *, backend: Backend = "auto",
                           block_n: int | None = None, split_k: int | None = None, decode: Decode = "auto",
                           reduce_in_launch: bool = False, _force_int64: bool = False) -> torch.Tensor:
    """``x (Q * s)^T + b`` in ``x``'s dtype, accumulated in float32 (see the module docstring).

    ``x`` ``[..., K]`` (bf16, fp16 or fp32; the last axis contiguous), ``weight`` ``[N, K]``
    ``float8_e4m3fn`` (or its ``uint8`` view), ``scale`` ``N`` float32 values (``[N]`` or ``[N, 1]``),
    ``bias`` ``[N]`` or ``None``. Returns ``[..., N]``. Meant for few rows (decoding: ``M`` up to 64);
    larger ``M`` works, re-reading the weight once per 64 rows. No autograd.

    ``block_n`` (a power of two >= 16) and ``split_k`` (>= 1) override the tile width and the K
    split chosen from ``M``, ``N``, ``K`` and the GPU's SM count (the benchmark sweeps them);
    ``decode``: ``"native"`` (hardware e4m3 conversion, compute capability >= 8.9), ``"bits"`` (the
    integer decoding) or ``"auto"`` (native where the GPU has it); ``reduce_in_launch``: a split K's partial
    sums added by each tile's last program rather than by a second launch (the same bits, see
    :mod:`swiftune.kernels.fp8_dot`). A ``float64`` ``x`` takes the reference.
    """
    check_float("x", x)
    n, k = check_fp8_weight(weight, x)
    check_scale_and_bias(scale, bias, n)
    check_pow2("block_n", block_n, 16)
    check_split_k(split_k)
    if decode not in ("auto", "native", "bits"):
        raise ValueError(f"decode must be 'auto', 'native' or 'bits', got {decode!r}")
    check_no_grad("fp8_weight_only_matmul", x, bias)
    named = {"x": x, "weight": weight, "scale": scale}
    if bias is not None:
        named["bias"] = bias
    chosen = choose_backend(backend, _fp8_wo_kernel, named)
    if chosen == "reference" or x.dtype == torch.float64 or x.numel() == 0 or k == 0:
        return fp8_weight_only_matmul_reference(x, weight, scale, bias)
    interpreted = kernel_is_interpreted(_fp8_wo_kernel)
    native = _native_fp8(x.device, interpreted)
    if decode == "native" and not native:
        raise ValueError("decode='native' needs a CUDA GPU with FP8 conversions (compute capability >= 8.9), "
                         "not the interpreter; use decode='bits' or 'auto'")
    native = native and decode != "bits"

    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    w = weight.view(torch.float8_e4m3fn) if native else weight.view(torch.uint8)
    s = scale.reshape(-1)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(max(16, next_pow2(m)), 64)
    if block_n is None:  # BLOCK_N >= 2 M: x's L2 reads stay within the weight's bytes
        block_n = 32 if m <= 16 else 64 if m <= 32 else 128
    m_tiles, n_tiles = -(-m // block_m), -(-n // block_n)
    # a program for every SM; SPLIT <= K / (16 M) bounds the float32 partials' bytes (module docstring)
    split = split_k if split_k is not None else choose_split_k(m_tiles * n_tiles, m, k, _BLOCK_K, x.device,
                                                              sm_fill_percent=100, min_range_per_row=16)
    k_per_split, split = split_k_ranges(k, _BLOCK_K, split)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    int64 = _force_int64 or needs_int64(x2, w, y, partial)
    b = bias if bias is not None else s
    round_bf16 = interpreted and x.dtype == torch.bfloat16
    counters = tile_counters.get(x.device, n_tiles * m_tiles) if split > 1 and reduce_in_launch else None
    _fp8_wo_kernel[(n_tiles, split, m_tiles)](
        x2, w, s, b, y, partial, counters if counters is not None else s, m, n, k, x2.stride(0), w.stride(0),
        y.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, SPLIT=split, HAS_BIAS=bias is not None,
        NATIVE_FP8=native, DOT_F32=x.dtype == torch.float32 or interpreted,
        EVEN_K=k == split * k_per_split, ROUND_BF16=round_bf16, INT64=int64, REDUCE_HERE=counters is not None,
        num_warps=4, num_stages=4,
    )
    if split > 1 and counters is None:
        split_k_reduce_kernel[(-(-n // REDUCE_BLOCK), m)](
            partial, s, s, b, y, m, n, y.stride(0),
            SPLIT=split, BLOCK=REDUCE_BLOCK, HAS_ROW_SCALE=False, HAS_BIAS=bias is not None, ROUND_BF16=round_bf16,
            INT64=int64,
            num_warps=4,
        )
    return y.view(*x.shape[:-1], n)
