"""Rotary position embedding of Q and K in one kernel launch.

Layout is that of transformers' ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``)::

    q   [B, Hq, S, D]      k   [B, Hk, S, D]      Hk divides Hq (GQA)
    cos [B, S, D]          sin [B, S, D]          already gathered by position ids

Because cos/sin are given per (row, token), a packed row whose positions restart at every
document is rotated correctly with no extra work.

Math. Split the head dimension into halves ``x = [x1, x2]`` (each ``D/2``), and likewise
``c = [c1, c2]``, ``s = [s1, s2]``. transformers computes ``x * c + rotate_half(x) * s`` with
``rotate_half(x) = [-x2, x1]``, i.e.

    forward:   y1 = x1 * c1 - x2 * s1
               y2 = x2 * c2 + x1 * s2

The map is linear in ``x``; its transpose gives the backward pass

    backward:  dx1 = dy1 * c1 + dy2 * s2
               dx2 = dy2 * c2 - dy1 * s1

For the standard tables (``c1 == c2``, ``s1 == s2``) this is the same rotation with the sine
negated. Nothing but cos and sin is saved for backward.

On a GPU one program handles one (row, token) pair for all Hq + Hk heads, so cos/sin are loaded
once and reused by every head; under the Triton interpreter (CPU) one program takes 64 tokens, the
same arithmetic on a 3-D tile (see :func:`tokens_per_program`). The forward pass rotates q and k
in place when autograd allows it (they are not leaves that require grad); the backward pass writes
fresh gradient tensors, because incoming gradients may be broadcast views that must not be written.
"""

from __future__ import annotations

import torch

from .launch import (Backend, autograd_owner, check_float, choose_backend, kernel_is_interpreted, needs_int64,
                     next_pow2, tl, triton)


def rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch rotary embedding, exactly transformers' ``apply_rotary_pos_emb``."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


if triton is not None:

    @triton.jit
    def _rope_rows(
        x_ptr, y_ptr, c1, c2, s1, s2, b, t, token_ok,
        sx_b, sx_h, sx_s, sx_d, sy_b, sy_h, sy_s, sy_d,
        n_heads, half,
        BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INT64: tl.constexpr,
        TOKENS: tl.constexpr,
    ):
        # TOKENS == 1: b, t are scalars and the tile is [heads, D/2]; otherwise b, t, token_ok are
        # [TOKENS, 1, 1] and the tile is [TOKENS, heads, D/2] (c*, s*: [TOKENS, 1, D/2])
        if TOKENS == 1:
            h = tl.arange(0, BLOCK_H)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
        else:
            h = tl.arange(0, BLOCK_H)[None, :, None]
            d = tl.arange(0, BLOCK_D)[None, None, :]
        if INT64:
            # a stride that fits int32 times a head index may not: a [B, H, S, D]-contiguous gradient of
            # 676K tokens has a head stride of S x D = 86.5M, and head 25 x 86.5M passes 2^31
            h = h.to(tl.int64)
            d = d.to(tl.int64)
        if TOKENS == 1:
            mask = (h < n_heads) & (d < half)
        else:
            mask = token_ok & (h < n_heads) & (d < half)
        x_base = x_ptr + b * sx_b + t * sx_s + h * sx_h
        y_base = y_ptr + b * sy_b + t * sy_s + h * sy_h
        x1 = tl.load(x_base + d * sx_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + (d + half) * sx_d, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(y_base + d * sy_d, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_base + (d + half) * sy_d, y2.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_qk_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
        sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d,
        sqo_b, sqo_h, sqo_s, sqo_d, sko_b, sko_h, sko_s, sko_d,
        sc_b, sc_s, sc_d,
        seq_len, n_tokens, n_q_heads, n_k_heads, half,
        BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
        BLOCK_D: tl.constexpr, INT64: tl.constexpr, TOKENS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if INT64:
            pid = pid.to(tl.int64)
        if TOKENS == 1:
            n = pid
            d = tl.arange(0, BLOCK_D)[None, :]
        else:
            n = pid * TOKENS + tl.arange(0, TOKENS)[:, None, None]
            d = tl.arange(0, BLOCK_D)[None, None, :]
        token_ok = n < n_tokens  # (b, t) pairs flattened: n = b * seq_len + t
        b = n // seq_len
        t = n % seq_len
        if TOKENS == 1:
            dmask = d < half  # the grid has one program per token: none past the end
        else:
            dmask = (d < half) & token_ok
        c_base = b * sc_b + t * sc_s
        c1 = tl.load(cos_ptr + c_base + d * sc_d, mask=dmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_base + (d + half) * sc_d, mask=dmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_base + d * sc_d, mask=dmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_base + (d + half) * sc_d, mask=dmask, other=0.0).to(tl.float32)
        _rope_rows(q_ptr, qo_ptr, c1, c2, s1, s2, b, t, token_ok, sq_b, sq_h, sq_s, sq_d,
                   sqo_b, sqo_h, sqo_s, sqo_d, n_q_heads, half, BACKWARD, BLOCK_HQ, BLOCK_D, INT64, TOKENS)
        _rope_rows(k_ptr, ko_ptr, c1, c2, s1, s2, b, t, token_ok, sk_b, sk_h, sk_s, sk_d,
                   sko_b, sko_h, sko_s, sko_d, n_k_heads, half, BACKWARD, BLOCK_HK, BLOCK_D, INT64, TOKENS)

else:  # pragma: no cover
    _rope_qk_kernel = None


INTERPRETER_TOKENS_PER_PROGRAM = 64


def tokens_per_program(interpreted: bool) -> int:
    """Tokens one program rotates. On a GPU, one: a program per (row, token), every head of q and k, its
    cos/sin loaded once. Under the Triton interpreter, which runs the programs one after another in
    Python, 64: the same arithmetic on ``[64, heads, D/2]`` tiles, so a CPU test's launch runs 64 times
    fewer programs."""
    return INTERPRETER_TOKENS_PER_PROGRAM if interpreted else 1


def _launch(q, k, q_out, k_out, cos, sin, backward: bool, force_int64: bool = False) -> None:
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    # cos/sin may broadcast over the batch ([1, S, D]): stride 0 reuses row 0 for every b.
    sc_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    int64 = force_int64 or needs_int64(q, k, q_out, k_out, cos)
    tokens = tokens_per_program(kernel_is_interpreted(_rope_qk_kernel))
    half = D // 2
    block_d = next_pow2(half)
    block_hq, block_hk = next_pow2(Hq), next_pow2(Hk)
    num_warps = 4 if block_hq * block_d <= 4096 else 8
    _rope_qk_kernel[(triton.cdiv(B * S, tokens),)](
        q, k, q_out, k_out, cos, sin,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
        sc_b, cos.stride(1), cos.stride(2),
        S, B * S, Hq, Hk, half,
        BACKWARD=backward, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, INT64=int64, TOKENS=tokens,
        num_warps=num_warps,
    )


class RopeQKFunction(torch.autograd.Function):
    """Out-of-place rotation: fresh q/k outputs; backward rotates by -sin."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, force_int64: bool):
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        _launch(q, k, q_out, k_out, cos, sin, backward=False, force_int64=force_int64)
        ctx.save_for_backward(cos, sin)
        ctx.force_int64 = force_int64
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return (*_rotate_grads(dq, dk, cos, sin, ctx.force_int64), None, None, None)


class RopeQKInPlaceFunction(torch.autograd.Function):
    """In-place rotation of q and k given as the tensors that own their memory.

    Autograd refuses a Function that modifies a *view* in place and returns two outputs, and
    transformers' q/k are views (``proj.view(B, S, H, D).transpose(1, 2)``). So the Function
    receives the owning tensors ``q_src``/``k_src`` (marked dirty and returned), and the caller
    re-applies the same view. ``layout`` says how ``[B, H, S, D]`` sits on the source:
    ``"bshd"`` (the transposed projection) or ``"bhsd"`` (already contiguous).
    """

    @staticmethod
    def forward(ctx, q_src, k_src, cos, sin, q_geom, k_geom, force_int64: bool):
        q, k = _as_bhsd(q_src, q_geom), _as_bhsd(k_src, k_geom)
        _launch(q, k, q, k, cos, sin, backward=False, force_int64=force_int64)
        ctx.mark_dirty(q_src, k_src)
        ctx.save_for_backward(cos, sin)
        ctx.geom, ctx.force_int64 = (q_geom, k_geom), force_int64
        return q_src, k_src

    @staticmethod
    def backward(ctx, dq_src, dk_src):
        cos, sin = ctx.saved_tensors
        q_geom, k_geom = ctx.geom
        dq, dk = _rotate_grads(_as_bhsd(dq_src, q_geom), _as_bhsd(dk_src, k_geom), cos, sin, ctx.force_int64)
        return _from_bhsd(dq, dq_src.shape, q_geom), _from_bhsd(dk, dk_src.shape, k_geom), None, None, None, None, None


def _rotate_grads(dq, dk, cos, sin, force_int64):
    # Fresh outputs: incoming gradients may be broadcast (stride-0) views that must not be
    # written. empty_like keeps a dense gradient's layout (usually [B, S, H, D] transposed), so
    # each program writes one contiguous stretch of memory; a broadcast one gets a dense layout.
    dq_in, dk_in = torch.empty_like(dq), torch.empty_like(dk)
    _launch(dq, dk, dq_in, dk_in, cos, sin, backward=True, force_int64=force_int64)
    return dq_in, dk_in


Geometry = tuple  # (layout, B, H, S, D)


def _as_bhsd(src: torch.Tensor, geom: Geometry) -> torch.Tensor:
    # reshape is a view for the contiguous sources of the forward (so the rotation lands in
    # place); incoming gradients may be broadcast or strided, where it copies if it must.
    layout, B, H, S, D = geom
    if layout == "bshd":
        return src.reshape(B, S, H, D).transpose(1, 2)
    return src.reshape(B, H, S, D)


def _from_bhsd(t: torch.Tensor, src_shape: torch.Size, geom: Geometry) -> torch.Tensor:
    layout = geom[0]
    t = t.transpose(1, 2) if layout == "bshd" else t
    return t.reshape(src_shape)


def _in_place_source(t: torch.Tensor) -> tuple[torch.Tensor, Geometry] | None:
    """The tensor owning t's memory and how t sits on it, when t can be rotated in place.

    The owner is :func:`autograd_owner`'s: the tensor autograd tracks, so that the rotation
    written into it is recorded in t's history (never a custom Function's internal buffer).
    In-place is used only when t covers all of its owner's memory in the ``[B, H, S, D]`` or
    ``[B, S, H, D]``-transposed layout. Anything else (slices of a fused qkv buffer, leaves,
    views whose owner autograd does not track) takes the out-of-place path. Overwriting a
    tensor some other op saved is caught by autograd's version counter.
    """
    src = autograd_owner(t)
    if src is None:
        return None
    if not src.is_contiguous() or src.numel() != t.numel() or src.storage_offset() != t.storage_offset():
        return None
    B, H, S, D = t.shape
    if t.is_contiguous():
        return src, ("bhsd", B, H, S, D)
    if t.transpose(1, 2).is_contiguous():
        return src, ("bshd", B, H, S, D)
    return None


def _validate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be 4-D [batch, heads, seq, head_dim] (apply_rotary_pos_emb layout); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    B, Hq, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, seq and head_dim")
    if Hq % k.shape[1] != 0:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k heads ({k.shape[1]})")
    if D % 2 != 0:
        raise ValueError(f"head_dim must be even for rotary embedding, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [batch, seq, head_dim], got shape {tuple(t.shape)}")
        if t.shape[0] not in (1, B) or t.shape[1] != S or t.shape[2] != D:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} does not fit q {tuple(q.shape)}: expected [{B} or 1, {S}, {D}]"
            )
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape and layout")
    if q.dtype != k.dtype:
        raise TypeError(f"q ({q.dtype}) and k ({k.dtype}) must have the same dtype")
    if cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise TypeError(f"cos/sin dtype ({cos.dtype}/{sin.dtype}) must match q ({q.dtype}); cast them first")


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = True,
    backend: Backend = "auto",
    _force_int64: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the rotary tables cos/sin in one kernel launch.

    Args:
        q: ``[B, Hq, S, D]``, any strides (e.g. ``view(B, S, H, D).transpose(1, 2)``).
        k: ``[B, Hk, S, D]`` with ``Hq % Hk == 0``.
        cos, sin: ``[B, S, D]`` (or ``[1, S, D]``), same dtype as q, gathered by position ids.
        inplace: write the result into q and k when autograd allows it (saves two
            allocations); the returned tensors are then q and k themselves.
        backend: ``"auto"`` (Triton on CUDA or under the interpreter, else reference),
            ``"triton"`` or ``"reference"``.

    Returns:
        ``(q_rotated, k_rotated)`` equal to transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``.
    """
    _validate(q, k, cos, sin)
    which = choose_backend(backend, _rope_qk_kernel, {"q": q, "k": k, "cos": cos, "sin": sin})
    if which == "reference":
        return rope_qk_reference(q, k, cos, sin)
    if inplace:
        q_src, k_src = _in_place_source(q), _in_place_source(k)
        if q_src is not None and k_src is not None and q_src[0].data_ptr() != k_src[0].data_ptr():
            q_out, k_out = RopeQKInPlaceFunction.apply(
                q_src[0], k_src[0], cos, sin, q_src[1], k_src[1], _force_int64
            )
            q_out, k_out = _as_bhsd(q_out, q_src[1]), _as_bhsd(k_out, k_src[1])
            _check_still_tracked(q, k, q_out, k_out)
            return q_out, k_out
    return RopeQKFunction.apply(q, k, cos, sin, _force_int64)


def _check_still_tracked(q, k, q_out, k_out) -> None:
    # The in-place path must never take a tensor out of the graph (a silent loss of q/k
    # gradients); autograd_owner makes this impossible, and this guard keeps it so.
    if torch.is_grad_enabled() and (
        (q.requires_grad and q_out.grad_fn is None) or (k.requires_grad and k_out.grad_fn is None)
    ):
        raise RuntimeError("rope_qk's in-place path lost the autograd history of q or k; "
                           "call rope_qk(..., inplace=False) and report this as a swiftune bug")
