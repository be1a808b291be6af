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

The kernels treat gate and up as flat arrays (they come out of linear layers, contiguous).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .launch import Backend, check_float, choose_backend, needs_int64, tl, triton

ACT_SILU, ACT_GELU, ACT_GELU_TANH = 0, 1, 2
_BLOCK = 1024


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
    _glu_fwd_kernel = None


class GLUFunction(torch.autograd.Function):
    """``round(act(gate)) * up`` with a recomputing backward; saves only gate and up."""

    @staticmethod
    def forward(ctx, gate, up, act: int, force_int64: bool):
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
        gate, up = ctx.saved_tensors
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

