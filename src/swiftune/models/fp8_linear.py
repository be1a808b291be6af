"""FP8 frozen base weights: ``float8_e4m3fn`` with one float32 scale per output row.

A linear weight ``W`` (``[out, in]``) is stored as ``Q = round_e4m3(W / s)`` with ``s[o] =
max_k |W[o, k]| / 448`` (448: e4m3's largest finite value; a row of zeros gets ``s = 1``), computed at
load in float32. The layer computes ``y = x (Q * s)^T + b``, the weight staying frozen:

    forward        y  = x W_q^T + b,       W_q = Q * s  (s broadcast over the input axis)
    backward       dx = g W_q = (g * s^T) Q
                   db = sum_N g            (only when the bias trains)

Two ways to run it, chosen per layer (``FP8Linear.scaled_mm``) and checked per call:

- ``torch._scaled_mm`` (CUDA with compute capability >= 8.9, bf16 compute, both matrix sides
  multiples of 16): the activation is quantised on the fly with its own per-row scales (``x = Qx *
  sx``, :func:`quantize_activation`: the fused Triton kernel of :mod:`swiftune.kernels.fp8_quant` on
  CUDA), then ``y = (Qx Q^T) * sx * s^T`` on the FP8
  tensor cores. In backward the weight scale sits on the summed axis, so it is folded into the
  upstream gradient first: ``dx = quant(g * s^T) Q`` with per-row scales of ``g * s^T`` and a
  column-major copy of ``Q`` (made per call: 1 byte per weight, instead of keeping a second copy).
- the dequantising reference (CPU, older GPUs, other dtypes): ``W_q`` rebuilt in float32 and cast
  to the compute dtype in forward and again in backward (never kept: an FP8 model holds 1 byte per
  base weight, not 3), then a plain matmul. This is exactly plain transformers with
  ``W = dequantize_rowwise(Q, s)`` substituted, which the tests use as the reference.

:class:`FP8Linear` subclasses ``nn.Linear`` so PEFT wraps it in its ordinary ``lora.Linear``
(``target_modules="all-linear"`` finds it too): the adapters' names and shapes are those of the
unquantised model, and a saved adapter loads in plain PEFT on the bf16 base. Its
``compute_dtype`` attribute is what PEFT reads (as for bitsandbytes' layers) to give the adapters
the model's dtype rather than e4m3's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.fp8_quant import fp8_quantize_rowwise

__all__ = ["FP8_DTYPE", "FP8Linear", "FP8State", "dequantize_rowwise", "fp8_grad_input", "fp8_matmul",
           "fp8_matmul_supported", "is_fp8_linear", "quantize_activation", "quantize_model_fp8", "quantize_rowwise"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_rowwise(t: torch.Tensor, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, s)`` with ``t ~= Q * s``: ``Q`` e4m3 of ``t``'s shape, ``s`` float32 ``[..., 1]``, one
    scale per row (the last axis is the row). The row's largest magnitude maps to 448, so no value
    saturates; division (not a reciprocal multiply) so the largest maps there exactly.
    ``overwrite``: ``t`` is a float32 temporary of the caller's, divided in place."""
    # the max norm reduces without an |t| temporary, and is exact in t's own dtype; then one float32
    # copy (4 bytes an element) is divided in place and cast to e4m3
    amax = torch.linalg.vector_norm(t, ord=float("inf"), dim=-1, keepdim=True).to(torch.float32)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    t32 = t.to(torch.float32)
    q = t32.div_(scale) if (t32 is not t or overwrite) else t32 / scale
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Q * s`` in float32 (e4m3 times a float32 scale is exact there), then cast to ``dtype``."""
    w = q.to(torch.float32)
    return w.mul_(scale).to(dtype)


def fp8_matmul_supported(device: torch.device | str | None = None) -> bool:
    """Whether ``torch._scaled_mm`` with per-row scales runs on ``device``'s GPU (CUDA, compute
    capability >= 8.9: Ada and Hopper and later)."""
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass(frozen=True)
class FP8State:
    """What a matmul needs besides the e4m3 weight: its per-row scales ``[out, 1]`` and whether
    ``torch._scaled_mm`` may be used (the caller's GPU has FP8 tensor cores)."""

    scale: torch.Tensor
    scaled_mm: bool


def _use_scaled_mm(state: FP8State, a: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    # _scaled_mm takes bf16 outputs with per-row scales and needs both matrix sides in multiples of 16
    return (state.scaled_mm and dtype == torch.bfloat16 and a.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0
            and weight.shape[1] % 16 == 0)


def quantize_activation(x2: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes and float32 scales of ``x2 * col_scale`` (``[N, K]``, ``[N, 1]``) for
    ``_scaled_mm``: the fused Triton kernel on CUDA, its plain-PyTorch reference elsewhere (CPU
    torch's ``_scaled_mm`` runs the tests; the bytes are the same either way)."""
    x2 = x2.detach()  # the codes are a value, not a function autograd differentiates
    return fp8_quantize_rowwise(x2, col_scale, backend="auto" if x2.is_cuda else "reference")


def fp8_matmul(x2: torch.Tensor, weight: torch.Tensor, state: FP8State, dtype: torch.dtype,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x2 (Q * s)^T + b`` for ``x2`` ``[N, in]``, in ``dtype`` (see the module doc for the two paths)."""
    if _use_scaled_mm(state, x2, weight, dtype):
        xq, xs = quantize_activation(x2)
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=state.scale.view(1, -1), out_dtype=dtype)
    else:
        y = torch.mm(x2.to(dtype), dequantize_rowwise(weight, state.scale, dtype).t())
    return y if bias is None else y.add_(bias.to(dtype))


def fp8_grad_input(g2: torch.Tensor, weight: torch.Tensor, state: FP8State, dtype: torch.dtype) -> torch.Tensor:
    """``g2 (Q * s)`` for the upstream gradient ``g2`` ``[N, out]``, in ``dtype``."""
    if _use_scaled_mm(state, g2, weight, dtype):
        # the weight's scales multiplied in inside the quantisation (one float32 rounding, no float32
        # copy of g2 on CUDA); the codes come out row-major as _scaled_mm's first operand must be
        gq, gs = quantize_activation(g2, state.scale.view(-1))
        ones = torch.ones(1, weight.shape[1], device=weight.device, dtype=torch.float32)
        # _scaled_mm's second operand must be column-major: Q^T made contiguous, viewed back as Q
        return torch._scaled_mm(gq, weight.t().contiguous().t(), scale_a=gs, scale_b=ones, out_dtype=dtype)
    return torch.mm(g2.to(dtype), dequantize_rowwise(weight, state.scale, dtype))


class FP8LinearFunction(torch.autograd.Function):
    """``y = x (Q * s)^T + b`` with the weight frozen; saves only ``Q`` (1 byte per weight)."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, dtype: torch.dtype, scaled_mm: bool):  # type: ignore[override]
        state = FP8State(scale, scaled_mm)
        shape = x.shape
        y = fp8_matmul(x.reshape(-1, shape[-1]), weight, state, dtype, bias)
        ctx.save_for_backward(weight, scale)
        ctx.dtype, ctx.scaled_mm, ctx.shape, ctx.x_dtype = dtype, scaled_mm, shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        weight, scale = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        dx = dbias = None
        if ctx.needs_input_grad[0]:
            dx = fp8_grad_input(g2, weight, FP8State(scale, ctx.scaled_mm), ctx.dtype).to(ctx.x_dtype).view(ctx.shape)
        if ctx.needs_input_grad[3]:
            dbias = g2.sum(0).to(ctx.bias_dtype)
        return dx, None, None, dbias, None, None


class FP8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is e4m3 (``weight``, ``[out, in]``) with float32 per-row
    scales (the ``weight_scale`` buffer, ``[out, 1]``); computes in the autocast dtype when
    autocast is on, else in the input's dtype (as ``nn.Linear`` computes in its weight's)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: torch.device | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16, scaled_mm: bool = False) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-precision weight first
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.compute_dtype = compute_dtype  # read by PEFT for the adapters' dtype
        self.scaled_mm = scaled_mm

    @classmethod
    def from_linear(cls, linear: nn.Linear, scaled_mm: bool | None = None) -> FP8Linear:
        """Quantise ``linear``'s weight per output row (its bias kept as it is, frozen)."""
        w = linear.weight.detach()
        if scaled_mm is None:
            scaled_mm = fp8_matmul_supported(w.device)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, device=torch.device("meta"),
                    compute_dtype=w.dtype, scaled_mm=scaled_mm)
        q, scale = quantize_rowwise(w)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = scale
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``Q * s`` in ``dtype`` (default: the compute dtype): what the reference path multiplies by."""
        return dequantize_rowwise(self.weight, self.weight_scale, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        return FP8LinearFunction.apply(x, self.weight, self.weight_scale, self.bias, dtype, self.scaled_mm)

    def _apply(self, fn, recurse: bool = True):
        # model.to(torch.bfloat16) / .half() cast every floating tensor: that would turn Q into its
        # unscaled values and round the scales. Seen as integers for the call, both only move device.
        self.weight.data = self.weight.data.view(torch.uint8)
        self.weight_scale = self.weight_scale.view(torch.int32)
        try:
            out = super()._apply(fn, recurse)
        finally:
            self.weight.data = self.weight.data.view(FP8_DTYPE)
            self.weight_scale = self.weight_scale.view(torch.float32)
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype  # what a cast asked for, if any
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"float8_e4m3fn per-row scales, compute_dtype={self.compute_dtype}, scaled_mm={self.scaled_mm}")


def is_fp8_linear(module: nn.Module) -> bool:
    return isinstance(module, FP8Linear)


def quantize_model_fp8(model: nn.Module, scaled_mm: bool | None = None) -> int:
    """Replace each ``nn.Linear`` of ``model``'s decoder by an :class:`FP8Linear` (in place, one at a
    time, so the peak is the unquantised model plus one layer); the output head (and embeddings,
    norms, anything that is not exactly ``nn.Linear``) stays as it is. Returns how many were
    replaced. ``scaled_mm``: ``None`` decides per layer from its device (:func:`fp8_matmul_supported`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m is not head]
    offloaded = [name for name, m in targets if m.weight.is_meta]
    if offloaded:  # accelerate's disk / CPU offload keeps weights elsewhere and loads them per call
        raise ValueError(f"load_in_fp8: {len(offloaded)} projections (e.g. {offloaded[0]}) are offloaded by the "
                         "device_map; FP8 quantises weights held on a device: load every weight on the GPU (or CPU)")
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear.from_linear(linear, scaled_mm))
        linear.weight = None  # the full-precision copy goes now, not with the last reference to the model
    return len(targets)
