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
- the weight-only kernel (:func:`swiftune.kernels.fp8_weight_only_matmul`), for decoding: under
  ``torch.no_grad`` (the state's ``inference``) and at most :data:`DECODE_MAX_ROWS` rows, ``y = (x Q^T)
  * s^T`` with ``x`` unquantised, the codes read once and decoded in registers (any CUDA GPU; the
  interpreter on CPU when ``TRITON_INTERPRET=1``, else its plain-PyTorch reference). At a few rows the
  product is bound by reading the weight, which this path reads at 1 byte a weight and nothing else;
  ``_scaled_mm`` adds a quantise launch per linear and its FP8 tiles are shaped for large ``M``.
  From :data:`DECODE_MAX_ROWS` to :data:`DOT_DECODE_MAX_ROWS` rows under ``no_grad``, where
  ``_scaled_mm`` would run, the FP8 x FP8 decode kernel (:func:`swiftune.kernels.fp8_dot.fp8_dot_matmul`)
  computes the same product (activations quantised per row, e4m3 on the tensor cores) with tiles
  for those row counts.
- Layers that read one input (a decoder layer's q/k/v, its gate/up) share its quantisation wherever
  each would quantise it (``_scaled_mm``'s path in training and in wide inference products, the FP8 x
  FP8 decode kernel's): :func:`quantize_shared_input` makes the codes once (a
  :class:`QuantizedActivation`) and ``layer(x, quantized=...)`` multiplies them, with the same bits as
  each layer quantising ``x`` itself (swiftune's attention and MLP forwards and the rollout engine's
  decode step do this; the backward never reads the codes: the weight is frozen). PEFT LoRA layers
  over an FP8 base with swiftune's fused forward take the codes for their base product
  (:func:`swiftune.models.lora_linear.fp8_product_layer`).
- the dequantising reference (CPU, older GPUs, other dtypes): ``W_q`` rebuilt in float32 and cast
  to the compute dtype in forward and again in backward (never kept: an FP8 model holds 1 byte per
  base weight, not 3), then a plain matmul. This is exactly plain transformers with
  ``W = dequantize_rowwise(Q, s)`` substituted, which the tests use as the reference.

Checkpoints already in transformers' fine-grained FP8 format (e4m3 ``weight`` and float32
``weight_scale_inv`` per ``bo x bi`` block, ``W[o, i] = Q[o, i] * S[o // bo, i // bi]``) keep their
codes: :func:`quantize_model_fp8` with ``checkpoint=`` reads them, and the scales become per-row
ones where that is exact (the blocks of a row share a scale), else stay block scales
(``weight_scale`` ``[out / bo, in / bi]``), which only the dequantising path multiplies by (the scale
then varies along ``_scaled_mm``'s summed axis).

:class:`FP8Linear` subclasses ``nn.Linear`` so PEFT wraps it in its ordinary ``lora.Linear``
(``target_modules="all-linear"`` finds it too): the adapters' names and shapes are those of the
unquantised model, and a saved adapter loads in plain PEFT on the bf16 base. Its
``compute_dtype`` attribute is what PEFT reads (as for bitsandbytes' layers) to give the adapters
the model's dtype rather than e4m3's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.fp8_dot import fp8_dot_matmul, fp8_dot_quantize
from ..kernels.fp8_matmul import fp8_weight_only_matmul
from ..kernels.fp8_quant import fp8_quantize_rowwise

__all__ = ["BlockFP8Checkpoint", "DECODE_MAX_ROWS", "DOT_DECODE_MAX_ROWS", "FP8Linear", "FP8State", "FP8_DTYPE",
           "GATE_UP_NAMES", "QKV_NAMES", "QuantizedActivation", "adjacent_rows", "block_scales_to_layer_scales",
           "block_size_of", "dequantize_rowwise", "fp8_grad_input", "fp8_matmul", "fp8_matmul_supported",
           "input_compute_dtype", "is_fp8_linear", "lay_out_adjacent", "quantize_activation", "quantize_model_fp8",
           "quantize_rowwise", "quantize_shared_input", "reduce_decode_splits_in_launch"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448

# The most rows an inference product sends to the weight-only kernel. Its tile is 16 rows up to 16
# (one program reads each weight tile once whatever M is below that), and there it beats both bf16 and
# _scaled_mm on the H200 at every Qwen3-8B projection; at 64 rows it loses to both (the e4m3 -> bf16
# conversion feeding the tensor cores costs more than the halved weight read saves; figures and
# command: docs/results/2026-12-02/kernels_fp8_matmul_h200.txt). Wider products take _scaled_mm.
DECODE_MAX_ROWS = 16
# The most rows an inference product sends to the FP8 x FP8 decode kernel (above DECODE_MAX_ROWS): the
# activations quantised per row as for _scaled_mm (the same codes and, measured, the same results), the
# product on the FP8 tensor cores with tiles for 17-64 rows, where it beat _scaled_mm at every Qwen3-8B
# projection and bf16 at three of four (same file as above). Wider products take _scaled_mm.
DOT_DECODE_MAX_ROWS = 64


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
    """``Q * s`` in float32 (one rounding of the float32 product), then cast to ``dtype``. ``scale`` is
    per row (``[out, 1]``) or per block (``[out / bo, in / bi]``, :func:`block_size_of`): the
    block-scaled reference formula ``W[o, i] = Q[o, i] * S[o // bo, i // bi]``."""
    w = q.to(torch.float32)
    if scale.shape[-1] == 1 and scale.shape[0] == q.shape[0]:
        return w.mul_(scale).to(dtype)
    (ob, ib), (bo, bi) = scale.shape, block_size_of(q, scale)
    w.view(ob, bo, ib, bi).mul_(scale[:, None, :, None])
    return w.to(dtype)


def block_size_of(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """The ``(rows, columns)`` of the blocks that ``scale`` (``[out / bo, in / bi]``) scales in
    ``weight`` (``[out, in]``): a per-row scale is the block ``(1, in)``."""
    (out, inn), (ob, ib) = weight.shape, scale.shape
    if scale.dim() != 2 or out % ob or inn % ib:
        raise ValueError(f"FP8 scales of shape {tuple(scale.shape)} do not tile a weight of shape {(out, inn)} in "
                         "equal blocks")
    return out // ob, inn // ib


def block_scales_to_layer_scales(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A fine-grained FP8 checkpoint's codes ``q`` (``[out, in]``) and block scales ``scale_inv``
    (``[ceil(out / bo), ceil(in / bi)]``, transformers' ``weight_scale_inv``) as :class:`FP8Linear`
    holds them, with the same dequantised values in float32 bit for bit:

    - per row (``[out, 1]``, the ``torch._scaled_mm`` path) when that is exact: the scales of each
      row's blocks are equal, or they differ so that every code re-encodes exactly on the row's
      largest scale (powers of two apart, codes without lost bits);
    - otherwise the blocks kept, cut to equal blocks that tile the weight (``gcd(bo, out)`` rows by
      ``gcd(bi, in)`` columns: a checkpoint's last partial block repeats its scale), which the
      dequantising path multiplies by.
    """
    out, inn = q.shape
    bo, bi = block
    if scale_inv.shape != (-(-out // bo), -(-inn // bi)):
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not match a weight of shape "
                         f"{(out, inn)} in blocks of {tuple(block)}: expected {(-(-out // bo), -(-inn // bi))}")
    s = scale_inv.to(torch.float32)
    go, gi = math.gcd(bo, out), math.gcd(bi, inn)
    fine = s.repeat_interleave(bo // go, 0)[: out // go].repeat_interleave(bi // gi, 1)[:, : inn // gi].contiguous()
    want = dequantize_rowwise(q, fine, torch.float32)
    rows = fine.repeat_interleave(go, 0).amax(dim=1, keepdim=True)  # [out, 1]: each row's largest block scale
    ratio = (fine.repeat_interleave(go, 0) / rows).repeat_interleave(gi, 1)  # [out, in], <= 1
    q_row = (q.to(torch.float32) * ratio).to(FP8_DTYPE)  # exact where the ratios are powers of two
    if torch.equal(dequantize_rowwise(q_row, rows, torch.float32), want):
        return q_row, rows
    return q.clone(), fine


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
    """What a matmul needs besides the e4m3 weight: its per-row scales ``[out, 1]``, whether
    ``torch._scaled_mm`` may be used (the caller's GPU has FP8 tensor cores), and whether the product
    is for inference (no gradient through it: the caller runs under ``torch.no_grad``), when up to
    :data:`DECODE_MAX_ROWS` rows take the weight-only kernel; ``reduce_in_launch``: the decode kernels add a
    split K's partial sums in the product's own launch (:func:`reduce_decode_splits_in_launch`)."""

    scale: torch.Tensor
    scaled_mm: bool
    inference: bool = False
    reduce_in_launch: bool = False


def _use_scaled_mm(state: FP8State, a: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    # _scaled_mm takes bf16 outputs with per-row scales and needs both matrix sides in multiples of 16
    # (block-scaled weights dequantise: their scales vary along the summed axis)
    return (state.scaled_mm and dtype == torch.bfloat16 and a.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0
            and weight.shape[1] % 16 == 0 and tuple(state.scale.shape) == (weight.shape[0], 1))


def quantize_activation(x2: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes and float32 scales of ``x2 * col_scale`` (``[N, K]``, ``[N, 1]``) for
    ``_scaled_mm``: the fused Triton kernel on CUDA, its plain-PyTorch reference elsewhere (CPU
    torch's ``_scaled_mm`` runs the tests; the bytes are the same either way)."""
    x2 = x2.detach()  # the codes are a value, not a function autograd differentiates
    return fp8_quantize_rowwise(x2, col_scale, backend="auto" if x2.is_cuda else "reference")


def _use_weight_only(state: FP8State, x2: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    # per-row scales only (block scales vary along the summed axis); the kernel's dtypes
    return (state.inference and 0 < x2.shape[0] <= DECODE_MAX_ROWS
            and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and tuple(state.scale.shape) == (weight.shape[0], 1))


def _use_fp8_dot(state: FP8State, x2: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    # where _scaled_mm would run at decode row counts (fewer rows take the weight-only kernel first)
    return (state.inference and x2.shape[0] <= DOT_DECODE_MAX_ROWS and not _use_weight_only(state, x2, weight, dtype)
            and _use_scaled_mm(state, x2, weight, dtype))


def _quantizing_path(state: FP8State, x2: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Which per-row quantisation of ``x2`` :func:`fp8_matmul` makes: ``"dot"`` (the FP8 x FP8 decode
    kernel's), ``"scaled_mm"`` (``_scaled_mm``'s) or ``None`` (the weight-only kernel and the
    dequantising reference multiply ``x2`` itself)."""
    if _use_fp8_dot(state, x2, weight, dtype):
        return "dot"
    if _use_weight_only(state, x2, weight, dtype):
        return None
    return "scaled_mm" if _use_scaled_mm(state, x2, weight, dtype) else None


@dataclass(frozen=True)
class QuantizedActivation:
    """One input's per-row e4m3 codes and float32 scales, made once (:func:`quantize_shared_input`)
    for several :class:`FP8Linear` that read it: ``layer(source, quantized=qa)`` multiplies ``codes``
    instead of quantising ``source`` again. ``source`` is the input itself (a layer refuses codes made
    from another tensor), ``codes`` ``[N, in]`` its rows' e4m3 codes, ``scales`` ``[N, 1]``."""

    source: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor


def input_compute_dtype(x: torch.Tensor) -> torch.dtype:
    # the autocast dtype when autocast is on, else the input's (as nn.Linear computes in its weight's)
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def quantize_shared_input(x: torch.Tensor, layers: Sequence[nn.Module]) -> QuantizedActivation | None:
    """``x`` quantised once for all of ``layers`` when each is an :class:`FP8Linear` whose call on ``x``
    quantises it the same way: ``torch._scaled_mm``'s path (training, and inference products of more than
    :data:`DOT_DECODE_MAX_ROWS` rows) or the FP8 x FP8 decode kernel's (under ``torch.no_grad``, more
    than :data:`DECODE_MAX_ROWS` and at most :data:`DOT_DECODE_MAX_ROWS` rows); ``None`` otherwise (other
    layers, the weight-only kernel, the dequantising reference, ``x`` not in the compute dtype), and
    each layer then runs as it does alone. The codes are those each layer would make of ``x``
    (:func:`quantize_activation` or :func:`swiftune.kernels.fp8_dot.fp8_dot_quantize`), so ``layer(x,
    quantized=...)`` gives the bits of ``layer(x)``. A PEFT LoRA layer over an FP8 base is given here as
    that base (:func:`swiftune.models.lora_linear.fp8_product_layer`) and takes the codes for its base
    product."""
    path = shared_input_path(x, layers)
    if path is None:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    codes, scales = fp8_dot_quantize(x2) if path == "dot" else quantize_activation(x2)
    return QuantizedActivation(x, codes, scales)


def shared_input_path(x: torch.Tensor, layers: Sequence[nn.Module]) -> str | None:
    """How every one of ``layers`` would quantise ``x`` (:func:`quantize_shared_input`): ``"dot"`` or
    ``"scaled_mm"`` when they all would, the same way; ``None`` otherwise. Both quantise per row with
    :func:`~swiftune.kernels.fp8_quant.fp8_quantize_rowwise`'s bytes, so codes made of ``x`` elsewhere
    with them (the decode loop's norm kernel) serve either."""
    if not layers or not all(isinstance(m, FP8Linear) for m in layers):
        return None
    dtype = input_compute_dtype(x)
    if x.dtype != dtype:  # a layer alone would quantise x or its cast, by path: keep one rule, its own
        return None
    x2 = x.reshape(-1, x.shape[-1])
    inference = not torch.is_grad_enabled()
    paths = {_quantizing_path(FP8State(m.weight_scale, m.scaled_mm, inference), x2, m.weight, dtype) for m in layers}
    return paths.pop() if len(paths) == 1 and None not in paths else None


def fp8_matmul(x2: torch.Tensor, weight: torch.Tensor, state: FP8State, dtype: torch.dtype,
               bias: torch.Tensor | None = None, quantized: QuantizedActivation | None = None) -> torch.Tensor:
    """``x2 (Q * s)^T + b`` for ``x2`` ``[N, in]``, in ``dtype`` (see the module doc for the three paths).
    ``quantized``: ``x2``'s codes made already (:func:`quantize_shared_input`), for the paths that
    quantise ``x2``."""
    path = _quantizing_path(state, x2, weight, dtype)
    if quantized is not None:
        if path is None:
            raise ValueError("a QuantizedActivation is for the products that quantise their input (_scaled_mm's, "
                             f"and the FP8 x FP8 decode kernel's at {DECODE_MAX_ROWS + 1}..{DOT_DECODE_MAX_ROWS} rows "
                             "under no_grad); make it with quantize_shared_input, which says None elsewhere")
        if quantized.codes.shape != x2.shape:
            raise ValueError(f"quantized codes of shape {tuple(quantized.codes.shape)} for an input of shape "
                             f"{tuple(x2.shape)}")
    if path == "dot":
        # _scaled_mm's math (per-row e4m3 activations) through the decode kernel's tiles
        if quantized is None:
            return fp8_dot_matmul(x2.to(dtype), weight, state.scale.view(-1), bias,
                                  reduce_in_launch=state.reduce_in_launch)
        return fp8_dot_matmul(quantized.codes, weight, state.scale.view(-1), bias, x_scale=quantized.scales,
                              out_dtype=dtype, reduce_in_launch=state.reduce_in_launch)
    if path == "scaled_mm":
        xq, xs = quantize_activation(x2) if quantized is None else (quantized.codes, quantized.scales)
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=state.scale.view(1, -1), out_dtype=dtype)
    elif _use_weight_only(state, x2, weight, dtype):
        # the Triton kernel on CUDA (and under the interpreter), its float32 reference on plain CPU
        return fp8_weight_only_matmul(x2.to(dtype), weight, state.scale, bias,
                                      reduce_in_launch=state.reduce_in_launch)
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
    def forward(ctx, x, weight, scale, bias, dtype: torch.dtype, scaled_mm: bool,  # type: ignore[override]
                quantized: QuantizedActivation | None = None):
        state = FP8State(scale, scaled_mm)
        shape = x.shape
        y = fp8_matmul(x.reshape(-1, shape[-1]), weight, state, dtype, bias, quantized)
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
        return dx, None, None, dbias, None, None, None


class FP8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is e4m3 (``weight``, ``[out, in]``) with float32 per-row
    scales (the ``weight_scale`` buffer, ``[out, 1]``); computes in the autocast dtype when
    autocast is on, else in the input's dtype (as ``nn.Linear`` computes in its weight's)."""

    #: decode products (no grad, up to :data:`DOT_DECODE_MAX_ROWS` rows) add a split K's partials in their own
    #: launch (:func:`reduce_decode_splits_in_launch`); the second reduce launch otherwise
    split_k_in_launch: bool = False

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
        q, scale = quantize_rowwise(linear.weight.detach())
        return cls._holding(linear, q, scale, scaled_mm)

    @classmethod
    def from_block_fp8(cls, linear: nn.Linear, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                       block_size: tuple[int, int], scaled_mm: bool | None = None) -> FP8Linear:
        """The layer that replaces ``linear`` (a projection loaded dequantised: its shape, bias and
        compute dtype) with a fine-grained FP8 checkpoint's own e4m3 codes ``weight`` and block scales
        ``weight_scale_inv`` (:func:`block_scales_to_layer_scales`: per row where that is exact, else
        the blocks). Nothing is re-rounded: :meth:`dequantize` in float32 gives the checkpoint's
        ``Q * S`` bit for bit."""
        shape = (linear.out_features, linear.in_features)
        if weight.dtype != FP8_DTYPE or tuple(weight.shape) != shape:
            raise ValueError(f"a fine-grained FP8 weight must be float8_e4m3fn of the layer's shape {shape}, got "
                             f"{weight.dtype} {tuple(weight.shape)}")
        device = linear.weight.device
        q, scale = block_scales_to_layer_scales(weight.to(device), weight_scale_inv.to(device), block_size)
        return cls._holding(linear, q, scale, scaled_mm)

    @classmethod
    def _holding(cls, linear: nn.Linear, codes: torch.Tensor, scale: torch.Tensor,
                 scaled_mm: bool | None) -> FP8Linear:
        """A frozen layer of ``linear``'s shape, bias and compute dtype holding the e4m3 ``codes`` and
        their ``scale`` (``scaled_mm=None``: ``torch._scaled_mm`` where ``linear``'s device has it)."""
        if scaled_mm is None:
            scaled_mm = fp8_matmul_supported(linear.weight.device)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, device=torch.device("meta"),
                    compute_dtype=linear.weight.dtype, scaled_mm=scaled_mm)
        layer.weight = nn.Parameter(codes, requires_grad=False)
        layer.weight_scale = scale
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    @property
    def block_size(self) -> tuple[int, int]:
        """The blocks its scales cover: ``(1, in_features)`` for per-row scales."""
        return block_size_of(self.weight, self.weight_scale)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``Q * s`` in ``dtype`` (default: the compute dtype): what the reference path multiplies by."""
        return dequantize_rowwise(self.weight, self.weight_scale, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor, quantized: QuantizedActivation | None = None) -> torch.Tensor:
        """``quantized``: ``x``'s codes shared with other layers that read ``x``
        (:func:`quantize_shared_input`)."""
        dtype = input_compute_dtype(x)
        if quantized is not None and quantized.source is not x:
            raise ValueError("quantized= takes the codes quantize_shared_input made of this very input")
        if torch.is_grad_enabled():
            return FP8LinearFunction.apply(x, self.weight, self.weight_scale, self.bias, dtype, self.scaled_mm,
                                           quantized)
        # no_grad (the rollout engine's decoding, evaluation): no autograd node, and few rows take the
        # weight-only kernel (grad mode, not x.requires_grad, decides: training keeps one path)
        state = FP8State(self.weight_scale, self.scaled_mm, inference=True,
                         reduce_in_launch=self.split_k_in_launch)
        y = fp8_matmul(x.reshape(-1, x.shape[-1]), self.weight, state, dtype, self.bias, quantized)
        return y.view(*x.shape[:-1], y.shape[-1])

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

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A saved FP8 model is an ordinary checkpoint: the weight as Q * s in the compute dtype, no scale. The
        # e4m3 codes under "weight" would read back (in transformers, or with load_in_fp8=True) as weights
        # 448 / max|w| times too large, the scales left over as unexpected keys. Under a PEFT LoRA layer (the
        # prefix ends in PEFT's "base_layer.") the codes and scales stay: PEFT's adapter saves call the whole
        # state_dict and keep only the adapters, and dequantising every frozen weight there would allocate
        # the bf16 model at every checkpoint.
        if prefix.endswith(".base_layer.") or prefix == "base_layer.":
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        destination[prefix + "weight"] = self.dequantize().detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # what _save_to_state_dict writes (a full-precision weight, no scale) is quantised per row again; codes
        # with their scale load as they are
        weight = state_dict.get(prefix + "weight")
        if isinstance(weight, torch.Tensor) and weight.dtype != FP8_DTYPE and prefix + "weight_scale" not in state_dict:
            if self.block_size != (1, self.in_features):
                error_msgs.append(f"{prefix}weight: a full-precision weight cannot replace {self._scales_repr()}; "
                                  "load the FP8 checkpoint's codes and scales instead")
                return
            codes, scale = quantize_rowwise(weight.detach().to(self.weight.device, torch.float32), overwrite=True)
            state_dict[prefix + "weight"], state_dict[prefix + "weight_scale"] = codes, scale
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"float8_e4m3fn {self._scales_repr()}, compute_dtype={self.compute_dtype}, scaled_mm={self.scaled_mm}")

    def _scales_repr(self) -> str:
        rows, cols = self.block_size
        return "per-row scales" if (rows, cols) == (1, self.in_features) else f"{rows}x{cols} block scales"


def is_fp8_linear(module: nn.Module) -> bool:
    return isinstance(module, FP8Linear)


#: the projections of one attention module that read the same input, laid out adjacent at load
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
#: the same for a gated MLP's two input projections
GATE_UP_NAMES = ("gate_proj", "up_proj")


def lay_out_adjacent(layers: Sequence[FP8Linear]) -> bool:
    """Move the e4m3 codes and the scales of ``layers`` (FP8 layers of one input size, per-row scales, one
    device) into one buffer each, in this order, each layer's ``weight`` / ``weight_scale`` a view of its
    rows, so that one product can span them without a copy (:func:`adjacent_rows`). The values do not
    change; the old buffers are freed as the views replace them. Returns whether it did (False, nothing
    moved: other layers or none, block scales, mixed devices)."""
    first = layers[0] if layers else None
    if first is None or not all(
            isinstance(m, FP8Linear) and m.in_features == first.in_features and m.weight.device == first.weight.device
            and m.block_size == (1, m.in_features) for m in layers):
        return False
    codes = torch.cat([m.weight.detach() for m in layers])
    scales = torch.cat([m.weight_scale for m in layers])
    start = 0
    for m in layers:
        rows = slice(start, start + m.out_features)
        m.weight = nn.Parameter(codes[rows], requires_grad=False)
        m.weight_scale = scales[rows]
        start += m.out_features
    return True


def adjacent_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One ``[sum of rows, cols]`` view spanning ``tensors`` (2-D, contiguous, one dtype and width) where each
    starts in one storage right where the one before it ends (:func:`lay_out_adjacent`); else None."""
    first = tensors[0]
    if first.dim() != 2:
        return None
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (t.dim() != 2 or not t.is_contiguous() or t.dtype != first.dtype or t.shape[1] != first.shape[1]
                or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), first.shape[1]), first.stride(),
                            first.storage_offset())


def reduce_decode_splits_in_launch(model: nn.Module, enabled: bool = True) -> int:
    """Whether the decode products of ``model``'s :class:`FP8Linear` layers (and of PEFT LoRA layers over
    them) add a split K's partial sums in the product's own launch, by each tile's last program, instead of
    a second reduce launch: the same bits either way (:mod:`swiftune.kernels.fp8_dot`). Off unless set
    here. Returns how many layers were set."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for layer in layers:
        layer.split_k_in_launch = bool(enabled)
    return len(layers)


def quantize_model_fp8(model: nn.Module, scaled_mm: bool | None = None, checkpoint: str | None = None,
                       skip: tuple[str, ...] = ()) -> int:
    """Replace each ``nn.Linear`` of ``model``'s decoder by an :class:`FP8Linear` (in place, one at a
    time, so the peak is the unquantised model plus one layer); the output head (and embeddings,
    norms, anything that is not exactly ``nn.Linear``) stays as it is. Returns how many were
    replaced. ``scaled_mm``: ``None`` decides per layer from its device (:func:`fp8_matmul_supported`).

    ``checkpoint``: the local folder ``model`` was loaded from (dequantised) when it is in
    transformers' fine-grained FP8 format: each projection the checkpoint stores as e4m3 codes with
    ``weight_scale_inv`` takes those codes and scales as they are (:meth:`FP8Linear.from_block_fp8`);
    any other is quantised per row from its loaded weight. ``None``: every one per row.

    ``skip``: module-name prefixes left unquantised (``"model.visual"``: a vision tower and its mergers).

    Then each attention module's ``q_proj`` / ``k_proj`` / ``v_proj`` codes (and scales) move into one
    buffer, each layer a view of its rows (:func:`lay_out_adjacent`), where all three have per-row scales:
    the same values and bytes, one allocation instead of three; so do each gated MLP's ``gate_proj`` /
    ``up_proj``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m is not head
               and not any(name == p or name.startswith(p + ".") for p in skip)]
    offloaded = [name for name, m in targets if m.weight.is_meta]
    if offloaded:  # accelerate's disk / CPU offload keeps weights elsewhere and loads them per call
        raise ValueError(f"load_in_fp8: {len(offloaded)} projections (e.g. {offloaded[0]}) are offloaded by the "
                         "device_map; FP8 quantises weights held on a device: load every weight on the GPU (or CPU)")
    stored = BlockFP8Checkpoint(checkpoint) if checkpoint is not None else None
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        codes = stored.get(name) if stored is not None else None
        if codes is not None:
            # no weight_block_size: one scale for the whole weight (transformers' per-tensor FP8)
            block = stored.block_size or (linear.out_features, linear.in_features)
            layer = FP8Linear.from_block_fp8(linear, *codes, block, scaled_mm)
        else:
            layer = FP8Linear.from_linear(linear, scaled_mm)
        setattr(parent, child, layer)
        linear.weight = None  # the full-precision copy goes now, not with the last reference to the model
    for module in model.modules():  # codes of one input in one buffer: the rollout engine may multiply them at once
        for names in (QKV_NAMES, GATE_UP_NAMES):
            lay_out_adjacent([getattr(module, name, None) for name in names])  # other modules: nothing moves
    return len(targets)


class BlockFP8Checkpoint:
    """The e4m3 codes and ``weight_scale_inv`` block scales of a local checkpoint in transformers'
    fine-grained FP8 format, read one projection at a time (safetensors, sharded or not)."""

    def __init__(self, folder: str) -> None:
        from safetensors import safe_open

        config_path = os.path.join(folder, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"{folder} has no config.json: give the local folder of a fine-grained FP8 checkpoint")
        with open(config_path) as f:
            quant = json.load(f).get("quantization_config") or {}
        if quant.get("quant_method") != "fp8":
            raise ValueError(f"{folder}'s config.json has no fine-grained FP8 quantization_config (quant_method "
                             f"'fp8'), got {quant.get('quant_method')!r}: load it without checkpoint=")
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self._where: dict[str, str] = {}
        for file in files:
            path = os.path.join(folder, file)
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    self._where[key] = path
        block = quant.get("weight_block_size")
        self.block_size: tuple[int, int] | None = tuple(block) if block else None
        self._open = safe_open

    def get(self, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(codes, weight_scale_inv)`` of the projection named ``module``, or ``None`` when the
        checkpoint keeps it unquantised (or names it otherwise)."""
        weight, scale = f"{module}.weight", f"{module}.weight_scale_inv"
        if weight not in self._where or scale not in self._where:
            return None
        with self._open(self._where[weight], framework="pt") as f:
            q = f.get_tensor(weight)
        if q.dtype != FP8_DTYPE:
            return None
        with self._open(self._where[scale], framework="pt") as f:
            s = f.get_tensor(scale)
        return q, s
