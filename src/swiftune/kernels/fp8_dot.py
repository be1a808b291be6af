"""FP8 x FP8 matmul for decoding 17-64 rows: ``y = (q(x) sx) (Q s)^T + b`` on the FP8 tensor cores.

Math. ``x`` ``[M, K]`` is quantised per row (:func:`swiftune.kernels.fp8_quantize_rowwise`: ``x ~=
q(x) sx``, ``q(x)`` e4m3 codes, ``sx`` ``[M]`` float32), ``Q`` ``[N, K]`` e4m3 codes with ``s`` ``[N]``
float32 scales (one per output row, :class:`swiftune.models.fp8_linear.FP8Linear`'s), ``b`` ``[N]``
optional::

    y[m, n] = round_out( (sum_k q(x)[m, k] Q[n, k]) s[n] sx[m] + b[n] )      (float32 inside)

Both scales are constant along the summed axis, so they leave the sum: the tensor cores multiply the
codes themselves and the epilogue scales each accumulator once. The product of two e4m3 values (4
significant bits each) is exact in float32, so the only roundings are the quantisation of ``x``
(the same as ``torch._scaled_mm``'s path, which multiplies the same codes), the float32 additions and
the final cast. No backward: this is for decoding, under ``torch.no_grad``.

Why a second decode kernel. The weight-only kernel (:mod:`swiftune.kernels.fp8_matmul`) converts
each ``[BLOCK_N, BLOCK_K]`` weight tile from e4m3 to bf16 in registers before a bf16 ``tl.dot``: at
64 rows that conversion (and the register -> shared memory round trip feeding the bf16 tensor
cores) costs more than the halved weight read saves. Here both operands stay e4m3: Hopper's FP8
``wgmma`` reads both K-major from shared memory, which is exactly the layout of ``q(x)`` ``[M, K]``
and ``Q`` ``[N, K]`` (rows contiguous along K), so the codes go HBM -> shared memory -> tensor cores
untouched.

Swap AB. A tensor-core instruction's M side is 64 rows per warp group, its N side as small as 8. At
decode ``M`` (the batch's rows, 17..64) is the small side, so by default (``swap_ab=True``) the kernel
computes ``y^T = Q q(x)^T``: the weight tile is the 64- or 128-row M side and the activations the N
side (``BLOCK_M`` = M to a power of two, at least 16), and the ``[BLOCK_N, BLOCK_M]`` accumulator is
transposed once before the store. ``swap_ab=False`` runs ``q(x) Q^T`` directly (``BLOCK_M`` rows on the
M side, padded to the instruction's 64).

Accumulation precision. Hopper's FP8 tensor cores add their products in a reduced-precision
accumulator (Triton's default on sm_90 keeps it over the whole K loop). With ``precise_acc=True``
(the default) the kernel passes ``max_num_imprecise_acc = BLOCK_K`` to ``tl.dot``: every ``BLOCK_K``
products (one step of the K loop) are added into a float32 register accumulator, the promotion
interval DeepSeek-V3 uses; ``precise_acc=False`` keeps Triton's default (faster, less exact). The
Triton interpreter and the ``"bits"`` decoding accumulate in float32 throughout.

Memory traffic. ``N K`` bytes of weight codes against ``M K`` bytes of activation codes (re-read from
L2 once per column tile) and ``2 M N`` of y; the quantisation of x is one more launch reading ``2 M
K`` and writing ``M K + 4 M`` bytes (``torch._scaled_mm``'s path has the same launch), made once for
all the weights that multiply one ``x`` when the caller quantises it with :func:`fp8_dot_quantize` and
passes the codes. Split K: when the column tiles leave SMs idle, K is cut into ``SPLIT`` ranges whose
float32 partial sums (``4 SPLIT M N`` bytes, kept within half the weight's bytes) are added in a fixed
order, then scaled and biased: by the weight-only kernel's reduction in a second launch (the default),
or by the program of each tile that finishes last, in the same launch (``reduce_in_launch=True``: each
program counts itself in an int32 per tile, and the count's release / acquire orders the partials' stores
before the last program's loads; off by default until its CUDA tests and timing have run on a GPU).
Both add the same partials in the same order (the same bits), so the result is deterministic, a CUDA
graph replay equals the eager call bit for bit, and the launcher reads no device value (no host sync), so
the rollout engine's graphs capture it.

Three ways to run the K loop's product (``decode``): ``"fp8"`` ``tl.dot`` on ``float8e4nv`` operands
(CUDA with compute capability >= 8.9; the Triton interpreter, which converts the codes to fp16 exactly
and multiplies in float32: the same kernel body on CPU); ``"bits"`` the codes read as bytes and decoded
with the weight-only kernel's integer formula, then a bf16 ``tl.dot`` (exact: every e4m3 value is a bf16;
any GPU) or a float32 one (the interpreter, whose half-precision arithmetic is unreliable); ``"auto"`` picks ``"fp8"`` where it runs. The interpreter's e4m3 conversion maps the two NaN
codes to 480 (the ``"bits"`` decoding keeps them NaN); the quantiser and :func:`quantize_rowwise` never
produce them.
"""

from __future__ import annotations

import math
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
from .fp8_quant import fp8_quantize_rowwise
from .launch import Backend, check_float, choose_backend, kernel_is_interpreted, needs_int64, next_pow2, tl, triton

__all__ = ["fp8_dot_matmul", "fp8_dot_matmul_reference", "fp8_dot_quantize"]

DotDecode = Literal["auto", "fp8", "bits"]

_DEFAULT_BLOCK_K = 128  # codes of one row a program reads per step: a full cache line, one promotion interval
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_dot_matmul_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Plain PyTorch: ``(q(x) Q^T) s sx + b`` from the codes, in float32 (float64 when ``out_dtype`` is
    float64), cast to ``out_dtype``. ``xq`` ``[..., K]`` e4m3 codes with ``x_scale`` one float32 per row."""
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    k = weight.shape[1]
    y = xq.reshape(-1, k).view(torch.float8_e4m3fn).to(acc) @ weight.view(torch.float8_e4m3fn).to(acc).t()
    y = y * scale.reshape(1, -1).to(acc) * x_scale.reshape(-1, 1).to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(out_dtype).view(*xq.shape[:-1], weight.shape[0])


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
    def _fp8_dot_kernel(
        xq_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, c_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
        k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr, SWAP_AB: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
        BITS_DOT_F32: tl.constexpr, EVEN_K: tl.constexpr, ROUND_BF16: tl.constexpr, INT64: tl.constexpr,
        REDUCE_HERE: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m, offs_n, mask_m, mask_n = output_tile(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, INT64)
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_per_split
        x_rows = xq_ptr + offs_m[:, None] * stride_xm
        w_rows = w_ptr + offs_n[:, None] * stride_wn
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T: the weight tile on the wide side
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            a, w = load_k_step(x_rows, w_rows, k_start + k0 + offs_k, mask_m, mask_n, K, EVEN_K)
            if not FP8_DOT:  # bytes, decoded exactly; bf16 holds every e4m3 value (GPUs without FP8 cores)
                a = decode_e4m3(a)
                w = decode_e4m3(w)
                if not BITS_DOT_F32:
                    a = a.to(tl.bfloat16)
                    w = w.to(tl.bfloat16)
            # both operands K-major as loaded ([rows, BLOCK_K], K contiguous): what FP8 wgmma reads
            if SWAP_AB:
                lhs = w
                rhs = tl.trans(a)
            else:
                lhs = a
                rhs = tl.trans(w)
            if not FP8_DOT and BITS_DOT_F32:  # the interpreter: its half-precision arithmetic is unreliable
                acc = tl.dot(lhs, rhs, acc, input_precision="ieee")
            elif not FP8_DOT:  # bf16 x bf16 products of e4m3 values are exact in the float32 accumulator
                acc = tl.dot(lhs, rhs, acc)
            elif PROMOTE_EVERY > 0:  # a float32 add every PROMOTE_EVERY products (sm_90's FP8 accumulator)
                acc = tl.dot(lhs, rhs, acc, max_num_imprecise_acc=PROMOTE_EVERY)
            else:
                acc = tl.dot(lhs, rhs, acc)
        if SWAP_AB:
            acc = tl.trans(acc)
        if SPLIT == 1:
            store_scaled_tile(acc, s_ptr, xs_ptr, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, True,
                              HAS_BIAS, ROUND_BF16)
        else:
            store_partial_tile(p_ptr, acc, pid_k, M, N, offs_m, offs_n, mask_m, mask_n)
            if REDUCE_HERE:
                reduce_tile_if_last(p_ptr, c_ptr, pid_m * tl.num_programs(0) + pid_n, s_ptr, xs_ptr, b_ptr, y_ptr,
                                    M, N, offs_m, offs_n, mask_m, mask_n, stride_ym, BLOCK_M, BLOCK_N, SPLIT,
                                    True, HAS_BIAS, ROUND_BF16)

else:  # pragma: no cover
    _fp8_dot_kernel = None


def _fp8_dot_available(device: torch.device, interpreted: bool) -> bool:
    """Whether ``tl.dot`` on e4m3 operands runs: the interpreter, or a GPU with FP8 tensor cores
    (compute capability >= 8.9: Ada, Hopper, later)."""
    if interpreted:
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _quantize(x: torch.Tensor, chosen: str) -> tuple[torch.Tensor, torch.Tensor]:
    # the fused per-row quantise kernel (its torch reference where the matmul takes its reference)
    return fp8_quantize_rowwise(x.detach(), backend="reference" if chosen == "reference" else "auto")


def fp8_dot_quantize(x: torch.Tensor, *, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q(x), sx)``: ``x``'s per-row e4m3 codes (``x``'s shape) and float32 scales (``[..., 1]``), made
    exactly as :func:`fp8_dot_matmul` quantises a float ``x`` given the same ``backend``. Passed back as
    ``fp8_dot_matmul(q(x), ..., x_scale=sx, out_dtype=x.dtype)``, they give bit for bit what the call on
    ``x`` itself gives, so several weights that multiply one input (a decoder layer's q/k/v, its gate/up)
    need one quantise launch instead of one each. No autograd."""
    check_float("x", x)
    return _quantize(x, choose_backend(backend, _fp8_dot_kernel, {"x": x}))


def fp8_dot_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                   x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   backend: Backend = "auto", block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, split_k: int | None = None, swap_ab: bool = True,
                   num_warps: int = 4, num_stages: int = 4, precise_acc: bool = True,
                   decode: DotDecode = "auto", reduce_in_launch: bool = False,
                   _force_int64: bool = False) -> torch.Tensor:
    """``(q(x) sx) (Q s)^T + b`` with ``x`` quantised to e4m3 per row (see the module docstring).

    ``x`` ``[..., K]``: bf16, fp16 or fp32 (quantised here with the fused per-row kernel; the result has
    ``x``'s dtype), or ``float8_e4m3fn`` codes already quantised, with ``x_scale`` (one float32 per row,
    ``[...]`` or ``[..., 1]``; the result is ``out_dtype``, bf16 unless given). ``weight`` ``[N, K]``
    ``float8_e4m3fn`` (or its ``uint8`` view), ``scale`` ``N`` float32 values, ``bias`` ``[N]`` or
    ``None``. Returns ``[..., N]``. Meant for decoding 17..64 rows; any ``M`` works. No autograd.

    Tuning overrides (the benchmark sweeps them; ``None`` = chosen from ``M``, ``N``, ``K`` and the SM
    count): ``block_m``, ``block_n`` (powers of two >= 16), ``block_k`` (a power of two >= 32),
    ``split_k`` (>= 1), ``swap_ab`` (the weight tile on the tensor cores' M side), ``num_warps``,
    ``num_stages``, ``precise_acc`` (promote the FP8 accumulator to float32 every ``block_k``
    products), ``decode`` (``"fp8"``, ``"bits"`` or ``"auto"``), ``reduce_in_launch`` (a split K's partial
    sums added by each tile's last program rather than by a second launch). A float64 ``x`` takes the
    reference.
    """
    quantised = x.dtype == torch.float8_e4m3fn
    if not quantised:
        check_float("x", x)
        if x_scale is not None:
            raise ValueError("x_scale is for x given as float8_e4m3fn codes; pass a float x without it "
                             "(it is quantised per row here)")
        if out_dtype is not None and out_dtype != x.dtype:
            raise ValueError(f"out_dtype is x's dtype ({x.dtype}) for a float x; got {out_dtype}")
    n, k = check_fp8_weight(weight, x)
    rows = math.prod(x.shape[:-1])
    if quantised:
        if x_scale is None or x_scale.dtype != torch.float32 or x_scale.numel() != rows:
            raise ValueError(f"x given as e4m3 codes needs x_scale, one float32 value per row ({rows}), got "
                             f"{None if x_scale is None else (x_scale.dtype, tuple(x_scale.shape))}")
        out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
        if out_dtype not in _OUT_DTYPES + (torch.float64,):
            raise ValueError(f"out_dtype must be bf16, fp16, fp32 or fp64, got {out_dtype}")
    else:
        out_dtype = x.dtype
    check_scale_and_bias(scale, bias, n)
    check_pow2("block_m", block_m, 16)
    check_pow2("block_n", block_n, 16)
    check_pow2("block_k", block_k, 32)
    check_pow2("num_warps", num_warps, 1)
    check_split_k(split_k)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if decode not in ("auto", "fp8", "bits"):
        raise ValueError(f"decode must be 'auto', 'fp8' or 'bits', got {decode!r}")
    check_no_grad("fp8_dot_matmul", x, bias)
    named = {"x": x, "weight": weight, "scale": scale}
    if x_scale is not None:
        named["x_scale"] = x_scale
    if bias is not None:
        named["bias"] = bias
    chosen = choose_backend(backend, _fp8_dot_kernel, named)

    if rows == 0 or k == 0:  # nothing to quantise: an empty sum
        y = torch.zeros(rows, n, dtype=torch.float32, device=x.device)
        return (y if bias is None else y + bias.to(torch.float32)).to(out_dtype).view(*x.shape[:-1], n)
    x2 = x.reshape(-1, k)
    if quantised:
        xq, xs = x2, x_scale.reshape(-1)
    else:
        xq, xs = _quantize(x2, chosen)
        xs = xs.reshape(-1)
    if chosen == "reference" or out_dtype == torch.float64:
        return fp8_dot_matmul_reference(xq, xs, weight, scale, bias, out_dtype).view(*x.shape[:-1], n)

    interpreted = kernel_is_interpreted(_fp8_dot_kernel)
    fp8_dot = _fp8_dot_available(x.device, interpreted)
    if decode == "fp8" and not fp8_dot:
        raise ValueError("decode='fp8' needs FP8 tensor cores (a CUDA GPU of compute capability >= 8.9) or the "
                         "Triton interpreter; use decode='bits' or 'auto'")
    fp8_dot = fp8_dot and decode != "bits"
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    code_dtype = torch.float8_e4m3fn if fp8_dot else torch.uint8
    xq, w = xq.view(code_dtype), weight.view(code_dtype)
    s, xs = scale.reshape(-1), xs.contiguous()
    m = rows
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    block_k = block_k or _DEFAULT_BLOCK_K
    block_m = block_m or min(max(16, next_pow2(m)), 64)
    # 64 columns at 33..64 rows for K up to 4,096: twice the programs, and the decode sweep
    # (benchmarks.kernels --fp8-matmul, docs/benchmarks.md) found it faster on every such projection of
    # Qwen3-8B; a long K (down_proj's) keeps 128, where 64 was slower
    block_n = block_n or (64 if n <= 2048 or (m > 32 and k <= 4096) else 128)
    m_tiles, n_tiles = -(-m // block_m), -(-n // block_n)
    # programs for 90% of the SMs; SPLIT <= K / (8 M) keeps the partials within half the weight's bytes
    split = split_k if split_k is not None else choose_split_k(m_tiles * n_tiles, m, k, block_k, x.device,
                                                              sm_fill_percent=90, min_range_per_row=8)
    k_per_split, split = split_k_ranges(k, block_k, split)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    int64 = _force_int64 or needs_int64(xq, w, y, partial)
    b = bias if bias is not None else s
    round_bf16 = interpreted and out_dtype == torch.bfloat16
    counters = tile_counters.get(x.device, n_tiles * m_tiles) if split > 1 and reduce_in_launch else None
    _fp8_dot_kernel[(n_tiles, split, m_tiles)](
        xq, xs, w, s, b, y, partial, counters if counters is not None else s, m, n, k, xq.stride(0), w.stride(0),
        y.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, HAS_BIAS=bias is not None,
        FP8_DOT=fp8_dot, SWAP_AB=swap_ab, PROMOTE_EVERY=block_k if precise_acc else 0, BITS_DOT_F32=interpreted,
        EVEN_K=k == split * k_per_split, ROUND_BF16=round_bf16, INT64=int64, REDUCE_HERE=counters is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split > 1 and counters is None:
        split_k_reduce_kernel[(-(-n // REDUCE_BLOCK), m)](
            partial, s, xs, b, y, m, n, y.stride(0),
            SPLIT=split, BLOCK=REDUCE_BLOCK, HAS_ROW_SCALE=True, HAS_BIAS=bias is not None,
            ROUND_BF16=round_bf16, INT64=int64, num_warps=4,
        )
    return y.view(*x.shape[:-1], n)
