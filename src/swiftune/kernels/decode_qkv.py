"""One decode step's q/k/v after the projections: per-head RMSNorm, RoPE, K/V into the cache.

For decoding (one new token per row, no autograd). With ``q [B, Hq, D]``, ``k, v [B, Hk, D]``
(the projections of the rows' current tokens), optional per-head norm weights ``wq, wk [D]``
(Qwen3's ``q_norm`` / ``k_norm``; ``None`` for Llama, Mistral, Qwen2), ``cos, sin [B, D]``
(the rows' positions) and caches ``K, V [B, Hk, L, D]`` with a slot per row ``slot [B]``::

    q' = rope(norm(q, wq))                   returned, [B, Hq, D]
    K[b, :, slot[b]] = rope(norm(k[b], wk))
    V[b, :, slot[b]] = v[b]

``norm`` is :func:`swiftune.kernels.rms_norm` over each head's ``D`` values and ``rope`` is
:func:`swiftune.kernels.rope_qk`'s forward (``y1 = x1 c1 - x2 s1``, ``y2 = x2 c2 + x1 s2`` on the
halves), with the same roundings: the normalised head is rounded to the activation dtype before
it is rotated, exactly as the two unfused kernels do. One kernel replaces five launches per layer
(two norms, the rotation, two cache writes), which matters when a decode step at a few rows is
bound by kernel count.

An FP8 cache (``k_scales`` / ``v_scales`` given, e4m3 caches): V's vector and K's rotated vector (as rounded to
q's dtype) are quantised per slot as :mod:`swiftune.kernels.fp8_quant` quantises a row (largest magnitude to
448, IEEE division, round to nearest even), their codes and scales written; K is rotated in its own row of the
returned buffer first (the cache slot holds codes, not the activation dtype).

One program handles one (row, head): it normalises the head, writes it to its destination (the
returned q row, or the cache slot), then reads the two halves back to rotate them in place (a
barrier orders the write and the reads, which different threads of the program perform).
"""

from __future__ import annotations

import torch

from .fp8_quant import e4m3_codes, e4m3_scale, fp8_quantize_rowwise_reference
from .launch import Backend, choose_backend, next_pow2, tl, triton
from .rms_norm import rms_norm_reference, rms_row
from .rope import rope_qk_reference


def decode_qkv_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor | None, wk: torch.Tensor | None,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot: torch.Tensor, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch: the unfused ops (norms, rotation, two indexed writes; an FP8 cache: each written vector
    quantised per slot by :func:`~swiftune.kernels.fp8_quant.fp8_quantize_rowwise_reference`)."""
    if wq is not None:
        q, k = rms_norm_reference(q, wq, eps), rms_norm_reference(k, wk, eps)
    # rope_qk's layout: [B, H, S, D] with cos/sin [B, S, D]; here S = 1
    q, k = rope_qk_reference(q[:, :, None], k[:, :, None], cos[:, None], sin[:, None])
    rows = torch.arange(q.shape[0], device=q.device)
    k = k[:, :, 0]
    if k_scales is not None:  # the codes written as their bytes: index_put on float8 is not on every device
        (k, ks), (v, vs) = fp8_quantize_rowwise_reference(k), fp8_quantize_rowwise_reference(v)
        k_scales[rows, :, slot] = ks[..., 0]
        v_scales[rows, :, slot] = vs[..., 0]
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache[rows, :, slot] = k.to(k_cache.dtype)
    v_cache[rows, :, slot] = v.to(v_cache.dtype)
    return q[:, :, 0]


if triton is not None:

    @triton.jit
    def _decode_qkv_kernel(
        q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
        sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_b, sqo_b, sqo_h, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
        ss_b, ss_h, n_q_heads, head_dim, half, eps,
        NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, FP8: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        is_q = h < n_q_heads
        kh = h - n_q_heads
        slot = tl.load(slot_ptr + b)
        if is_q:
            src = q_ptr + b * sq_b + h * sq_h
            dst = qo_ptr + b * sqo_b + h * sqo_h
            w_ptr = wq_ptr
        else:
            src = k_ptr + b * sk_b + kh * sk_h
            if FP8:  # the head is rotated in its own row after q's (qo has Hq + Hk rows), then quantised
                dst = qo_ptr + b * sqo_b + h * sqo_h
            else:
                dst = kc_ptr + b * skc_b + kh * skc_h + slot * skc_s
            w_ptr = wk_ptr
            # V goes to its slot unchanged (an FP8 cache: its codes and scale, fp8_quant's arithmetic)
            d_all = tl.arange(0, BLOCK_D)
            vrow = tl.load(v_ptr + b * sv_b + kh * sv_h + d_all, mask=d_all < head_dim, other=0.0)
            if FP8:
                vrow = vrow.to(tl.float32)
                v_scale = e4m3_scale(tl.max(tl.abs(vrow), axis=0))
                vrow = e4m3_codes(vrow, v_scale)
                tl.store(vs_ptr + b * ss_b + kh * ss_h + slot, v_scale)
            tl.store(vc_ptr + b * svc_b + kh * svc_h + slot * svc_s + d_all,
                     vrow.to(vc_ptr.dtype.element_ty), mask=d_all < head_dim)
        if NORM:  # rms_norm's own row function: float32, rounded to the output dtype
            d = tl.arange(0, BLOCK_D)
            dmask = d < head_dim
            x = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
            rms_row(x, w_ptr, dst, d, dmask, head_dim, eps, 0.0)
            tl.debug_barrier()
            src = dst
        # rope_qk's arithmetic on the halves of the (normalised) head
        e = tl.arange(0, BLOCK_HALF)
        emask = e < half
        c1 = tl.load(cos_ptr + b * sc_b + e, mask=emask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + b * sc_b + half + e, mask=emask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + b * sc_b + e, mask=emask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + b * sc_b + half + e, mask=emask, other=0.0).to(tl.float32)
        x1 = tl.load(src + e, mask=emask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + e, mask=emask, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every read of the head before it is overwritten
        y1 = (x1 * c1 - x2 * s1).to(dst.dtype.element_ty)
        y2 = (x2 * c2 + x1 * s2).to(dst.dtype.element_ty)
        tl.store(dst + e, y1, mask=emask)
        tl.store(dst + half + e, y2, mask=emask)
        if FP8:
            if h >= n_q_heads:  # K: the rotated head as rounded above, quantised per slot into the cache
                r1 = tl.where(emask, y1.to(tl.float32), 0.0)
                r2 = tl.where(emask, y2.to(tl.float32), 0.0)
                k_scale = e4m3_scale(tl.maximum(tl.max(tl.abs(r1), axis=0), tl.max(tl.abs(r2), axis=0)))
                kslot = kc_ptr + b * skc_b + kh * skc_h + slot * skc_s
                tl.store(kslot + e, e4m3_codes(r1, k_scale).to(kc_ptr.dtype.element_ty), mask=emask)
                tl.store(kslot + half + e, e4m3_codes(r2, k_scale).to(kc_ptr.dtype.element_ty), mask=emask)
                tl.store(ks_ptr + b * ss_b + kh * ss_h + slot, k_scale)

else:  # pragma: no cover
    _decode_qkv_kernel = None


def decode_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor | None, wk: torch.Tensor | None,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot: torch.Tensor, *, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Norm (optional), rotate and cache one decode step's q/k/v (see the module docstring).

    Shapes: ``q [B, Hq, D]``, ``k, v [B, Hk, D]`` (last dim contiguous), ``wq, wk [D]`` or both
    ``None``, ``cos, sin [B, D]``, caches ``[B, Hk, L, D]``, ``slot [B]`` (int64). Returns the
    rotated q ``[B, Hq, D]``; K and V are written into the caches. No autograd. ``k_scales, v_scales
    [B, Hk, L]`` (float32): an FP8 cache (``float8_e4m3fn`` caches), each written K / V vector stored as its
    per-slot codes and scale (:func:`~swiftune.kernels.fp8_quant.fp8_quantize_rowwise`'s bytes; K quantised
    after its rotation, as rounded to q's dtype).
    """
    B, Hq, D = q.shape
    Hk = k.shape[1]
    if k.shape != (B, Hk, D) or v.shape != (B, Hk, D) or cos.shape != (B, D) or sin.shape != (B, D):
        raise ValueError(f"decode_qkv shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if (wq is None) != (wk is None) or D % 2:
        raise ValueError("decode_qkv: give both norm weights or neither, and an even head_dim")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, wq, wk)):
        raise RuntimeError("decode_qkv has no backward: call it under torch.no_grad() (decoding)")
    fp8 = k_scales is not None
    if fp8 != (v_scales is not None) or fp8 != (k_cache.dtype == torch.float8_e4m3fn == v_cache.dtype):
        raise ValueError("decode_qkv: an FP8 cache (float8_e4m3fn K and V) takes k_scales and v_scales, and only it")
    named = {"q": q, "k": k, "v": v, "k_cache": k_cache}
    # the kernel writes q's and k's rows through one pointer type: mixed dtypes take the reference
    same_dtype = q.dtype == k.dtype and (fp8 or k.dtype == k_cache.dtype) and (wq is None or wq.dtype == wk.dtype)
    if choose_backend(backend, _decode_qkv_kernel, named) == "reference" or not same_dtype:
        return decode_qkv_reference(q, k, v, wq, wk, eps, cos, sin, k_cache, v_cache, slot, k_scales, v_scales)
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache, v_cache, *((k_scales, v_scales) if fp8 else ()))):
        raise ValueError("decode_qkv needs the last dimension of every tensor contiguous")
    if fp8 and k_scales.stride() != v_scales.stride():
        raise ValueError("decode_qkv: k_scales and v_scales must share their strides")
    q_out = torch.empty(B, Hq + Hk if fp8 else Hq, D, dtype=q.dtype, device=q.device)  # FP8: K rotated here first
    norm = wq is not None
    _decode_qkv_kernel[(B, Hq + Hk)](
        q, k, v, wq if norm else q, wk if norm else q, cos, sin, q_out, k_cache, v_cache, slot,
        k_scales if fp8 else q_out, v_scales if fp8 else q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(k_scales.stride()[:2] if fp8 else (0, 0)), Hq, D, D // 2, float(eps),
        NORM=norm, BLOCK_D=next_pow2(D), BLOCK_HALF=next_pow2(D // 2), FP8=fp8, num_warps=4,
    )
    return q_out[:, :Hq] if fp8 else q_out
