"""Weight-only NF4 matmul for decoding: ``y = x W^T + b`` with ``W`` read as 4-bit codes, decoded in registers.

Math. bitsandbytes' NF4 weight (QLoRA's) holds ``W`` ``[N, K]`` flattened row-major, two 4-bit codes a byte
(the element of even flat index in the high nibble), and one absolute maximum per ``blocksize`` (64)
consecutive flat elements. With double quantisation the absolute maxima are themselves uint8 codes into a
256-value table ``code2``, with one float32 scale per ``blocksize2`` (256) of them and one ``offset``::

    absmax[b] = code2[absmax_codes[b]] * absmax2[b // blocksize2] + offset       (nested; else float32 absmax)
    W[n, k]   = round_c( nf4[c(f)] * absmax[f // blocksize] ),   f = n K + k      (float32 product)
    y[m, n]   = round_x( sum_k x[m, k] W[n, k] + b[n] )                          (float32 accumulation)

``nf4`` is the 16-value NF4 table, ``c(f)`` the code of flat element ``f`` and ``round_c`` the rounding to
the compute dtype (``x``'s): exactly the weight bitsandbytes' ``dequantize_4bit`` writes before its matmul,
so the two differ only in the order of the float32 additions. No backward: decoding runs under
``torch.no_grad`` (training keeps bitsandbytes' dequantise-then-multiply, whose input gradient PEFT needs).

Memory traffic. bitsandbytes multiplies more than one row of ``x`` by dequantising the whole weight to a
bf16 copy first: it reads ``N K / 2`` bytes of codes, writes ``2 N K`` and reads them back. This kernel
reads the codes and the absmax codes once (``N K / 2 + N K / 64`` bytes) and never writes a weight, so its
floor is a quarter of a bf16 weight's. A program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y``. Each K
step covers ``STEP`` columns (128, or the absmax block when it is smaller, so that a step of a row has one
absmax: ``K`` must be a multiple of ``blocksize``, as in every model's projections). It loads the
tile's ``[BLOCK_N, STEP / 2]`` bytes contiguously, one absmax per row (decoded from its code when nested),
splits the bytes into their high nibbles (the even columns) and low nibbles (the odd columns), looks both up
in the 16-entry table (held in registers per row and gathered from there), scales them, and multiplies them
with ``x``'s even and odd columns in two ``tl.dot`` calls, so the weight is never interleaved back. As in
:mod:`.fp8_matmul`, K is split into ranges when the column tiles alone leave SMs idle, the float32 partial sums
added in a fixed order by a second kernel (deterministic: a CUDA graph replay equals the eager run). The
launcher reads no device value, so CUDA graphs capture it.
"""

from __future__ import annotations

import dataclasses

import torch

from ._fp8_common import REDUCE_BLOCK, check_no_grad, check_pow2, check_split_k, choose_split_k, split_k_ranges
from .launch import Backend, INT32_MAX, check_float, choose_backend, kernel_is_interpreted, needs_int64, next_pow2
from .launch import tl, triton

__all__ = ["NF4Weight", "nf4_dequantize_reference", "nf4_kernel_runs_on", "nf4_kernel_takes",
           "nf4_weight_only_matmul", "nf4_weight_only_matmul_reference"]

_MAX_STEP = 128  # columns of one row a program decodes per K step (64 bytes; fewer when the absmax block is smaller)
_LOOKUP = 1  # the table lookup (see _nf4_lookup): the register gather was the fastest of the three on the H200
# output columns a program computes (swept with 64 and 256: docs/results/2026-12-03/nf4_lookup_sweep_h200.txt)
_BLOCK_N = 128
_UNROLL = 1  # K steps an iteration (2 and 4 swept on the H200: at most 4% faster, not in the engine's timing)
_STAGES = 4  # the pipeline's depth: a stage's byte and x tiles are a few KB


@dataclasses.dataclass(frozen=True)
class NF4Weight:
    """The tensors of one NF4 weight ``[out_features, in_features]`` (bitsandbytes' layout, see the module
    docstring). ``absmax``: float32 per block, or uint8 codes when ``absmax2`` / ``code2`` / ``offset`` /
    ``blocksize2`` describe their double quantisation."""

    packed: torch.Tensor  # uint8, N K / 2 bytes (any shape; read flat)
    absmax: torch.Tensor
    code: torch.Tensor  # float32 [16]
    blocksize: int
    out_features: int
    in_features: int
    absmax2: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    offset: float = 0.0
    blocksize2: int = 256

    @property
    def nested(self) -> bool:
        return self.absmax2 is not None


def nf4_kernel_takes(w: NF4Weight) -> bool:
    """Whether the kernel can decode ``w`` (else :func:`nf4_weight_only_matmul` refuses it): every weight row
    starts on an absmax block (``in_features`` a multiple of ``blocksize``), a power of two >= 32."""
    b = w.blocksize
    return b >= 32 and b & (b - 1) == 0 and w.in_features % b == 0


def _check_weight(w: NF4Weight, x: torch.Tensor) -> None:
    n, k = w.out_features, w.in_features
    if k != x.shape[-1]:
        raise ValueError(f"x's last dimension ({x.shape[-1]}) must be the weight's in_features ({k})")
    if w.packed.dtype != torch.uint8 or w.packed.numel() * 2 != n * k:
        raise ValueError(f"packed must hold N K / 2 = {n * k // 2} uint8 bytes, got {w.packed.numel()} {w.packed.dtype}")
    if w.code.dtype != torch.float32 or w.code.numel() != 16:
        raise ValueError(f"code must be the 16 float32 NF4 values, got {w.code.numel()} {w.code.dtype}")
    if not nf4_kernel_takes(w):
        raise ValueError(f"in_features ({k}) must be a multiple of the absmax blocksize ({w.blocksize}, a power of "
                         "two >= 32): each weight row must start on an absmax block; keep bitsandbytes' own "
                         "forward for this layer (bind_nf4_decode skips it)")
    blocks = -(-n * k // w.blocksize)
    if w.absmax.numel() != blocks:  # (blocksize >= 32: nf4_kernel_takes above)
        raise ValueError(f"absmax must hold one value per block of {w.blocksize} elements ({blocks}), "
                         f"got {w.absmax.numel()}")
    if w.nested:
        if w.absmax.dtype != torch.uint8 or w.code2 is None or w.code2.numel() != 256:
            raise ValueError("a double-quantised absmax is uint8 codes with a 256-value code2 table")
        if w.absmax2.numel() != -(-blocks // w.blocksize2):
            raise ValueError(f"absmax2 must hold one scale per {w.blocksize2} absmax codes")
    elif w.absmax.dtype != torch.float32:
        raise ValueError(f"absmax must be float32 (or uint8 codes with absmax2), got {w.absmax.dtype}")


def nf4_dequantize_reference(w: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch: ``W`` ``[N, K]`` in ``dtype``, each value the float32 product of its NF4 value and its
    block's absmax, rounded once (bitsandbytes' ``dequantize_4bit``, checked where ``K`` is a multiple of the
    block: bitsandbytes' CPU layout differs from this formula when rows straddle blocks)."""
    flat = w.packed.reshape(-1)
    codes = torch.stack([flat >> 4, flat & 15], dim=1).reshape(-1).long()
    absmax = w.absmax
    if w.nested:
        scales = w.absmax2.float().repeat_interleave(w.blocksize2)[: absmax.numel()]
        absmax = w.code2.float()[absmax.long()] * scales + w.offset
    per_element = absmax.float().repeat_interleave(w.blocksize)[: codes.numel()]
    return (w.code.float()[codes] * per_element).reshape(w.out_features, w.in_features).to(dtype)


def nf4_weight_only_matmul_reference(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: the weight dequantised to ``x``'s dtype, then ``F.linear`` (a full copy of the weight)."""
    return torch.nn.functional.linear(x, nf4_dequantize_reference(w, x.dtype), None if bias is None else bias.to(x.dtype))


if triton is not None:

    from ._fp8_common import output_tile, round_to_bf16, split_k_reduce_kernel, store_output_tile, store_partial_tile

    @triton.jit
    def _select(c, bit: tl.constexpr, if_set, if_clear):
        return tl.where((c & bit) != 0, if_set, if_clear)

    @triton.jit
    def _nf4_lookup(code_ptr, c, table, LOOKUP: tl.constexpr):
        """The NF4 values of the 4-bit codes ``c`` ``[BLOCK_N, STEP / 2]``: ``LOOKUP`` 0 loads them from the
        table in memory (a gather the L1 serves), 1 gathers them from the table held in registers per row
        (``table`` ``[BLOCK_N, 16]``), 2 selects them with a tree of 15 ``where`` over the code's bits."""
        if LOOKUP == 0:
            v = tl.load(code_ptr + c)
        elif LOOKUP == 1:
            v = tl.gather(table, c, axis=1)
        else:
            p0 = _select(c, 1, tl.load(code_ptr + 1), tl.load(code_ptr + 0))
            p1 = _select(c, 1, tl.load(code_ptr + 3), tl.load(code_ptr + 2))
            p2 = _select(c, 1, tl.load(code_ptr + 5), tl.load(code_ptr + 4))
            p3 = _select(c, 1, tl.load(code_ptr + 7), tl.load(code_ptr + 6))
            p4 = _select(c, 1, tl.load(code_ptr + 9), tl.load(code_ptr + 8))
            p5 = _select(c, 1, tl.load(code_ptr + 11), tl.load(code_ptr + 10))
            p6 = _select(c, 1, tl.load(code_ptr + 13), tl.load(code_ptr + 12))
            p7 = _select(c, 1, tl.load(code_ptr + 15), tl.load(code_ptr + 14))
            low = _select(c, 4, _select(c, 2, p3, p2), _select(c, 2, p1, p0))
            high = _select(c, 4, _select(c, 2, p7, p6), _select(c, 2, p5, p4))
            v = _select(c, 8, high, low)
        return v

    @triton.jit
    def _nf4_load_step(q_rows, a_ptr, code2_ptr, a2_ptr, offset, a_rows, k0, mask_n,
                       BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr):
        """The codes of the K step at ``k0`` (``[BLOCK_N, STEP / 2]`` bytes as int32) and each row's absmax there
        (one: ``STEP`` divides ``BLOCKSIZE`` and rows start on a block)."""
        byte = tl.load(q_rows + k0 // 2, mask=mask_n[:, None], other=0).to(tl.int32)
        block = a_rows + k0 // BLOCKSIZE
        if NESTED:
            a_code = tl.load(a_ptr + block, mask=mask_n, other=0).to(tl.int32)
            absmax = tl.load(code2_ptr + a_code) * tl.load(a2_ptr + block // BLOCKSIZE2, mask=mask_n, other=0.0)
            absmax = absmax + offset
        else:
            absmax = tl.load(a_ptr + block, mask=mask_n, other=0.0)
        return byte, absmax

    @triton.jit
    def _nf4_multiply_step(acc, byte, absmax, x_even, k0, mask_m, code_ptr, table, LOOKUP: tl.constexpr,
                           DOT_F32: tl.constexpr, ROUND_W_BF16: tl.constexpr):
        """``acc`` plus the K step at ``k0``: the codes decoded (float32 products: bitsandbytes' dequantised
        values) and multiplied with ``x``'s even (high nibbles) and odd (low nibbles) columns."""
        w_hi = _nf4_lookup(code_ptr, byte >> 4, table, LOOKUP) * absmax[:, None]
        w_lo = _nf4_lookup(code_ptr, byte & 15, table, LOOKUP) * absmax[:, None]
        x_hi = tl.load(x_even + k0, mask=mask_m[:, None], other=0.0)
        x_lo = tl.load(x_even + (k0 + 1), mask=mask_m[:, None], other=0.0)
        if DOT_F32:  # float32 x, or the interpreter (whose half-precision arithmetic is unreliable)
            if ROUND_W_BF16:  # the weight bitsandbytes would have written in bf16
                w_hi = round_to_bf16(w_hi)
                w_lo = round_to_bf16(w_lo)
            acc += tl.dot(x_hi.to(tl.float32), tl.trans(w_hi), input_precision="ieee")
            acc += tl.dot(x_lo.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
        else:
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
        return acc

    @triton.jit
    def _nf4_wo_kernel(
        x_ptr, q_ptr, a_ptr, code_ptr, code2_ptr, a2_ptr, offset, b_ptr, y_ptr, p_ptr,
        M, N, K, stride_xm, stride_ym, stride_q, blocks_per_row, k_per_split,
        BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr, UNROLL: tl.constexpr, SPLIT: tl.constexpr,
        LOOKUP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, ROUND_W_BF16: tl.constexpr,
        ROUND_BF16: tl.constexpr, INT64: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m, offs_n, mask_m, mask_n = output_tile(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, INT64)
        HALF: tl.constexpr = STEP // 2
        offs_j = tl.arange(0, HALF)  # byte j of a step holds columns k0 + 2 j (high nibble) and k0 + 2 j + 1 (low)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        x_even = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_j[None, :]
        q_rows = q_ptr + offs_n[:, None] * stride_q + offs_j[None, :]
        a_rows = offs_n * blocks_per_row  # each row's first absmax: rows start on a block (K % BLOCKSIZE == 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        table = tl.broadcast_to(tl.load(code_ptr + tl.arange(0, 16))[None, :], (BLOCK_N, 16))
        # UNROLL steps an iteration, all their loads issued before the first multiply: more bytes in flight
        for k0 in range(k_start, k_end, STEP * UNROLL):
            byte0, absmax0 = _nf4_load_step(q_rows, a_ptr, code2_ptr, a2_ptr, offset, a_rows, k0, mask_n,
                                            BLOCKSIZE, BLOCKSIZE2, NESTED)
            if UNROLL >= 2:
                byte1, absmax1 = _nf4_load_step(q_rows, a_ptr, code2_ptr, a2_ptr, offset, a_rows, k0 + STEP, mask_n,
                                                BLOCKSIZE, BLOCKSIZE2, NESTED)
            if UNROLL >= 4:
                byte2, absmax2 = _nf4_load_step(q_rows, a_ptr, code2_ptr, a2_ptr, offset, a_rows, k0 + 2 * STEP,
                                                mask_n, BLOCKSIZE, BLOCKSIZE2, NESTED)
                byte3, absmax3 = _nf4_load_step(q_rows, a_ptr, code2_ptr, a2_ptr, offset, a_rows, k0 + 3 * STEP,
                                                mask_n, BLOCKSIZE, BLOCKSIZE2, NESTED)
            acc = _nf4_multiply_step(acc, byte0, absmax0, x_even, k0, mask_m, code_ptr, table, LOOKUP, DOT_F32,
                                     ROUND_W_BF16)
            if UNROLL >= 2:
                acc = _nf4_multiply_step(acc, byte1, absmax1, x_even, k0 + STEP, mask_m, code_ptr, table, LOOKUP,
                                         DOT_F32, ROUND_W_BF16)
            if UNROLL >= 4:
                acc = _nf4_multiply_step(acc, byte2, absmax2, x_even, k0 + 2 * STEP, mask_m, code_ptr, table,
                                         LOOKUP, DOT_F32, ROUND_W_BF16)
                acc = _nf4_multiply_step(acc, byte3, absmax3, x_even, k0 + 3 * STEP, mask_m, code_ptr, table,
                                         LOOKUP, DOT_F32, ROUND_W_BF16)
        if SPLIT == 1:
            store_output_tile(acc, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS, ROUND_BF16)
        else:
            store_partial_tile(p_ptr, acc, pid_k, M, N, offs_m, offs_n, mask_m, mask_n)

else:  # pragma: no cover
    _nf4_wo_kernel = None


def nf4_kernel_runs_on(device: torch.device) -> bool:
    """Whether :func:`nf4_weight_only_matmul` runs its Triton kernel (not the reference) for tensors on ``device``:
    CUDA with Triton, or a CPU when the kernels are interpreted."""
    if _nf4_wo_kernel is None:
        return False
    interpreted = kernel_is_interpreted(_nf4_wo_kernel)
    return device.type == "cpu" if interpreted else device.type == "cuda"


def nf4_weight_only_matmul(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None, *,
                           backend: Backend = "auto", block_n: int | None = None,
                           split_k: int | None = None, num_stages: int | None = None,
                           lookup: int | None = None, unroll: int | None = None) -> torch.Tensor:
    """``x W^T + b`` in ``x``'s dtype from NF4 codes, accumulated in float32 (see the module docstring).

    ``x`` ``[..., K]`` (bf16, fp16 or fp32; the last axis contiguous), ``w`` an :class:`NF4Weight` of
    ``[N, K]``, ``bias`` ``[N]`` or ``None``. Returns ``[..., N]``. Meant for decoding (``M`` up to 16 rows);
    larger ``M`` works, decoding the weight once per 64 rows. No autograd. ``block_n`` (a power of two >= 16),
    ``split_k``, ``num_stages``, ``lookup`` (0, 1, 2: how codes become NF4 values, see ``_nf4_lookup``) and
    ``unroll`` (1, 2, 4 K steps an iteration, their loads issued first; 1 where K is not a multiple of that
    many steps) override the tile width, the K split chosen from ``M``, ``N``, ``K`` and the SM count, the
    software pipeline's depth, the table lookup and the loop's unrolling. A ``float64`` ``x`` takes the
    reference. A weight whose rows straddle absmax blocks is refused (:func:`nf4_kernel_takes`)."""
    check_float("x", x)
    _check_weight(w, x)
    if bias is not None and bias.numel() != w.out_features:
        raise ValueError(f"bias must hold {w.out_features} values, got {bias.numel()}")
    check_pow2("block_n", block_n, 16)
    check_split_k(split_k)
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if unroll not in (None, 1, 2, 4):
        raise ValueError(f"unroll must be 1, 2 or 4 K steps an iteration, got {unroll}")
    if lookup not in (None, 0, 1, 2):
        raise ValueError(f"lookup must be 0 (table in memory), 1 (table in registers) or 2 (select tree), "
                         f"got {lookup}")
    check_no_grad("nf4_weight_only_matmul", x, bias)
    named = {"x": x, "packed": w.packed, "absmax": w.absmax, "code": w.code}
    if w.nested:
        named.update(absmax2=w.absmax2, code2=w.code2)
    if bias is not None:
        named["bias"] = bias
    chosen = choose_backend(backend, _nf4_wo_kernel, named)
    n, k = w.out_features, w.in_features
    if chosen == "reference" or x.dtype == torch.float64 or x.numel() == 0 or k == 0:
        return nf4_weight_only_matmul_reference(x, w, bias)
    interpreted = kernel_is_interpreted(_nf4_wo_kernel)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(max(16, next_pow2(m)), 64)
    block_n = block_n or _BLOCK_N
    step = min(w.blocksize, _MAX_STEP)
    unroll = unroll or _UNROLL
    if k % (step * unroll):
        unroll = 1
    m_tiles, n_tiles = -(-m // block_m), -(-n // block_n)
    split = split_k if split_k is not None else choose_split_k(m_tiles * n_tiles, m, k, step * unroll, x.device,
                                                              sm_fill_percent=200, min_range_per_row=16)
    k_per_split, split = split_k_ranges(k, step * unroll, split)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    int64 = n * k > INT32_MAX or needs_int64(x2, y, partial)
    code2 = w.code2 if w.nested else w.code  # (unread without NESTED: any pointer)
    absmax2 = w.absmax2 if w.nested else w.code
    ones = None if split == 1 else torch.ones(n, dtype=torch.float32, device=x.device)  # the reduce's column scales
    b = bias if bias is not None else w.code
    round_bf16 = interpreted and x.dtype == torch.bfloat16
    _nf4_wo_kernel[(n_tiles, split, m_tiles)](
        x2, w.packed, w.absmax, w.code, code2, absmax2, float(w.offset), b, y, partial,
        m, n, k, x2.stride(0), y.stride(0), k // 2, k // w.blocksize, k_per_split,
        BLOCKSIZE=w.blocksize, BLOCKSIZE2=w.blocksize2, NESTED=w.nested,
        BLOCK_M=block_m, BLOCK_N=block_n, STEP=step, UNROLL=unroll, SPLIT=split,
        LOOKUP=_LOOKUP if lookup is None else lookup, HAS_BIAS=bias is not None,
        DOT_F32=x.dtype == torch.float32 or interpreted, ROUND_W_BF16=round_bf16, ROUND_BF16=round_bf16,
        INT64=int64, num_warps=4, num_stages=num_stages or _STAGES,
    )
    if split > 1:
        split_k_reduce_kernel[(-(-n // REDUCE_BLOCK), m)](
            partial, ones, ones, b, y, m, n, y.stride(0),
            SPLIT=split, BLOCK=REDUCE_BLOCK, HAS_ROW_SCALE=False, HAS_BIAS=bias is not None, ROUND_BF16=round_bf16,
            INT64=int64, num_warps=4,
        )
    return y.view(*x.shape[:-1], n)
