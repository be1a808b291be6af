"""Routed experts for a decode step (few tokens): two Triton GEMM kernels and a combine kernel.

For ``T`` tokens ``x [T, H]``, each routed to ``k`` distinct experts ``idx [T, k]`` with routing
weights ``r [T, k]``, expert ``e`` having gate/up columns ``G_e, U_e [H, I]`` (+ biases ``bg_e, bu_e``)
and a down matrix ``D_e [I, H]`` (+ bias ``bd_e``)::

    h_{t,j}   = act(x_t G_e + bg_e, x_t U_e + bu_e)                       e = idx[t, j]
    y_{t,j}   = r_{t,j} (h_{t,j} D_e + bd_e)
    out_t     = y_{t,j_1} + y_{t,j_2} + ... + y_{t,j_k}      slots by ascending expert id, each add
                                                             rounded to the activation dtype

    act(g, u) = silu(g) u                                    (Qwen3-MoE, Mixtral)
    act(g, u) = (clamp(u, -l, l) + 1) g' sigmoid(alpha g'),  g' = min(g, l)    (gpt-oss, clamped SwiGLU)

No backward (decoding runs under ``no_grad``). The combine's order and per-add roundings are those
of the grouped-GEMM path of :func:`swiftune.models.experts.rollout_experts_forward` (transformers'
experts loop order; ``h`` and ``y`` themselves are rounded once each here, where that path rounds
after each op): the kernels use no atomics, so a CUDA-graph replay equals the eager step bit for bit.

Where the work goes: three launches, no sort before them (static shapes, no host sync: capturable
in a CUDA graph). The ``T * k`` assignments are read in flat order ``a = t k + j``; a program of
expert ``e`` finds its own (at most ``T``: a token's experts are distinct) by a stream compaction in
registers (a prefix sum over ``idx == e``), in ascending ``a``, the order a stable sort by expert gives.

* kernel 1, grid ``(E, I / BLOCK_N)``: a program whose expert has no rows returns at once; else it
  gathers its expert's rows of ``x``, multiplies them by its gate and up column tiles (so every
  weight byte is read once per step, however many of the expert's rows there are), adds the biases,
  applies the activation in registers and stores ``h [T * k, I]`` (row ``a``) in the activation dtype;
* kernel 2, grid ``(E, H / BLOCK_N)``: ``h @ D_e`` (+ bias) times the routing weight, rounded to the
  activation dtype, stored at ``y [t, rank]``, ``rank`` = how many of token ``t``'s experts have a
  smaller id than ``e`` (the slot's place in ascending expert order);
* kernel 3, grid ``(T, H / BLOCK_H)``: ``out_t = y[t, 0] + y[t, 1] + ...`` one rounded add at a time.

Accumulation is float32 (``tl.dot`` with IEEE float32 products for fp32 weights, tensor cores for
bf16/fp16); ``h`` and ``y`` are rounded once each to the activation dtype.

Both weight layouts of transformers' fused experts are read through strides: ``[E, 2I, H]`` /
``[E, H, I]`` (``x W^T``: Qwen3-MoE, Mixtral; gate = first ``I`` rows) and, ``transposed``, ``[E, H, 2I]``
/ ``[E, I, H]`` (``x W``: gpt-oss, whose gate and up columns alternate: ``interleaved``). Interleaved
columns are read as one contiguous tile of ``2 BLOCK_N`` fused columns and one dot, the accumulator
split into gate (even) and up (odd) columns after the reduction.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ._fp8_common import round_to_bf16
from .launch import Backend, choose_backend, kernel_is_interpreted, next_pow2, tl, triton

__all__ = ["moe_decode", "moe_decode_interpreted", "moe_decode_reference"]

Activation = Literal["silu", "clamped_swiglu"]

#: the most rows a program multiplies at once (a block of one expert's rows; more rows loop)
MAX_BLOCK_M = 64
#: assignments a program scans at once when it looks for its expert's (more loop)
MAX_BLOCK_A = 64


def _gate_up_columns(gate_up_proj: torch.Tensor, transposed: bool, interleaved: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, U)`` as ``[E, H, I]`` views of a fused ``gate_up_proj`` in either layout."""
    b = gate_up_proj if transposed else gate_up_proj.transpose(1, 2)  # [E, H, 2I]
    if interleaved:
        return b[..., ::2], b[..., 1::2]
    inter = b.shape[-1] // 2
    return b[..., :inter], b[..., inter:]


def _activate(gate: torch.Tensor, up: torch.Tensor, activation: Activation, alpha: float, limit: float
              ) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


def moe_decode_reference(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor, *, transposed: bool, interleaved: bool = False, gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None, activation: Activation = "silu", swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0, compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Plain PyTorch: a loop over the experts in ``compute_dtype`` (float64 by default), the ``k``
    outputs of a token summed in ``compute_dtype``; returned in ``hidden``'s dtype."""
    c = compute_dtype
    gate_w, up_w = _gate_up_columns(gate_up_proj, transposed, interleaved)
    down_w = down_proj if transposed else down_proj.transpose(1, 2)  # [E, I, H]
    if gate_up_bias is not None:
        gate_b, up_b = (gate_up_bias[:, ::2], gate_up_bias[:, 1::2]) if interleaved else gate_up_bias.chunk(2, -1)
    out = torch.zeros(hidden.shape, dtype=c, device=hidden.device)
    for e in top_k_index.unique().tolist():
        tokens, slots = torch.where(top_k_index == e)
        x = hidden[tokens].to(c)
        gate, up = x @ gate_w[e].to(c), x @ up_w[e].to(c)
        if gate_up_bias is not None:
            gate, up = gate + gate_b[e].to(c), up + up_b[e].to(c)
        y = _activate(gate, up, activation, swiglu_alpha, swiglu_limit) @ down_w[e].to(c)
        if down_bias is not None:
            y = y + down_bias[e].to(c)
        out.index_add_(0, tokens, y * top_k_weights[tokens, slots, None].to(c))
    return out.to(hidden.dtype)


if triton is not None:

    @triton.jit
    def _bf16_rounded(v, ROUND: tl.constexpr):
        """float32 ``v`` rounded to the nearest bf16 (ties to even), still float32, when ``ROUND``: the
        interpreter's float32 -> bf16 cast truncates where compiled Triton's rounds, so the cast after
        this is exact on both."""
        if ROUND:
            v = round_to_bf16(v)
        return v

    @triton.jit
    def _dot(a, b, acc, DOT_F32: tl.constexpr):
        """``acc + a @ b``: in IEEE float32 for fp32 operands and in the interpreter (whose 16-bit
        arithmetic is unreliable), else on the tensor cores with float32 accumulation."""
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _expert_count(idx_ptr, num_assign, e, BLOCK_A: tl.constexpr):
        """How many of the ``num_assign`` flat assignments ``idx`` go to expert ``e``."""
        count = 0
        for a0 in range(0, num_assign, BLOCK_A):
            a = a0 + tl.arange(0, BLOCK_A)
            ids = tl.load(idx_ptr + a, mask=a < num_assign, other=-1)
            count += tl.sum((ids == e).to(tl.int32), axis=0)
        return count

    @triton.jit
    def _expert_assignments(idx_ptr, num_assign, e, m0, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr):
        """The flat indices of expert ``e``'s assignments ``m0 .. m0 + BLOCK_M - 1`` (in ascending order,
        counting only ``e``'s): a stream compaction in registers, chunk by chunk of ``BLOCK_A``
        assignments (a running count plus a prefix sum picks each one's place), so no sort runs
        before the kernel. Places past the expert's count come back 0 (masked by the caller)."""
        want = m0 + tl.arange(0, BLOCK_M)
        found = tl.zeros((BLOCK_M,), dtype=tl.int32)
        seen = 0
        for a0 in range(0, num_assign, BLOCK_A):
            a = a0 + tl.arange(0, BLOCK_A)
            mine = (tl.load(idx_ptr + a, mask=a < num_assign, other=-1) == e).to(tl.int32)
            place = seen + tl.cumsum(mine, axis=0) - 1  # this chunk's rows' places among e's rows
            hit = (mine[None, :] > 0) & (place[None, :] == want[:, None])  # [BLOCK_M, BLOCK_A]: one hit per row
            found += tl.sum(tl.where(hit, a[None, :], 0), axis=1)
            seen += tl.sum(mine, axis=0)
        return found

    @triton.jit
    def _gate_up_halves(x_ptr, w_e, b_e, tokens, r_mask, s_xt, s_wk, s_wc, hidden, inter, n, n_mask,
                        HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Gate and up accumulators of columns ``n`` when the gate is the first half (``n``, ``I + n``):
        two weight tiles, each read along its own contiguous axis."""
        kk = tl.arange(0, BLOCK_K)
        gate_cols = n.to(tl.int64)
        up_cols = gate_cols + inter
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + kk
            k_mask = k < hidden
            x = tl.load(x_ptr + tokens[:, None] * s_xt + k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            w_rows = w_e + k[:, None].to(tl.int64) * s_wk
            acc_g = _dot(x, tl.load(w_rows + gate_cols[None, :] * s_wc, mask=w_mask, other=0.0), acc_g, DOT_F32)
            acc_u = _dot(x, tl.load(w_rows + up_cols[None, :] * s_wc, mask=w_mask, other=0.0), acc_u, DOT_F32)
        if HAS_BIAS:
            acc_g += tl.load(b_e + gate_cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_e + up_cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        return acc_g, acc_u

    @triton.jit
    def _gate_up_interleaved(x_ptr, w_e, b_e, tokens, r_mask, s_xt, s_wk, hidden, inter, n0,
                             HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Gate and up accumulators of columns ``n0 .. n0 + BLOCK_N - 1`` when gate and up alternate
        (gpt-oss, ``[E, H, 2I]`` with unit column stride): one contiguous ``[BLOCK_K, 2 BLOCK_N]`` tile
        of fused columns ``2 n0 ..`` a step and one dot, split into even (gate) and odd (up) columns
        once at the end. Two stride-2 tiles would each load every other element, which breaks the
        vector loads the decode step's bandwidth rests on."""
        kk = tl.arange(0, BLOCK_K)
        c = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
        c_mask = c < 2 * inter
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + kk
            k_mask = k < hidden
            x = tl.load(x_ptr + tokens[:, None] * s_xt + k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w = tl.load(w_e + k[:, None].to(tl.int64) * s_wk + c[None, :], mask=k_mask[:, None] & c_mask[None, :],
                        other=0.0)
            acc = _dot(x, w, acc, DOT_F32)
        if HAS_BIAS:
            acc += tl.load(b_e + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        return tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))

    @triton.jit
    def _moe_gate_up_kernel(
        x_ptr, idx_ptr, w_ptr, b_ptr, h_ptr,
        s_xt, s_we, s_wk, s_wc, s_be, s_hm,
        num_assign, top_k, hidden, inter, alpha, limit,
        HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, INTERLEAVED: tl.constexpr, DOT_F32: tl.constexpr,
        ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_A: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64)
        count = _expert_count(idx_ptr, num_assign, e, BLOCK_A)
        if count == 0:  # no row routed to this expert: no weight read, nothing written
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < inter
        w_e = w_ptr + e * s_we
        for m0 in range(0, count, BLOCK_M):  # one block in practice (an expert has <= T rows)
            r_mask = m0 + tl.arange(0, BLOCK_M) < count
            assignment = _expert_assignments(idx_ptr, num_assign, e, m0, BLOCK_M, BLOCK_A).to(tl.int64)
            tokens = assignment // top_k
            if INTERLEAVED:
                acc_g, acc_u = _gate_up_interleaved(x_ptr, w_e, b_ptr + e * s_be, tokens, r_mask, s_xt, s_wk,
                                                    hidden, inter, tl.program_id(1) * BLOCK_N, HAS_BIAS, DOT_F32,
                                                    BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                acc_g, acc_u = _gate_up_halves(x_ptr, w_e, b_ptr + e * s_be, tokens, r_mask, s_xt, s_wk, s_wc,
                                               hidden, inter, n, n_mask, HAS_BIAS, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K)
            if CLAMPED:  # gpt-oss: gate clamped above, up clamped both ways, sigmoid(alpha g), (up + 1)
                g = tl.minimum(acc_g, limit)
                u = tl.minimum(tl.maximum(acc_u, -limit), limit)
                act = (u + 1.0) * (g * tl.sigmoid(alpha * g))
            else:
                act = acc_g * tl.sigmoid(acc_g) * acc_u
            tl.store(h_ptr + assignment[:, None] * s_hm + n[None, :],
                     _bf16_rounded(act, ROUND_BF16).to(h_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _moe_down_kernel(
        h_ptr, idx_ptr, rw_ptr, w_ptr, b_ptr, y_ptr,
        s_hm, s_rt, s_rk, s_we, s_wk, s_wn, s_be, s_yt, s_yr,
        num_assign, top_k, inter, hidden,
        HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64)
        count = _expert_count(idx_ptr, num_assign, e, BLOCK_A)
        if count == 0:
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < hidden
        w_e = w_ptr + e * s_we
        kk = tl.arange(0, BLOCK_K)
        slots = tl.arange(0, BLOCK_SLOTS)
        for m0 in range(0, count, BLOCK_M):
            r_mask = m0 + tl.arange(0, BLOCK_M) < count
            assignment = _expert_assignments(idx_ptr, num_assign, e, m0, BLOCK_M, BLOCK_A).to(tl.int64)
            token = assignment // top_k
            slot = assignment % top_k
            weight = tl.load(rw_ptr + token * s_rt + slot * s_rk, mask=r_mask, other=0.0).to(tl.float32)
            # the slot's place among its token's experts in ascending id order (its experts are distinct)
            others = tl.load(idx_ptr + token[:, None] * top_k + slots[None, :],
                             mask=r_mask[:, None] & (slots[None, :] < top_k), other=e)
            rank = tl.sum((others < e).to(tl.int32), axis=1)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                k = k0 + kk
                k_mask = k < inter
                hk = tl.load(h_ptr + assignment[:, None] * s_hm + k[None, :],
                             mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_e + k[:, None].to(tl.int64) * s_wk + n[None, :].to(tl.int64) * s_wn,
                            mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc = _dot(hk, w, acc, DOT_F32)
            if HAS_BIAS:
                acc += tl.load(b_ptr + e * s_be + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            out = acc * weight[:, None]
            dst = y_ptr + token[:, None] * s_yt + rank[:, None] * s_yr + n[None, :]
            tl.store(dst, _bf16_rounded(out, ROUND_BF16).to(y_ptr.dtype.element_ty),
                     mask=r_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _moe_combine_kernel(y_ptr, out_ptr, s_yt, s_yr, s_ot, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                            ROUND_BF16: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        n_mask = n < hidden
        row = y_ptr + t * s_yt + n
        acc = tl.load(row, mask=n_mask, other=0.0)
        for r in tl.static_range(1, TOP_K):  # one add per slot, rounded each time (the eager combine's order)
            part = tl.load(row + r * s_yr, mask=n_mask, other=0.0)
            acc = _bf16_rounded(acc.to(tl.float32) + part.to(tl.float32), ROUND_BF16).to(y_ptr.dtype.element_ty)
        tl.store(out_ptr + t * s_ot + n, acc, mask=n_mask)

else:  # pragma: no cover
    _moe_gate_up_kernel = _moe_down_kernel = _moe_combine_kernel = None


def moe_decode_interpreted() -> bool:
    """Whether the kernels run through the Triton interpreter (``TRITON_INTERPRET=1`` at import: CPU
    tensors) rather than compiled (CUDA tensors)."""
    return kernel_is_interpreted(_moe_gate_up_kernel)


def _check_inputs(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor, transposed: bool,
                  gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, activation: str) -> None:
    if hidden.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape[0] != hidden.shape[0]:
        raise ValueError(f"moe_decode takes hidden [T, H] and top_k_index [T, k]; got {tuple(hidden.shape)} and "
                         f"{tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights {tuple(top_k_weights.shape)} must have top_k_index's shape "
                         f"{tuple(top_k_index.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64) or top_k_weights.dtype.is_complex \
            or not top_k_weights.dtype.is_floating_point:
        raise TypeError(f"top_k_index must be int32/int64 and top_k_weights floating; got {top_k_index.dtype}, "
                        f"{top_k_weights.dtype}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3 or gate_up_proj.shape[0] != down_proj.shape[0]:
        raise ValueError(f"expert weights must be [E, ., .] stacks with one E; got gate_up_proj "
                         f"{tuple(gate_up_proj.shape)}, down_proj {tuple(down_proj.shape)}")
    E, H = gate_up_proj.shape[0], hidden.shape[1]
    want_gu, want_d = ((E, H, None), (E, None, H)) if transposed else ((E, None, H), (E, H, None))
    two_i = gate_up_proj.shape[2] if transposed else gate_up_proj.shape[1]
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    ok_gu = all(w is None or w == s for w, s in zip(want_gu, gate_up_proj.shape))
    ok_d = all(w is None or w == s for w, s in zip(want_d, down_proj.shape))
    if not (ok_gu and ok_d) or two_i != 2 * inter:
        layout = "[E, H, 2I] / [E, I, H] (transposed=True)" if transposed else "[E, 2I, H] / [E, H, I]"
        raise ValueError(f"expert weights gate_up_proj {tuple(gate_up_proj.shape)}, down_proj "
                         f"{tuple(down_proj.shape)} do not match hidden size {H} in the layout {layout}; "
                         "pass transposed= as the module stores them (ExpertsSpec.transposed)")
    if gate_up_bias is not None and gate_up_bias.shape != (E, 2 * inter):
        raise ValueError(f"gate_up_bias must be [E, 2I] = {(E, 2 * inter)}, got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and down_bias.shape != (E, H):
        raise ValueError(f"down_bias must be [E, H] = {(E, H)}, got {tuple(down_bias.shape)}")
    if activation not in ("silu", "clamped_swiglu"):
        raise ValueError(f"activation must be 'silu' or 'clamped_swiglu' (gpt-oss), got {activation!r}")
    floats = (torch.float16, torch.bfloat16, torch.float32)
    dtypes = {t.dtype for t in (hidden, gate_up_proj, down_proj, gate_up_bias, down_bias) if t is not None}
    if len(dtypes) != 1 or hidden.dtype not in floats:
        raise TypeError(f"moe_decode needs hidden, the expert weights and biases in one of fp16/bf16/fp32; got "
                        f"{sorted(str(d) for d in dtypes)}: cast them to the activation dtype")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in
                                       (hidden, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)):
        raise RuntimeError("moe_decode has no backward: call it under torch.no_grad() (decoding)")


def moe_decode(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor, *, transposed: bool, interleaved: bool = False, gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None, activation: Activation = "silu", swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0, backend: Backend = "auto", block_n: int | None = None, block_k: int | None = None,
    num_warps: int | None = None, block_m: int | None = None,
) -> torch.Tensor:
    """The routed experts of a decode step (module docstring): ``[T, H]`` tokens, ``[T, k]`` distinct
    experts and routing weights -> ``[T, H]`` in ``hidden``'s dtype.

    ``gate_up_proj`` / ``down_proj``: ``[E, 2I, H]`` / ``[E, H, I]``, or with ``transposed``
    ``[E, H, 2I]`` / ``[E, I, H]``; ``interleaved``: gate and up columns alternate (gpt-oss), else the
    gate is the first half. ``activation``: ``"silu"`` (``silu(g) u``) or ``"clamped_swiglu"``
    (gpt-oss's, with ``swiglu_alpha`` / ``swiglu_limit``). ``block_n`` / ``block_k`` / ``num_warps``: the
    GEMM tiles' output width and reduction depth and the warps of a program (``None``: 32 columns for
    gate/up, 64 for down; depth 64 up to 16 tokens, 128 above, 32 in fp32; 4 warps up to 16 tokens, 8
    above and in fp32: where sm_90 builds of these tiles hold their registers without spilling; the
    interleaved layout above 16 tokens in 16-bit: 64 columns for both, depth 64, 4 warps). ``block_m``:
    the rows of one expert a program multiplies at once, a power of two >= 16 (``None``: the token
    count's next power of two, 16 to 64; an expert with more rows loops, reading its weights again). No
    autograd; where the Triton kernels cannot run (CPU without the interpreter, ``backend="reference"``)
    the float32 loop.
    """
    _check_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, transposed, gate_up_bias, down_bias,
                  activation)
    named = {"hidden": hidden, "top_k_index": top_k_index, "top_k_weights": top_k_weights,
             "gate_up_proj": gate_up_proj, "down_proj": down_proj}
    if choose_backend(backend, _moe_gate_up_kernel, named) == "reference":
        return moe_decode_reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, transposed=transposed,
                                    interleaved=interleaved, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                    activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                                    compute_dtype=torch.float32)
    tokens, top_k = top_k_index.shape
    num_experts, size = gate_up_proj.shape[0], hidden.shape[1]
    if tokens == 0:  # nothing routed (an empty grid would not launch)
        return hidden.new_empty(0, size)
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    # each program finds its expert's assignments itself (no sort beforehand): in flat order, [T * k]
    flat = top_k_index.reshape(-1).contiguous()
    num_assign = flat.numel()
    block_a = min(MAX_BLOCK_A, max(16, next_pow2(num_assign)))
    many = tokens > 16
    if block_m is None:
        block_m = min(MAX_BLOCK_M, max(16, next_pow2(tokens)))
    elif block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16 (the tensor cores' smallest tile), got {block_m}")
    interpreted = kernel_is_interpreted(_moe_gate_up_kernel)
    flags = dict(DOT_F32=interpreted or hidden.dtype == torch.float32,
                 ROUND_BF16=interpreted and hidden.dtype == torch.bfloat16)

    def tile(n: int, default: int) -> int:
        return max(16, min(next_pow2(n), block_n or default))

    fp32 = hidden.dtype == torch.float32
    # above 16 rows: 64-column tiles (gpt-oss: a 128-column fused gate/up tile), depth 64, 4 warps: the fastest of
    # benchmarks.moe_decode's sweep at 32 and 64 tokens on the H200 for the interleaved layout, and at 64 tokens
    # for the gate-then-up one (Qwen3-30B-A3B: 0.57 ms a layer against 0.75 with 32/128/8,
    # docs/results/2026-12-02/moe_decode_h200.json), which the engine sends past 16 tokens only when asked
    wide = not fp32 and many
    if block_n is None and wide:
        block_n = 64
    if block_k is None:
        block_k = 32 if fp32 else 64 if not many or wide else 128
    if num_warps is None:
        num_warps = 8 if fp32 or (many and not wide) else 4

    def depth(n: int) -> int:
        return max(16, min(next_pow2(n), block_k))

    # gate/up columns: (k, column) strides of the fused stack
    s_wk, s_wc = (gate_up_proj.stride(1), gate_up_proj.stride(2)) if transposed else \
        (gate_up_proj.stride(2), gate_up_proj.stride(1))
    if interleaved and s_wc != 1:  # the interleaved tile is read as contiguous columns: an [E, H, 2I] copy
        # (gpt-oss's own stacks are already so; only a strided view or the untransposed layout pays it)
        gate_up_proj = (gate_up_proj if transposed else gate_up_proj.transpose(1, 2)).contiguous()
        s_wk, s_wc = gate_up_proj.stride(1), 1
    h = torch.empty(tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    bias = gate_up_bias if gate_up_bias is not None else hidden
    n1 = tile(inter, 32)
    _moe_gate_up_kernel[(num_experts, triton.cdiv(inter, n1))](
        hidden, flat, gate_up_proj, bias, h,
        hidden.stride(0), gate_up_proj.stride(0), s_wk, s_wc, bias.stride(0), h.stride(0),
        num_assign, top_k, size, inter, float(swiglu_alpha), float(swiglu_limit),
        HAS_BIAS=gate_up_bias is not None, CLAMPED=activation == "clamped_swiglu", INTERLEAVED=interleaved, **flags,
        BLOCK_M=block_m, BLOCK_N=n1, BLOCK_K=depth(size), BLOCK_A=block_a, num_warps=num_warps,
    )
    # down: (reduction over I, output column over H) strides
    s_dk, s_dn = (down_proj.stride(1), down_proj.stride(2)) if transposed else \
        (down_proj.stride(2), down_proj.stride(1))
    y = torch.empty(tokens, top_k, size, dtype=hidden.dtype, device=hidden.device)
    bias = down_bias if down_bias is not None else hidden
    n2 = tile(size, 64)
    _moe_down_kernel[(num_experts, triton.cdiv(size, n2))](
        h, flat, top_k_weights, down_proj, bias, y,
        h.stride(0), top_k_weights.stride(0), top_k_weights.stride(1),
        down_proj.stride(0), s_dk, s_dn, bias.stride(0), y.stride(0), y.stride(1),
        num_assign, top_k, inter, size,
        HAS_BIAS=down_bias is not None, **flags, BLOCK_M=block_m, BLOCK_N=n2, BLOCK_K=depth(inter),
        BLOCK_A=block_a, BLOCK_SLOTS=next_pow2(top_k), num_warps=num_warps,
    )
    out = torch.empty(tokens, size, dtype=hidden.dtype, device=hidden.device)
    block_h = min(1024, next_pow2(size))
    _moe_combine_kernel[(tokens, triton.cdiv(size, block_h))](
        y, out, y.stride(0), y.stride(1), out.stride(0), size, TOP_K=top_k, BLOCK_H=block_h,
        ROUND_BF16=flags["ROUND_BF16"], num_warps=4,
    )
    return out
