"""Decode attention split along the cache (flash-decoding): a step's few queries spread over every SM.

A decode step's attention has one query per row and head against the row's cached keys. SDPA runs one
program per (row, K/V head) over the whole cache: at G=8 rows and 4 or 8 K/V heads that is 32-64 programs
on a GPU of 132 SMs, each streaming the whole cache alone, so the step's KV read runs at a fraction of the
bandwidth. Here the cache is cut into ``S`` chunks and each (row, K/V head, chunk) is one program; a second
launch merges the chunks.

For row ``b``, K/V head ``h``, its ``g = Hq / Hk`` query heads ``q_i`` (one tile, padded to 16 rows for the
tensor cores) and the visible slots ``j`` (``j <= cur[b]`` and, with a window ``w``, ``cur[b] - j < w``)::

    chunk c:   m_c = max_j s_ij,   l_c = sum_j exp(s_ij - m_c),   a_c = sum_j exp(s_ij - m_c) v_j
               s_ij = scale q_i . k_j   over the chunk's visible slots, online (tile by tile)
    merge:     M = max_c m_c,   out_i = sum_c exp(m_c - M) a_c / sum_c exp(m_c - M) l_c

With gpt-oss's attention sinks (one learned logit ``z_i`` per query head, a softmax column with no value)
the merge takes ``M = max(max_c m_c, z_i)`` and adds ``exp(z_i - M)`` to the denominator.

A program reads only the tiles of ``BLOCK_N`` slots that hold a visible one: not the cache past the row's
last slot (the step's ``L`` is a bucket, up to a bucket beyond it), nor, with a window, before the window.
Hidden slots in a tile read score ``-1e30`` and load as zeros (never the cache's stale contents). A chunk
with no visible slot leaves ``m_c = -1e30``, ``l_c = 0``, and its weight ``exp(m_c - M)`` is 0 in the merge
(every row sees at least its own slot).
Scores, the softmax and the accumulator are float32; the probabilities multiply ``V`` in the cache's
dtype (as flash attention does), so results match SDPA to that rounding, not bit for bit. No backward:
decoding runs under ``no_grad``.

An FP8 cache (``key_scales`` / ``value_scales``: each slot's vector is its e4m3 codes ``c_j`` times a float32
scale ``t_j``): ``q . k_j = t_j (q . c_j)`` and ``sum_j p_j v_j = sum_j (p_j t^v_j) c^v_j``, so the codes go
through the same dots in the query's dtype (e4m3 values are exact in bf16) and the scales multiply the scores'
columns and the probabilities' columns; the softmax's sums use the unscaled ``p``.
"""

from __future__ import annotations

import torch

from .launch import Backend, choose_backend, kernel_is_interpreted, next_pow2, tl, triton

__all__ = ["dequantize_cache", "split_decode_attention", "split_decode_attention_reference"]

_BLOCK_N = 64  # cache slots a program scores at once
_MIN_ROWS = 16  # the tensor cores' smallest tile: a K/V head's g query heads are padded to it


def dequantize_cache(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP8 cache's vectors: ``codes [..., D]`` (e4m3) times ``scales [...]`` (float32, one per slot), in
    ``dtype``."""
    return (codes.to(torch.float32) * scales.unsqueeze(-1)).to(dtype)


def split_decode_attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                     cur: torch.Tensor, window: int | None, scale: float,
                                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention in plain PyTorch (float32 math): ``query [B, Hk, g, D]``, ``keys, values
    [B, Hk, L, D]``, ``cur [B]``, ``sinks [Hk g]`` -> ``[B, Hk, g, D]`` in the query's dtype."""
    j = torch.arange(keys.shape[2], device=keys.device)[None, :]
    allowed = j <= cur[:, None]
    if window:
        allowed = allowed & (cur[:, None] - j < window)
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink's column joins the softmax, then is dropped
        column = sinks.float().reshape(1, *scores.shape[1:3], 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values.float()).to(query.dtype)


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, cur_ptr, m_ptr, l_ptr, acc_ptr, ks_ptr, vs_ptr, sink_ptr, out_ptr,
                      kv_heads, kv_len, chunk, window, scale,
                      s_qb, s_qh, s_qg, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_sb, s_sh, s_ob, s_oh, s_og,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                      F32: tl.constexpr, SCALED: tl.constexpr, WHOLE: tl.constexpr, HAS_SINKS: tl.constexpr):
        bh = tl.program_id(0)
        c = tl.program_id(1)
        splits = tl.num_programs(1)
        b = (bh // kv_heads).to(tl.int64)
        h = (bh % kv_heads).to(tl.int64)
        gi = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * s_qb + h * s_qh + gi[:, None] * s_qg + d[None, :], mask=gi[:, None] < G, other=0.0)
        last = tl.load(cur_ptr + b).to(tl.int32)  # a slot index below kv_len (int32): the loop bounds mix the two
        m = tl.full((BLOCK_G,), -1.0e30, tl.float32)
        l_sum = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, D), tl.float32)
        start = c * chunk
        # only the tiles holding visible slots are read: the cache beyond the row's last slot (up to the
        # step's bucketed kv_len) and, with a window, before its first are never loaded
        lo = start
        if window > 0:
            lo = tl.maximum(start, ((last - window + 1) // BLOCK_N) * BLOCK_N)
        for off in range(lo, tl.minimum(tl.minimum(start + chunk, kv_len), last + 1), BLOCK_N):
            j = off + tl.arange(0, BLOCK_N)
            visible = (j <= last) & (j < kv_len)
            if window > 0:
                visible = visible & (last - j < window)
            k = tl.load(k_ptr + b * s_kb + h * s_kh + j[:, None] * s_kl + d[None, :], mask=visible[:, None],
                        other=0.0)
            if F32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))  # e4m3 codes are exact in bf16 / fp16
            if SCALED:  # an FP8 cache: each slot's key is its codes times its scale, a column factor of s
                s = s * tl.load(ks_ptr + b * s_sb + h * s_sh + j, mask=visible, other=0.0)[None, :]
            s = tl.where(visible[None, :], s * scale, -1.0e30)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + b * s_vb + h * s_vh + j[:, None] * s_vl + d[None, :], mask=visible[:, None],
                        other=0.0)
            pv = p
            if SCALED:  # and each slot's value its codes times its scale: a factor of p's column
                pv = p * tl.load(vs_ptr + b * s_sb + h * s_sh + j, mask=visible, other=0.0)[None, :]
            if F32:
                acc = acc * alpha[:, None] + tl.dot(pv, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype))
            m = m_new
        if WHOLE:  # one chunk covers the row: the merge of one part, here (no partials written, no second launch)
            _finish(m, l_sum, acc, sink_ptr, out_ptr, b, h, gi, d, s_ob, s_oh, s_og, G, HAS_SINKS)
        else:
            part = (bh * splits + c) * BLOCK_G + gi
            tl.store(m_ptr + part, m)
            tl.store(l_ptr + part, l_sum)
            tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)

    @triton.jit
    def _finish(top, den, num, sink_ptr, out_ptr, b, h, gi, d, s_ob, s_oh, s_og, G: tl.constexpr,
                HAS_SINKS: tl.constexpr):
        """``out = num / den`` for the query heads of (row b, K/V head h), whose scores' maximum so far is
        ``top``; with sinks, each head's sink column joins the softmax first."""
        if HAS_SINKS:  # query head h g + i's sink logit: a softmax column with no value
            sink = tl.load(sink_ptr + h * G + gi, mask=gi < G, other=-1.0e30).to(tl.float32)
            new_top = tl.maximum(top, sink)
            w = tl.exp(top - new_top)
            den = den * w + tl.exp(sink - new_top)
            num = num * w[:, None]
        out = num / den[:, None]
        tl.store(out_ptr + b * s_ob + h * s_oh + gi[:, None] * s_og + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=gi[:, None] < G)

    @triton.jit
    def _merge_kernel(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, kv_heads, splits, s_ob, s_oh, s_og,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, HAS_SINKS: tl.constexpr):
        bh = tl.program_id(0)
        b = (bh // kv_heads).to(tl.int64)
        h = (bh % kv_heads).to(tl.int64)
        gi = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        top = tl.full((BLOCK_G,), -1.0e30, tl.float32)
        for c in range(0, splits):
            top = tl.maximum(top, tl.load(m_ptr + (bh * splits + c) * BLOCK_G + gi))
        den = tl.zeros((BLOCK_G,), tl.float32)
        num = tl.zeros((BLOCK_G, D), tl.float32)
        for c in range(0, splits):
            part = (bh * splits + c) * BLOCK_G + gi
            w = tl.exp(tl.load(m_ptr + part) - top)
            den += w * tl.load(l_ptr + part)
            num += w[:, None] * tl.load(acc_ptr + part[:, None] * D + d[None, :])
        _finish(top, den, num, sink_ptr, out_ptr, b, h, gi, d, s_ob, s_oh, s_og, G, HAS_SINKS)

else:  # pragma: no cover
    _split_kernel = _merge_kernel = _finish = None


def _splits(programs: int, kv_len: int, device: torch.device, block_n: int = _BLOCK_N) -> int:
    """Chunks per (row, K/V head): enough programs for two waves over the SMs, each chunk at least one
    tile of slots."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(triton.cdiv(kv_len, block_n), triton.cdiv(2 * sms, max(1, programs))))


def split_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cur: torch.Tensor,
                           window: int | None, scale: float, sinks: torch.Tensor | None = None, *,
                           key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                           splits: int | None = None, backend: Backend = "auto") -> torch.Tensor:
    """Decode attention (module docstring): ``query [B, Hk, g, D]`` (a K/V head's query heads together),
    ``keys, values [B, Hk, L, D]`` (the cache's first ``L`` slots), ``cur [B]`` each row's last visible
    slot, ``window`` its sliding window (``None``/0: none), ``sinks [Hk g]`` one sink logit per query head
    (gpt-oss; ``None``: none) -> ``[B, Hk, g, D]`` in the query's dtype. ``splits``: chunks per (row, K/V
    head) (default: two waves of programs over the SMs). ``key_scales, value_scales [B, Hk, L]`` (float32):
    an FP8 cache, ``keys`` / ``values`` e4m3 codes, each slot's vector its codes times its scale (the rollout
    engine's ``kv_cache_dtype="fp8"``); the kernel multiplies the codes in the query's dtype (exact) and
    applies the scales to the scores' and the probabilities' columns."""
    rows, kv_heads, group, dim = query.shape
    if keys.shape[:2] != (rows, kv_heads) or values.shape != keys.shape or keys.shape[3] != dim:
        raise ValueError(f"query {tuple(query.shape)} takes keys/values [B, Hk, L, D] of its B, Hk and D; got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    scaled = key_scales is not None
    if scaled != (value_scales is not None):
        raise ValueError("an FP8 cache takes both key_scales and value_scales (or neither)")
    if scaled and (key_scales.shape != keys.shape[:3] or value_scales.shape != keys.shape[:3]):
        raise ValueError(f"key_scales / value_scales must be [B, Hk, L] = {tuple(keys.shape[:3])}, got "
                         f"{tuple(key_scales.shape)} and {tuple(value_scales.shape)}")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the head dimension must be a power of two >= 16, got {dim}")
    kind = choose_backend(backend, _split_kernel, {"query": query, "keys": keys, "values": values, "cur": cur})
    if sinks is not None and sinks.numel() != kv_heads * group:
        raise ValueError(f"sinks must hold one logit per query head ({kv_heads * group}), got {sinks.numel()}")
    if kind == "reference":
        if scaled:
            keys, values = dequantize_cache(keys, key_scales), dequantize_cache(values, value_scales)
        return split_decode_attention_reference(query, keys, values, cur, window, scale, sinks)
    query, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, keys, values))
    if scaled:
        if key_scales.stride() != value_scales.stride() or key_scales.stride(-1) != 1:
            raise ValueError("key_scales and value_scales must share their strides, the slot axis contiguous")
    out = torch.empty(rows, kv_heads, group, dim, dtype=query.dtype, device=query.device)
    _launch_split(query, keys, values, cur, window, scale, sinks, key_scales, value_scales, out, splits=splits)
    return out


def _launch_split(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cur: torch.Tensor,
                  window: int | None, scale: float, sinks: torch.Tensor | None, key_scales: torch.Tensor | None,
                  value_scales: torch.Tensor | None, out: torch.Tensor, *, splits: int | None = None,
                  block_n: int = _BLOCK_N, num_warps: int = 4, num_stages: int | None = None) -> int:
    """The kernels on checked arguments, writing ``out``; the launch settings are arguments so that
    ``benchmarks.tune_decode_attention`` can sweep them. Returns the number of chunks."""
    rows, kv_heads, group, dim = query.shape
    kv_len = keys.shape[2]
    block_g = max(_MIN_ROWS, next_pow2(group))
    programs = rows * kv_heads
    splits = splits or _splits(programs, kv_len, query.device, block_n)
    chunk = triton.cdiv(triton.cdiv(kv_len, splits), block_n) * block_n
    splits = triton.cdiv(kv_len, chunk)
    whole = splits == 1
    if whole:  # no partials: the split kernel normalises and writes out itself
        m = l_sum = acc = out
    else:
        m = torch.empty(programs * splits * block_g, dtype=torch.float32, device=query.device)
        l_sum = torch.empty_like(m)
        acc = torch.empty(programs * splits * block_g, dim, dtype=torch.float32, device=query.device)
    scaled = key_scales is not None
    scale_strides = (key_scales.stride(0), key_scales.stride(1)) if scaled else (0, 0)
    sink_values = sinks.reshape(-1).contiguous() if sinks is not None else out
    f32 = query.dtype == torch.float32 or kernel_is_interpreted(_split_kernel)
    stages = {} if num_stages is None else {"num_stages": num_stages}
    _split_kernel[(programs, splits)](
        query, keys, values, cur, m, l_sum, acc, key_scales if scaled else m, value_scales if scaled else m,
        sink_values, out, kv_heads, kv_len, chunk, int(window or 0), float(scale),
        query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), *scale_strides, out.stride(0), out.stride(1),
        out.stride(2), G=group, D=dim, BLOCK_G=block_g, BLOCK_N=block_n, F32=f32, SCALED=scaled, WHOLE=whole,
        HAS_SINKS=sinks is not None, num_warps=num_warps, **stages,
    )
    if not whole:
        _merge_kernel[(programs,)](
            m, l_sum, acc, sink_values, out, kv_heads, splits, out.stride(0), out.stride(1), out.stride(2),
            G=group, D=dim, BLOCK_G=block_g, HAS_SINKS=sinks is not None, num_warps=4,
        )
    return splits
