"""Gated MLP activations: SwiGLU and GeGLU, forward and backward in one elementwise kernel each.

Forward, with ``act`` one of silu / exact gelu / tanh gelu and ``round`` the cast to the
input dtype (transformers applies the activation as its own op, so its result is rounded
to bf16 before the product; matching that keeps outputs bit-identical to transformers)::

    a   = round(act(g))
    out = round(a * u)

Backward (computed in float32 from the saved inputs, nothing else saved)::

    du = dout * a
    dg = round(dout * u) * act'(g)

with the derivatives

    silu(g)  = g * sigma(g)                  silu'(g) = sigma(g) * (1 + g * (1 - sigma(g)))
    gelu(g)  = g/2 * (1 + erf(g / sqrt 2))   gelu'(g) = (1 + erf(g / sqrt 2)) / 2 + g * phi(g),
                                             phi(g) = exp(-g^2 / 2) / sqrt(2 pi)
    tanh approximation, with k = sqrt(2 / pi), u(g) = k * (g + 0.044715 g^3), t = tanh(u):
    gelu_t(g) = g/2 * (1 + t)                gelu_t'(g) = (1 + t) / 2 + g/2 * (1 - t^2) * k * (1 + 3 * 0.044715 g^2)

The kernels treat gate and up as flat arrays (they come out of linear layers, contiguous). One more forward
kernel takes them as rows with a stride (``[rows, cols]`` views, each row ``stride`` elements after the one
before): the two column halves of one product that computed gate and up at once (the rollout engine's FP8
decode step, :func:`swiftune.models.lora_linear.stacked_fp8_products`), read in place instead of copied; the
same arithmetic, element by element.

``glu_fp8`` (decoding only, no backward) also quantises each output row to e4m3 in the same program, the bytes
of :func:`swiftune.kernels.fp8_quant.fp8_quantize_rowwise` of the output as rounded: the codes an FP8
``down_proj`` would make of its input, one launch fewer per MLP in an FP8 decode step. A program holds one
whole row (at most :data:`GLU_FP8_MAX_COLS` columns) so that the row's largest magnitude, and with it the
scale, is known before its codes are written.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .fp8_quant import e4m3_codes, e4m3_scale, fp8_quantize_rowwise, fp8_quantize_rowwise_reference
from .launch import Backend, check_float, choose_backend, needs_int64, next_pow2, tl, triton

ACT_SILU, ACT_GELU, ACT_GELU_TANH = 0, 1, 2
_BLOCK = 1024
#: the widest row :func:`glu_fp8`'s one-program-per-row kernel takes (wider rows: the activation kernel, then the
#: rowwise quantiser, the same bytes in two launches)
GLU_FP8_MAX_COLS = 32768


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as transformers' LlamaMLP computes it."""
    return F.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate) * up`` as transformers' GemmaMLP computes it."""
    return F.gelu(gate, approximate=approximate) * up


if triton is not None:

    @triton.jit
    def _act_fwd(g, ACT: tl.constexpr):
        if ACT == 0:
            return g * tl.sigmoid(g)
        elif ACT == 1:
            return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        else:
            u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
            return 0.5 * g * (1.0 + t)

    @triton.jit
    def _act_bwd(g, ACT: tl.constexpr):
        if ACT == 0:
            s = tl.sigmoid(g)
            return s * (1.0 + g * (1.0 - s))
        elif ACT == 1:
            cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
            return cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
        else:
            u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
            du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
            return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * du

    @triton.jit
    def _program_block(n, BLOCK: tl.constexpr, INT64: tl.constexpr):
        """This program's ``BLOCK`` flat offsets (64-bit when ``INT64``) and their mask ``offs < n``."""
        pid = tl.program_id(0)
        if INT64:
            pid = pid.to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        return offs, offs < n

    @triton.jit
    def _glu_fwd_kernel(g_ptr, u_ptr, out_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr, INT64: tl.constexpr):
        offs, mask = _program_block(n, BLOCK, INT64)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = _act_fwd(g, ACT).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_rows_fwd_kernel(g_ptr, u_ptr, out_ptr, cols, g_stride, u_stride, ACT: tl.constexpr,
                             BLOCK: tl.constexpr):
        """A program per (row, block of ``BLOCK`` columns); gate and up rows ``g_stride`` / ``u_stride`` apart,
        ``out`` contiguous ``[rows, cols]``."""
        row = tl.program_id(0).to(tl.int64)
        cols_ = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols_ < cols
        g = tl.load(g_ptr + row * g_stride + cols_, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_stride + cols_, mask=mask, other=0.0).to(tl.float32)
        a = _act_fwd(g, ACT).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * cols + cols_, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_rows_fp8_kernel(g_ptr, u_ptr, out_ptr, q_ptr, s_ptr, cols, g_stride, u_stride,
                             ACT: tl.constexpr, BLOCK: tl.constexpr):
        """A program per row of at most ``BLOCK`` columns: the row's output as :func:`_glu_rows_fwd_kernel`
        rounds it, then its e4m3 codes and float32 scale as the rowwise quantiser makes them of that output
        (masked columns are 0 there too)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        g = tl.load(g_ptr + row * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_stride + offs, mask=mask, other=0.0).to(tl.float32)
        a = _act_fwd(g, ACT).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (a * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * cols + offs, y, mask=mask)
        v = tl.where(mask, y.to(tl.float32), 0.0)
        scale = e4m3_scale(tl.max(tl.abs(v), axis=0))
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * cols + offs, e4m3_codes(v, scale).to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd_kernel(
        dout_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr, INT64: tl.constexpr
    ):
        offs, mask = _program_block(n, BLOCK, INT64)
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = _act_fwd(g, ACT).to(dg_ptr.dtype.element_ty).to(tl.float32)
        da = (dout * u).to(dg_ptr.dtype.element_ty).to(tl.float32)
        tl.store(du_ptr + offs, (dout * a).to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + offs, (da * _act_bwd(g, ACT)).to(dg_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    _glu_fwd_kernel = _glu_rows_fp8_kernel = None


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a ``[rows, cols]`` view whose rows are one stride apart and whose columns are adjacent (a
    column slice of a wider product), without a copy; None where it is not one."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dimensions that do not merge into one stride
        return None


class GLUFunction(torch.autograd.Function):
    """``round(act(gate)) * up`` with a recomputing backward; saves only gate and up."""

    @staticmethod
    def forward(ctx, gate, up, act: int, force_int64: bool):
        rows = None if gate.is_contiguous() and up.is_contiguous() else (_as_rows(gate), _as_rows(up))
        if rows is not None and None not in rows and rows[0].numel() > 0:
            g, u = rows  # read in place (column halves of one product); the flat kernel would need copies
            out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
            grid = (g.shape[0], triton.cdiv(g.shape[1], _BLOCK))
            _glu_rows_fwd_kernel[grid](g, u, out, g.shape[1], g.stride(0), u.stride(0), ACT=act, BLOCK=_BLOCK)
            int64 = force_int64 or needs_int64(out)
        else:
            gate, up = gate.contiguous(), up.contiguous()
            out = torch.empty_like(gate)
            n = gate.numel()
            int64 = force_int64 or needs_int64(gate)
            _glu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, out, n, ACT=act, BLOCK=_BLOCK, INT64=int64)
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.int64 = act, int64
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = (t.contiguous() for t in ctx.saved_tensors)  # (strided views: the flat kernel's layout)
        dout = dout.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _glu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
            dout, gate, up, dg, du, n, ACT=ctx.act, BLOCK=_BLOCK, INT64=ctx.int64
        )
        return dg, du, None, None


def _validate(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_float("gate", gate)
    check_float("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dtype != up.dtype:
        raise TypeError(f"gate ({gate.dtype}) and up ({up.dtype}) must have the same dtype")


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto", _force_int64: bool = False) -> torch.Tensor:
    """``silu(gate) * up``, the SwiGLU MLP activation, bit-identical to transformers in bf16."""
    _validate(gate, up)
    if choose_backend(backend, _glu_fwd_kernel, {"gate": gate, "up": up}) == "reference":
        return swiglu_reference(gate, up)
    return GLUFunction.apply(gate, up, ACT_SILU, _force_int64)


def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: Literal["none", "tanh"] = "none",
    *,
    backend: Backend = "auto",
    _force_int64: bool = False,
) -> torch.Tensor:
    """``gelu(gate) * up`` with exact erf GELU (``"none"``) or its tanh approximation (``"tanh"``)."""
    _validate(gate, up)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if choose_backend(backend, _glu_fwd_kernel, {"gate": gate, "up": up}) == "reference":
        return geglu_reference(gate, up, approximate)
    act = ACT_GELU if approximate == "none" else ACT_GELU_TANH
    return GLUFunction.apply(gate, up, act, _force_int64)


GluActivation = Literal["silu", "none", "tanh"]
"""A gated MLP's activation as the GLU kernels name it: ``"silu"`` (SwiGLU) or GELU exact / tanh (GeGLU)."""


def gated_linear_unit(gate: torch.Tensor, up: torch.Tensor, activation: GluActivation = "silu", *,
                      backend: Backend = "auto") -> torch.Tensor:
    """``act(gate) * up``: :func:`swiglu` for ``"silu"``, :func:`geglu` with that approximation otherwise (the one
    place the name picks the kernel)."""
    if activation == "silu":
        return swiglu(gate, up, backend=backend)
    return geglu(gate, up, activation, backend=backend)


def glu_fp8(gate: torch.Tensor, up: torch.Tensor, approximate: GluActivation = "silu", *,
            backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, codes, scales)``: :func:`swiglu`'s output (``approximate="silu"``) or :func:`geglu`'s (``"none"``,
    ``"tanh"``), and its per-row e4m3 codes (``[rows, cols]``, rows = every axis but the last) and float32 scales
    (``[rows, 1]``), the bytes of ``fp8_quantize_rowwise(out)``, in one launch. For decoding (no autograd), where
    an FP8 ``down_proj`` reads ``out``; ``gate`` / ``up`` may be column views of one wider product."""
    _validate(gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        raise RuntimeError("glu_fp8 has no backward: call it under torch.no_grad() (decoding)")
    acts = {"silu": ACT_SILU, "none": ACT_GELU, "tanh": ACT_GELU_TANH}
    if approximate not in acts:
        raise ValueError(f"approximate must be 'silu', 'none' or 'tanh', got {approximate!r}")
    cols = gate.shape[-1]
    if choose_backend(backend, _glu_rows_fp8_kernel, {"gate": gate, "up": up}) == "reference":
        out = gated_linear_unit(gate, up, approximate, backend="reference")
        codes, scales = fp8_quantize_rowwise_reference(out.reshape(-1, cols))
        return out, codes, scales
    g, u = _as_rows(gate), _as_rows(up)
    if g is None or u is None or g.shape[0] == 0 or next_pow2(cols) > GLU_FP8_MAX_COLS:
        out = gated_linear_unit(gate, up, approximate, backend=backend)
        codes, scales = fp8_quantize_rowwise(out.reshape(-1, cols), backend=backend)
        return out, codes, scales
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    codes = torch.empty((g.shape[0], cols), dtype=torch.float8_e4m3fn, device=gate.device)
    scales = torch.empty((g.shape[0], 1), dtype=torch.float32, device=gate.device)
    block = next_pow2(cols)
    _glu_rows_fp8_kernel[(g.shape[0],)](g, u, out, codes, scales, cols, g.stride(0), u.stride(0), ACT=acts[approximate],
                                        BLOCK=block, num_warps=min(16, max(4, block // 1024)))
    return out, codes, scales
