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
(``4 SPLIT M N`` bytes, at most half the weight's bytes, mostly read back from L2) and a second
kernel adds the partials in a fixed order, scales, adds the bias and rounds. No atomics, so the result is
deterministic: a CUDA graph replay equals the eager run bit for bit. The launcher reads no device
value (no host sync), so the rollout engine's CUDA graphs capture it.
"""

from __future__ import annotations

from typing import Literal

import torch

from .launch import Backend, check_float, choose_backend, kernel_is_interpreted, needs_int64, next_pow2, tl, triton

__all__ = ["fp8_weight_only_matmul", "fp8_weight_only_matmul_reference"]

Decode = Literal["auto", "native", "bits"]

_BLOCK_K = 128  # codes of one row a program reads per step: 128 bytes, a full cache line
_MIN_K_BLOCKS_PER_SPLIT = 4  # a K range of at least 4 steps keeps the loop pipelined
_REDUCE_BLOCK = 1024  # columns one program of the split-K reduction adds


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

    @triton.jit
    def _decode_e4m3(code):
        """e4m3fn bytes (``uint8``) to their float32 values, exactly (see the module docstring)."""
        c = code.to(tl.int32) & 0xFF
        mag = c & 0x7F
        e = mag >> 3
        m = mag & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        nan = tl.full(v.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
        v = tl.where(mag == 0x7F, nan, v)
        return tl.where(c >= 0x80, -v, v)

    @triton.jit
    def _round_to_bf16(v):
        """float32 ``v`` rounded to the nearest bf16, ties to even, still in float32 (finite ``v``):
        the interpreter's own float32 -> bf16 cast truncates, compiled Triton's rounds; with this
        the cast that follows is exact on both."""
        bits = v.to(tl.int32, bitcast=True)
        kept = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # & 0xFFFF0000
        return kept.to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_wo_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
        ROUND_BF16: tl.constexpr, INT64: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        if INT64:
            offs_m = offs_m.to(tl.int64)
            offs_n = offs_n.to(tl.int64)
        mask_m = offs_m < M
        mask_n = offs_n < N
        k_start = pid_k * k_per_split
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        w_rows = w_ptr + offs_n[:, None] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            kk = k_start + k0 + offs_k
            if EVEN_K:
                x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None], other=0.0)
                code = tl.load(w_rows + kk[None, :], mask=mask_n[:, None], other=0.0)
            else:
                in_k = kk[None, :] < K
                x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & in_k, other=0.0)
                code = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & in_k, other=0.0)
            if NATIVE_FP8:
                w = code.to(tl.float32) if DOT_F32 else code.to(x.dtype)
            else:
                w = _decode_e4m3(code)
                if not DOT_F32:
                    w = w.to(x.dtype)  # exact: every e4m3 value is a bf16 and an fp16
            if DOT_F32:  # float32 x, or the interpreter (whose half-precision arithmetic is unreliable)
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if SPLIT == 1:
            y = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if ROUND_BF16:
                y = _round_to_bf16(y)
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])
        else:
            part = p_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
            tl.store(part, acc, mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _split_k_reduce_kernel(
        p_ptr, s_ptr, xs_ptr, b_ptr, y_ptr, M, N, stride_ym,
        SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        ROUND_BF16: tl.constexpr, INT64: tl.constexpr,
    ):
        """``y[row, cols] = round(s[cols] (xs[row]) sum_i partial[i, row, cols] + b[cols])``, the partial
        sums added in a fixed order; ``xs``: the row scales of quantised activations
        (:mod:`swiftune.kernels.fp8_dot`), absent for the weight-only kernel."""
        row = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if INT64:
            row = row.to(tl.int64)
            cols = cols.to(tl.int64)
        mask = cols < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.static_range(SPLIT):  # a fixed order: deterministic sums
            acc += tl.load(p_ptr + (i * M + row) * N + cols, mask=mask, other=0.0)
        y = acc * tl.load(s_ptr + cols, mask=mask, other=0.0)
        if HAS_ROW_SCALE:
            y = y * tl.load(xs_ptr + row)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND_BF16:
            y = _round_to_bf16(y)
        tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    _fp8_wo_kernel = None


def _choose_split(tiles: int, m: int, k: int, device: torch.device) -> int:
    """Smallest power-of-two split of K that gives every SM a program, while each range keeps
    :data:`_MIN_K_BLOCKS_PER_SPLIT` steps and the partials (``4 SPLIT M N`` bytes, written and read
    once, mostly in L2) stay within half the weight's ``N K`` bytes (``SPLIT <= K / (16 M)``)."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: nothing to fill
    sms = torch.cuda.get_device_properties(device).multi_processor_count  # cached by torch: no sync
    k_blocks = -(-k // _BLOCK_K)
    split = 1
    while (tiles * split < sms and (split * 2) * _MIN_K_BLOCKS_PER_SPLIT <= k_blocks
           and split * 2 * 16 * m <= k):
        split *= 2
    return split


def _native_fp8(device: torch.device, interpreted: bool) -> bool:
    """Whether the GPU converts e4m3 in hardware (compute capability >= 8.9: Ada, Hopper, later)."""
    return device.type == "cuda" and not interpreted and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None, *, backend: Backend = "auto",
                           block_n: int | None = None, split_k: int | None = None, decode: Decode = "auto",
                           _force_int64: bool = False) -> torch.Tensor:
    """``x (Q * s)^T + b`` in ``x``'s dtype, accumulated in float32 (see the module docstring).

    ``x`` ``[..., K]`` (bf16, fp16 or fp32; the last axis contiguous), ``weight`` ``[N, K]``
    ``float8_e4m3fn`` (or its ``uint8`` view), ``scale`` ``N`` float32 values (``[N]`` or ``[N, 1]``),
    ``bias`` ``[N]`` or ``None``. Returns ``[..., N]``. Meant for few rows (decoding: ``M`` up to 64);
    larger ``M`` works, re-reading the weight once per 64 rows. No autograd.

    ``block_n`` (a power of two >= 16) and ``split_k`` (>= 1) override the tile width and the K
    split chosen from ``M``, ``N``, ``K`` and the GPU's SM count (the benchmark sweeps them);
    ``decode``: ``"native"`` (hardware e4m3 conversion, compute capability >= 8.9), ``"bits"`` (the
    integer decoding) or ``"auto"`` (native where the GPU has it). A ``float64`` ``x`` takes the
    reference.
    """
    check_float("x", x)
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-D float8_e4m3fn tensor (or its uint8 view), got {weight.dtype} "
                        f"of shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x's last dimension must be the weight's in_features ({k}), got shape {tuple(x.shape)}")
    if scale.dtype != torch.float32 or scale.numel() != n:
        raise ValueError(f"scale must hold one float32 value per output row ({n}), got {scale.dtype} "
                         f"of shape {tuple(scale.shape)}")
    if bias is not None:
        check_float("bias", bias)
        if bias.numel() != n:
            raise ValueError(f"bias must have the weight's out_features ({n}) elements, got {tuple(bias.shape)}")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    if decode not in ("auto", "native", "bits"):
        raise ValueError(f"decode must be 'auto', 'native' or 'bits', got {decode!r}")
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        raise RuntimeError("fp8_weight_only_matmul has no backward: call it under torch.no_grad() (decoding)")
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
    split = split_k if split_k is not None else _choose_split(m_tiles * n_tiles, m, k, x.device)
    k_per_split = -(-(-(-k // _BLOCK_K)) // split) * _BLOCK_K  # whole BLOCK_K steps per range
    split = -(-k // k_per_split)  # ranges past K would only add zeros
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    int64 = _force_int64 or needs_int64(x2, w, y, partial)
    b = bias if bias is not None else s
    round_bf16 = interpreted and x.dtype == torch.bfloat16
    _fp8_wo_kernel[(n_tiles, split, m_tiles)](
        x2, w, s, b, y, partial, m, n, k, x2.stride(0), w.stride(0), y.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, SPLIT=split, HAS_BIAS=bias is not None,
        NATIVE_FP8=native, DOT_F32=x.dtype == torch.float32 or interpreted,
        EVEN_K=k == split * k_per_split, ROUND_BF16=round_bf16, INT64=int64, num_warps=4, num_stages=4,
    )
    if split > 1:
        _split_k_reduce_kernel[(-(-n // _REDUCE_BLOCK), m)](
            partial, s, s, b, y, m, n, y.stride(0),
            SPLIT=split, BLOCK=_REDUCE_BLOCK, HAS_ROW_SCALE=False, HAS_BIAS=bias is not None, ROUND_BF16=round_bf16,
            INT64=int64,
            num_warps=4,
        )
    return y.view(*x.shape[:-1], n)
