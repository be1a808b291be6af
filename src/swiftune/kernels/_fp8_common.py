"""Pieces shared by the two FP8 decode matmuls (:mod:`.fp8_matmul`, weight-only, and :mod:`.fp8_dot`,
FP8 x FP8): the exact e4m3 decoding and bf16 rounding used inside their kernels, the deterministic
split-K reduction (a second launch, or the last program of each tile in the product's own launch), the
choice of the K split, and the launchers' argument checks.

The math of the decoding and of split K is in :mod:`.fp8_matmul`'s module docstring.
"""

from __future__ import annotations

import torch

from .launch import check_float, tl, triton

MIN_K_BLOCKS_PER_SPLIT = 4  # a K range of at least 4 steps keeps the loop pipelined (4 stages)
REDUCE_BLOCK = 1024  # columns one program of the split-K reduction adds


if triton is not None:

    @triton.jit
    def decode_e4m3(code):
        """e4m3fn bytes (``uint8``) to their float32 values, exactly (see :mod:`.fp8_matmul`)."""
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
    def round_to_bf16(v):
        """float32 ``v`` rounded to the nearest bf16, ties to even, still in float32 (finite ``v``):
        the interpreter's own float32 -> bf16 cast truncates, compiled Triton's rounds; with this
        the cast that follows is exact on both."""
        bits = v.to(tl.int32, bitcast=True)
        kept = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # & 0xFFFF0000
        return kept.to(tl.float32, bitcast=True)

    @triton.jit
    def split_k_reduce_kernel(
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
            y = round_to_bf16(y)
        tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    # The two decode kernels' tile steps (inlined by Triton: the compiled kernels are the same code).

    @triton.jit
    def output_tile(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT64: tl.constexpr):
        """``(offs_m, offs_n, mask_m, mask_n)``: the rows and columns of the ``[BLOCK_M, BLOCK_N]`` tile of
        ``y`` that program ``(pid_n, ., pid_m)`` computes (64-bit offsets when ``INT64``), and their masks."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if INT64:
            offs_m = offs_m.to(tl.int64)
            offs_n = offs_n.to(tl.int64)
        return offs_m, offs_n, offs_m < M, offs_n < N

    @triton.jit
    def load_k_step(x_rows, w_rows, kk, mask_m, mask_n, K, EVEN_K: tl.constexpr):
        """One K step: the ``[BLOCK_M, BLOCK_K]`` activations and ``[BLOCK_N, BLOCK_K]`` weight codes at
        columns ``kk`` of the rows ``x_rows`` / ``w_rows`` (zeros past M, N, and past K unless ``EVEN_K``)."""
        if EVEN_K:
            x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None], other=0.0)
        else:
            in_k = kk[None, :] < K
            x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & in_k, other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & in_k, other=0.0)
        return x, w

    @triton.jit
    def store_output_tile(y, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym,
                          HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
        """The unsplit epilogue after the scales: ``y`` (float32, scaled) plus the bias, rounded, stored."""
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16:
            y = round_to_bf16(y)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def store_scaled_tile(acc, s_ptr, xs_ptr, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym,
                          HAS_ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
        """A tile's float32 sums times the weight's per-row scales ``s`` (the output's columns) and, with
        ``HAS_ROW_SCALE``, the activations' per-row scales ``xs``; then :func:`store_output_tile`."""
        y = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        if HAS_ROW_SCALE:
            y = y * tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        store_output_tile(y, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS, ROUND_BF16)

    @triton.jit
    def store_partial_tile(p_ptr, acc, pid_k, M, N, offs_m, offs_n, mask_m, mask_n):
        """Split K: the float32 partial sums of K range ``pid_k`` into ``partial[pid_k]`` ``[M, N]``."""
        part = p_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part, acc, mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def reduce_tile_if_last(p_ptr, c_ptr, tile, s_ptr, xs_ptr, b_ptr, y_ptr, M, N, offs_m, offs_n, mask_m, mask_n,
                            stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                            HAS_ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
        """Split K without a second launch: after a program has stored its partial tile, it counts itself in
        ``counters[tile]``; the program that arrives last adds the ``SPLIT`` partials of the tile in the fixed
        order of :func:`split_k_reduce_kernel` (the same float32 operations, so the same bits), scales, adds the
        bias, stores ``y`` and sets the count back to zero for the next call (a CUDA graph replays it as is).
        The barrier puts every thread's partial stores before the count's release; the last program's
        acquire, and its loads cached in L2 only (``.cg``: never a stale L1 line), see every other's."""
        tl.debug_barrier()
        arrived = tl.atomic_add(c_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            mask = mask_m[:, None] & mask_n[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(SPLIT):  # a fixed order: deterministic sums
                acc += tl.load(p_ptr + (i * M + offs_m[:, None]) * N + offs_n[None, :], mask=mask, other=0.0,
                               cache_modifier=".cg")
            store_scaled_tile(acc, s_ptr, xs_ptr, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym,
                              HAS_ROW_SCALE, HAS_BIAS, ROUND_BF16)
            tl.atomic_xchg(c_ptr + tile, 0, sem="relaxed", scope="gpu")


def choose_split_k(tiles: int, m: int, k: int, block_k: int, device: torch.device, *,
                   sm_fill_percent: int, min_range_per_row: int) -> int:
    """Smallest power-of-two split of K that gives ``sm_fill_percent`` % of the SMs a program, while
    each range keeps :data:`MIN_K_BLOCKS_PER_SPLIT` steps of ``block_k`` and at least
    ``min_range_per_row * m`` columns of K (``SPLIT <= K / (min_range_per_row M)``: that bounds the
    float32 partials' ``4 SPLIT M N`` bytes, written and read once, mostly in L2, by a share of the
    weight's ``N K`` bytes). ``tiles``: the programs one range of K launches."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: nothing to fill
    sms = torch.cuda.get_device_properties(device).multi_processor_count  # cached by torch: no sync
    k_blocks = -(-k // block_k)
    split = 1
    while (100 * tiles * split < sm_fill_percent * sms and (split * 2) * MIN_K_BLOCKS_PER_SPLIT <= k_blocks
           and split * 2 * min_range_per_row * m <= k):
        split *= 2
    return split


TILE_COUNTERS = 4096  # tiles of one split-K product that can reduce in its own launch (more: a reduce launch)


class _TileCounters:
    """Zeroed int32 counts for :func:`reduce_tile_if_last`, one buffer per (device, CUDA stream): the kernel
    leaves every count at zero when it ends, so the products one stream runs one after another share a
    buffer, and products that may run at the same time (other streams) never do. A buffer first asked for
    while a stream captures a CUDA graph is allocated there, its zeroing captured with it (replayed: the
    counts are zero anyway)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, device: torch.device, tiles: int) -> torch.Tensor | None:
        if tiles > TILE_COUNTERS:
            return None
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device.type, device.index, stream)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
        return buffer


tile_counters = _TileCounters()


def split_k_ranges(k: int, block_k: int, split: int) -> tuple[int, int]:
    """``(k_per_split, split)``: K cut into ``split`` ranges of whole ``block_k`` steps, and the number
    of ranges that actually hold columns (ranges past K would only add zeros)."""
    k_per_split = -(-(-(-k // block_k)) // split) * block_k
    return k_per_split, -(-k // k_per_split)


def check_fp8_weight(weight: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    """``(N, K)`` of an e4m3 ``weight`` ``[N, K]`` (or its ``uint8`` view) whose ``K`` is ``x``'s last
    dimension; raises naming what to change otherwise."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-D float8_e4m3fn tensor (or its uint8 view), got {weight.dtype} "
                        f"of shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x's last dimension must be the weight's in_features ({k}), got shape {tuple(x.shape)}")
    return n, k


def check_scale_and_bias(scale: torch.Tensor, bias: torch.Tensor | None, n: int) -> None:
    """One float32 weight scale per output row, and a float ``bias`` of ``n`` elements or none."""
    if scale.dtype != torch.float32 or scale.numel() != n:
        raise ValueError(f"scale must hold one float32 value per output row ({n}), got {scale.dtype} "
                         f"of shape {tuple(scale.shape)}")
    if bias is not None:
        check_float("bias", bias)
        if bias.numel() != n:
            raise ValueError(f"bias must have the weight's out_features ({n}) elements, got {tuple(bias.shape)}")


def check_pow2(name: str, value: int | None, least: int) -> None:
    """A tuning override ``value`` (``None``: not given) must be a power of two >= ``least``."""
    if value is not None and (value < least or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value}")


def check_split_k(split_k: int | None) -> None:
    """A ``split_k`` override (``None``: not given) must be at least one range."""
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")


def check_no_grad(function: str, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The decode matmuls have no backward: refuse inputs that would need one."""
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        raise RuntimeError(f"{function} has no backward: call it under torch.no_grad() (decoding)")
