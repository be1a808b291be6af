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
floor is a quarter of a bf16 weight's. A program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y``; each
K step loads the tile's ``[BLOCK_N, BLOCK_K]`` codes (each byte serves two neighbouring columns, a second
load of it hits the cache), looks them up in the 16-entry table, scales them by their block's absmax and
multiplies with ``tl.dot``. As in :mod:`.fp8_matmul`, K is split into ranges when the column tiles alone
leave SMs idle, the float32 partial sums added in a fixed order by a second kernel (deterministic: a CUDA
graph replay equals the eager run). The launcher reads no device value, so CUDA graphs capture it.
"""

from __future__ import annotations

import dataclasses

import torch

from ._fp8_common import REDUCE_BLOCK, check_no_grad, check_pow2, check_split_k, choose_split_k, split_k_ranges
from .launch import Backend, INT32_MAX, check_float, choose_backend, kernel_is_interpreted, needs_int64, next_pow2
from .launch import tl, triton

__all__ = ["NF4Weight", "nf4_dequantize_reference", "nf4_kernel_runs_on", "nf4_weight_only_matmul",
           "nf4_weight_only_matmul_reference"]

_BLOCK_K = 128  # codes of one row a program decodes per step: 64 bytes


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


def _check_weight(w: NF4Weight, x: torch.Tensor) -> None:
    n, k = w.out_features, w.in_features
    if k != x.shape[-1]:
        raise ValueError(f"x's last dimension ({x.shape[-1]}) must be the weight's in_features ({k})")
    if w.packed.dtype != torch.uint8 or w.packed.numel() * 2 != n * k:
        raise ValueError(f"packed must hold N K / 2 = {n * k // 2} uint8 bytes, got {w.packed.numel()} {w.packed.dtype}")
    if w.code.dtype != torch.float32 or w.code.numel() != 16:
        raise ValueError(f"code must be the 16 float32 NF4 values, got {w.code.numel()} {w.code.dtype}")
    blocks = -(-n * k // w.blocksize)
    if w.blocksize < 1 or w.absmax.numel() != blocks:
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
    block's absmax, rounded once (bitsandbytes' ``dequantize_4bit``)."""
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
    def _nf4_wo_kernel(
        x_ptr, q_ptr, a_ptr, code_ptr, code2_ptr, a2_ptr, offset, b_ptr, y_ptr, p_ptr,
        M, N, K, stride_xm, stride_ym, k_per_split,
        BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, ROUND_W_BF16: tl.constexpr, ROUND_BF16: tl.constexpr,
        INT64: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m, offs_n, mask_m, mask_n = output_tile(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, INT64)
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_per_split
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        row_start = offs_n[:, None] * K  # flat index of each weight row's first element
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            kk = k_start + k0 + offs_k
            in_k = kk < K
            x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & in_k[None, :], other=0.0)
            w_mask = mask_n[:, None] & in_k[None, :]
            flat = row_start + kk[None, :]
            byte = tl.load(q_ptr + flat // 2, mask=w_mask, other=0).to(tl.int32)
            nibble = tl.where((flat % 2) == 0, byte >> 4, byte & 15)
            value = tl.load(code_ptr + nibble)  # the 16-entry table stays in L1
            block = flat // BLOCKSIZE
            if NESTED:
                a_code = tl.load(a_ptr + block, mask=w_mask, other=0).to(tl.int32)
                absmax = tl.load(code2_ptr + a_code) * tl.load(a2_ptr + block // BLOCKSIZE2, mask=w_mask, other=0.0)
                absmax = absmax + offset
            else:
                absmax = tl.load(a_ptr + block, mask=w_mask, other=0.0)
            w = tl.where(w_mask, value * absmax, 0.0)
            if DOT_F32:  # float32 x, or the interpreter (whose half-precision arithmetic is unreliable)
                if ROUND_W_BF16:  # the weight bitsandbytes would have written in bf16
                    w = round_to_bf16(w)
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
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
                           split_k: int | None = None) -> torch.Tensor:
    """``x W^T + b`` in ``x``'s dtype from NF4 codes, accumulated in float32 (see the module docstring).

    ``x`` ``[..., K]`` (bf16, fp16 or fp32; the last axis contiguous), ``w`` an :class:`NF4Weight` of
    ``[N, K]``, ``bias`` ``[N]`` or ``None``. Returns ``[..., N]``. Meant for decoding (``M`` up to 16 rows);
    larger ``M`` works, decoding the weight once per 64 rows. No autograd. ``block_n`` (a power of two >= 16)
    and ``split_k`` override the tile width and the K split chosen from ``M``, ``N``, ``K`` and the SM count.
    A ``float64`` ``x`` takes the reference."""
    check_float("x", x)
    _check_weight(w, x)
    if bias is not None and bias.numel() != w.out_features:
        raise ValueError(f"bias must hold {w.out_features} values, got {bias.numel()}")
    check_pow2("block_n", block_n, 16)
    check_split_k(split_k)
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
    if block_n is None:
        block_n = 32
    # the pipelined x and decoded-weight tiles: [16, 32] tiles in 4 stages fit an H100 / H200's shared memory
    # (227 KiB a block), larger ones need fewer stages ([32, 64] in 4 stages asked for 237-377 KB)
    stages = 4 if block_m * block_n <= 16 * 32 else 2
    m_tiles, n_tiles = -(-m // block_m), -(-n // block_n)
    split = split_k if split_k is not None else choose_split_k(m_tiles * n_tiles, m, k, _BLOCK_K, x.device,
                                                              sm_fill_percent=100, min_range_per_row=16)
    k_per_split, split = split_k_ranges(k, _BLOCK_K, split)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    int64 = n * k > INT32_MAX or needs_int64(x2, y, partial)
    code2 = w.code2 if w.nested else w.code  # (unread without NESTED: any pointer)
    absmax2 = w.absmax2 if w.nested else w.code
    ones = None if split == 1 else torch.ones(n, dtype=torch.float32, device=x.device)  # the reduce's column scales
    b = bias if bias is not None else w.code
    round_bf16 = interpreted and x.dtype == torch.bfloat16
    _nf4_wo_kernel[(n_tiles, split, m_tiles)](
        x2, w.packed, w.absmax, w.code, code2, absmax2, float(w.offset), b, y, partial,
        m, n, k, x2.stride(0), y.stride(0), k_per_split,
        BLOCKSIZE=w.blocksize, BLOCKSIZE2=w.blocksize2, NESTED=w.nested,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, SPLIT=split, HAS_BIAS=bias is not None,
        DOT_F32=x.dtype == torch.float32 or interpreted, ROUND_W_BF16=round_bf16, ROUND_BF16=round_bf16,
        INT64=int64, num_warps=4, num_stages=stages,
    )
    if split > 1:
        split_k_reduce_kernel[(-(-n // REDUCE_BLOCK), m)](
            partial, ones, ones, b, y, m, n, y.stride(0),
            SPLIT=split, BLOCK=REDUCE_BLOCK, HAS_ROW_SCALE=False, HAS_BIAS=bias is not None, ROUND_BF16=round_bf16,
            INT64=int64, num_warps=4,
        )
    return y.view(*x.shape[:-1], n)
