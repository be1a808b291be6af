"""One autograd node per LoRA linear: ``y = x W^T + b + s (x A^T) B^T`` forward and backward.

PEFT's ``lora.Linear.forward`` runs the base ``nn.Linear``, then three more modules (dropout,
``lora_A``, ``lora_B``), a scaling multiply and an add: four module calls, five autograd nodes and
about six kernel launches per projection, on every forward and every checkpoint recompute. At
batch sizes where the step is bound by the host (an 8B model at a few thousand tokens), that
per-call Python and autograd work, times seven projections, times every layer, is most of the step.
:class:`LoRALinearFunction` computes the same thing as one node.

Derivation (``x``: ``[N, k]``, ``W``: ``[n, k]``, ``A``: ``[r, k]``, ``B``: ``[n, r]``, scaling
``s``, upstream gradient ``g = dL/dy``: ``[N, n]``; ``h = x A^T`` is the only intermediate saved):

    y  = x W^T + b + s h B^T
    dB = s g^T h                      ([n, r])
    dh = s g B                        ([N, r])
    dA = dh^T x                       ([r, k])
    dx = g W + dh A                   ([N, k])
    dW = g^T x,  db = sum_N g         (only when the base layer is trained)

Which dtype: under autocast (what the trainers run with ``bf16``/``fp16``) everything computes in
the autocast dtype, exactly where PEFT's matmuls run (autocast casts PEFT's float32 adapter inputs
straight back); without autocast, as PEFT does, the base product in the input's dtype and the
adapter product in the adapters' (float32 adapters on a bf16 model: ``x`` cast to float32, the sum
in float32, the output cast back). Every other case (dropout that is active, DoRA and other
LoRA variants, several active adapters, adapters disabled or merged, a LoRA bias, Conv1D-style
``fan_in_fan_out``, mixed dtypes without autocast) runs PEFT's own forward unchanged, so the fused
path is never a different model: it is PEFT's arithmetic in fewer calls.

QLoRA (PEFT's ``lora.Linear4bit`` over a bitsandbytes NF4 ``Linear4bit``): the same node, with
``W`` dequantised (bitsandbytes' ``dequantize_4bit``) in the forward and again in the backward
instead of being kept at full size, as bitsandbytes' own matmul does; while training only (under
autocast, or with one dtype throughout), so generation keeps bitsandbytes' inference kernels.
FP8 base layers (:class:`~swiftune.models.fp8_linear.FP8Linear` under PEFT's ``lora.Linear``): the
base product and ``g W`` through :func:`~swiftune.models.fp8_linear.fp8_matmul` /
:func:`~swiftune.models.fp8_linear.fp8_grad_input` (``torch._scaled_mm`` on FP8 GPUs, else ``W``
dequantised in forward and again in backward), under the same dtype rules as ``nn.Linear``. Where
its base product quantises the input (``_scaled_mm``'s path, the FP8 x FP8 decode kernel's) the layer
also takes ``quantized=``, its input's e4m3 codes made once for several projections
(:func:`shared_fp8_input`): the base product multiplies those codes, the adapter product the input
itself, as without them.

:func:`fuse_lora_linears` binds :func:`fused_lora_forward` on each PEFT ``lora.Linear`` /
``lora.Linear4bit`` instance (under a tiled forward's tiling if one is there);
:func:`unfuse_lora_linears` restores PEFT's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .fp8_linear import (FP8State, QuantizedActivation, adjacent_rows, fp8_grad_input, fp8_matmul, input_compute_dtype,
                         is_fp8_linear, quantize_shared_input, shared_input_path)
from ..kernels.lora_decode import LORA_DECODE_MAX_ROWS, lora_decode_add_
from .nf4_decode import takes_nf4_decode
from .tiled_mlp import replace_untiled_forward

__all__ = ["LoRALinearFunction", "fp8_product_layer", "fuse_lora_linears", "fused_lora_forward", "is_fused_lora",
           "shared_fp8_input", "stacked_fp8_products", "unfuse_lora_linears"]

_FUSED = "_swiftune_fused_lora"  # instance-dict marker: fused_lora_forward is bound (or under the tiling)


class LoRALinearFunction(torch.autograd.Function):
    """``y = x W^T + b + scaling (x A^T) B^T``: the base product in ``base_dtype``, the adapter
    product in ``lora_dtype`` (their sum in ``lora_dtype``, returned in ``base_dtype``, as PEFT
    adds a float32 adapter output to a half-precision base output); see the module doc.
    ``quantized``: ``x``'s e4m3 codes for an FP8 base product (see :func:`fp8_matmul`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float,  # type: ignore[override]
                base_dtype: torch.dtype, lora_dtype: torch.dtype, quant_state=None,
                quantized: QuantizedActivation | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xb, xl = x2.to(base_dtype), x2.to(lora_dtype)
        a, b = lora_a.to(lora_dtype), lora_b.to(lora_dtype)
        h = torch.mm(xl, a.t())
        y, w = _base_product(xb, weight, bias, quant_state, base_dtype, quantized)
        y = _add_adapter_product(y, h, b, scaling, lora_dtype, base_dtype)
        # a 4-bit weight is dequantised again in backward rather than kept at full size
        ctx.save_for_backward(xb, xl, h, weight if quant_state is not None else w, a, b)
        ctx.quant_state, ctx.base_dtype = quant_state, base_dtype
        ctx.scaling = scaling
        ctx.shape = shape
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype, lora_a.dtype, lora_b.dtype)
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        xb, xl, h, w, a, b = ctx.saved_tensors
        x_dtype, w_dtype, bias_dtype, a_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        s = ctx.scaling
        fp8 = isinstance(ctx.quant_state, FP8State)
        if ctx.quant_state is not None and need_x and not fp8:
            w = _base_weight(w, ctx.quant_state, ctx.base_dtype)
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.base_dtype)
        gl = g.to(a.dtype)
        dx = dw = dbias = da = db = None
        if need_x or need_a:
            dh = torch.mm(gl, b).mul_(s)
            if need_a:
                da = torch.mm(dh.t(), xl).to(a_dtype)
            if need_x:
                dx = fp8_grad_input(g, w, ctx.quant_state, ctx.base_dtype) if fp8 else torch.mm(g, w)
                if a.dtype == dx.dtype:
                    dx.addmm_(dh, a)
                else:
                    dx.add_(torch.mm(dh, a).to(dx.dtype))
                dx = dx.to(x_dtype).view(ctx.shape)
        if need_b:
            db = torch.mm(gl.t(), h).mul_(s).to(b_dtype)
        if need_w:
            dw = torch.mm(g.t(), xb).to(w_dtype)
        if need_bias:
            dbias = g.sum(0).to(bias_dtype)
        return dx, dw, dbias, da, db, None, None, None, None, None


def _add_adapter_product(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scaling: float,
                         lora_dtype: torch.dtype, base_dtype: torch.dtype) -> torch.Tensor:
    """``y + scaling h B^T`` (``h = x A^T``, ``b`` in ``lora_dtype``) as PEFT sums the base and adapter products:
    into ``y`` in place when the adapter computes in the base dtype, else in ``lora_dtype`` and cast back."""
    if lora_dtype == base_dtype:
        return y.addmm_(h, b.t(), alpha=scaling)
    return torch.addmm(y.to(lora_dtype), h, b.t(), alpha=scaling).to(base_dtype)


def _base_product(xb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quant_state: Any,
                  base_dtype: torch.dtype, quantized: QuantizedActivation | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``xb W^T + b`` in ``base_dtype`` (an FP8 base through :func:`fp8_matmul`, a 4-bit one dequantised first)
    and the weight as multiplied, which the input gradient multiplies again (an FP8 base: its codes)."""
    if isinstance(quant_state, FP8State):
        return fp8_matmul(xb, weight, quant_state, base_dtype, bias, quantized), weight
    if quantized is not None:
        raise ValueError("quantized= is for an FP8 base product")
    w = _base_weight(weight, quant_state, base_dtype)
    return F.linear(xb, w, None if bias is None else bias.to(base_dtype)), w


def _base_weight(weight: torch.Tensor, quant_state: Any, dtype: torch.dtype) -> torch.Tensor:
    """The base weight ``[out, in]`` in ``dtype``; a bitsandbytes 4-bit one dequantised."""
    if quant_state is None:
        return weight.to(dtype)
    import bitsandbytes.functional as bnb_functional

    return bnb_functional.dequantize_4bit(weight, quant_state).to(dtype)


def _plain_dropout(dropout: nn.Module) -> bool:
    if isinstance(dropout, nn.Identity):
        return True
    return isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not dropout.training)


def _fused_operands(layer: nn.Module, x: torch.Tensor) -> tuple | None:
    """``(adapter, base dtype, adapter dtype, base layer, lora_A, lora_B, base is FP8)`` when the
    fused node computes what PEFT's forward would, else None.

    Runs on every call of every LoRA linear (forward and checkpoint recompute): each attribute is
    read once, and the common case (a plain ``nn.Linear`` base) is decided first."""
    if layer.disable_adapters or layer.merged_adapters or getattr(layer, "fan_in_fan_out", False):
        return None
    active = layer.active_adapter  # PEFT's active_adapters: a name, or a list of names
    if isinstance(active, str):
        name = active
    elif len(active) == 1:
        name = active[0]
    else:
        return None
    lora_a_dict = layer.lora_A
    if name not in lora_a_dict or name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False):
        return None
    base, lora_a, lora_b = layer.base_layer, lora_a_dict[name], layer.lora_B[name]
    if lora_b.bias is not None or not _plain_dropout(layer.lora_dropout[name]):
        return None
    linear = type(base) is nn.Linear
    fp8 = not linear and is_fp8_linear(base)  # computes in x's dtype (autocast's under autocast), its weight is e4m3
    if not linear and not fp8:
        dtypes = _fused_4bit_operands(layer, base, name, x)
        return None if dtypes is None else (name, dtypes, dtypes, base, lora_a, lora_b, False)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return name, dtype, dtype, base, lora_a, lora_b, fp8
    # without autocast PEFT multiplies x by the base weight as it is and casts x to the adapters'
    # dtype (unless its input casting is off, when the dtypes must agree already)
    adapter = lora_a.weight.dtype
    if (base.weight.dtype != x.dtype and not fp8) or lora_b.weight.dtype != adapter:
        return None
    if adapter != x.dtype and not getattr(layer, "cast_input_dtype_enabled", True):
        return None
    return name, x.dtype, adapter, base, lora_a, lora_b, fp8


def _fused_4bit_operands(layer: nn.Module, base: nn.Module, name: str, x: torch.Tensor) -> torch.dtype | None:
    """PEFT's QLoRA layer (``lora.Linear4bit`` over ``bnb.nn.Linear4bit``) while training: under
    autocast, or with input, compute and adapter dtypes all equal (PEFT casts the adapter output
    to the result dtype before the sum otherwise, another rounding); returns that one dtype.
    Inference (no grad) keeps bitsandbytes' own kernels, which also repack weights for the CPU."""
    if type(base).__name__ != "Linear4bit" or not torch.is_grad_enabled():
        return None
    state = getattr(base.weight, "quant_state", None)
    if state is None or getattr(state, "packing_format_for_cpu", False):
        return None
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    dtype = x.dtype
    compute = base.compute_dtype or dtype
    if compute == dtype and layer.lora_A[name].weight.dtype == dtype and layer.lora_B[name].weight.dtype == dtype:
        return dtype
    return None


def fp8_product_layer(layer: nn.Module, x: torch.Tensor) -> nn.Module | None:
    """The :class:`~swiftune.models.fp8_linear.FP8Linear` whose product ``layer(x)`` computes with
    :func:`~swiftune.models.fp8_linear.fp8_matmul` on ``x`` in ``x``'s compute dtype (autocast's, else
    its own): ``layer`` itself, or the FP8 base of a PEFT LoRA layer that runs :func:`fused_lora_forward`
    (bound by :func:`fuse_lora_linears`, not under a tiling) as one node on ``x``; else None (PEFT's own
    forward, other bases, other layers). What
    :func:`~swiftune.models.fp8_linear.quantize_shared_input` is given for it."""
    if is_fp8_linear(layer):
        return layer
    # two attribute reads first: the decode step asks this of every projection of every model
    if (not is_fp8_linear(getattr(layer, "base_layer", None))
            or getattr(layer.__dict__.get("forward"), "__func__", None) is not fused_lora_forward):
        return None
    operands = _fused_operands(layer, x)
    # operands[1], the base product's dtype, is the compute dtype FP8Linear itself takes
    return operands[3] if operands is not None and operands[6] else None


def fused_lora_forward(self: nn.Module, x: torch.Tensor, *args: Any, quantized: QuantizedActivation | None = None,
                       lora_kernel: bool = False, **kwargs: Any) -> torch.Tensor:
    """PEFT ``lora.Linear.forward`` as one :class:`LoRALinearFunction` node where that is the same
    arithmetic (see the module doc); PEFT's own forward otherwise. ``quantized``: ``x``'s codes from
    :func:`shared_fp8_input` for an FP8 base's product. ``lora_kernel``: in a decode step (no grad, at most
    :data:`~swiftune.kernels.lora_decode.LORA_DECODE_MAX_ROWS` rows, a plain or FP8 base) the adapter's product
    is added in two launches (:func:`swiftune.kernels.lora_decode_add_`) instead of two matmuls and their casts."""
    operands = None if (args or kwargs) else _fused_operands(self, x)
    if quantized is not None and (operands is None or not operands[6] or quantized.source is not x):
        raise ValueError("quantized= takes the codes quantize_shared_input made of this very input, for a fused "
                         "LoRA layer over an FP8 base")
    if operands is None or (not operands[6] and takes_nf4_decode(operands[3], x)):
        return type(self).forward(self, x, *args, **kwargs)  # (an NF4 decode step: PEFT's base call takes the kernel)
    name, base_dtype, lora_dtype, base, lora_a, lora_b, fp8 = operands
    weight = base.weight
    if fp8:
        # no gradient through the product (rollouts): a few rows take the weight-only FP8 kernel
        quant_state = FP8State(base.weight_scale, base.scaled_mm, inference=not torch.is_grad_enabled(),
                               reduce_in_launch=base.split_k_in_launch)
    else:
        quant_state = getattr(weight, "quant_state", None) if type(base) is not nn.Linear else None
    if lora_kernel and _takes_lora_decode_kernel(x, quant_state, fp8):
        x2 = x.reshape(-1, x.shape[-1])
        y, _ = _base_product(x2.to(base_dtype), weight, base.bias, quant_state, base_dtype, quantized)
        lora_decode_add_(y, x2, lora_a.weight.to(lora_dtype), lora_b.weight.to(lora_dtype), float(self.scaling[name]))
        return y.view(*x.shape[:-1], y.shape[-1])
    return LoRALinearFunction.apply(x, weight, base.bias, lora_a.weight, lora_b.weight, float(self.scaling[name]),
                                    base_dtype, lora_dtype, quant_state, quantized)


def _takes_lora_decode_kernel(x: torch.Tensor, quant_state: Any, fp8: bool) -> bool:
    """A decode step's adapter product in two launches: no autograd, the kernel's rows, a plain or FP8 base (a 4-bit
    one keeps its own path)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (not torch.is_grad_enabled() and 0 < rows <= LORA_DECODE_MAX_ROWS
            and (fp8 or quant_state is None))


def shared_fp8_input(x: torch.Tensor, projections: Sequence[nn.Module],
                     codes: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, QuantizedActivation]:
    """The keyword that hands ``projections``, which all read ``x``, one quantisation of it (one launch
    instead of one each) where each would quantise it: FP8 layers, or fused LoRA layers over them, on
    ``_scaled_mm``'s path or the FP8 x FP8 decode kernel's
    (:func:`~swiftune.models.fp8_linear.quantize_shared_input`). Empty otherwise (other layers, PEFT's own
    LoRA forward, a tiling, the weight-only kernel's row counts): then each runs as it does alone.
    ``codes``: ``x``'s per-row codes and scales made already with the rowwise quantiser's bytes
    (:func:`swiftune.kernels.add_rms_norm_fp8`), used instead of quantising ``x`` where it would be."""
    bases = fp8_product_bases(x, projections)
    if bases is None:
        return {}
    if codes is not None:
        if shared_input_path(x, bases) is None:
            return {}
        return {"quantized": QuantizedActivation(x, *codes)}
    quantized = quantize_shared_input(x, bases)
    return {} if quantized is None else {"quantized": quantized}


def takes_shared_fp8_input(x: torch.Tensor, projections: Sequence[nn.Module]) -> bool:
    """Whether :func:`shared_fp8_input` would hand ``projections`` codes of ``x`` (or of a tensor of its shape
    and dtype): so the decode loop makes them in the norm kernel that makes ``x``."""
    bases = fp8_product_bases(x, projections)
    return bases is not None and shared_input_path(x, bases) is not None


def fp8_product_bases(x: torch.Tensor, projections: Sequence[nn.Module]) -> list[nn.Module] | None:
    """Each projection's FP8 layer that multiplies ``x`` (:func:`fp8_product_layer`), or ``None`` where one
    has none."""
    bases = []
    for p in projections:  # the first non-FP8 projection settles it (every layer of a bf16 model asks)
        base = fp8_product_layer(p, x)
        if base is None:
            return None
        bases.append(base)
    return bases


def stacked_fp8_products(projections: Sequence[nn.Module], x: torch.Tensor,
                         quantized: QuantizedActivation | None = None,
                         lora_kernel: bool = False) -> list[torch.Tensor] | None:
    """``[p(x) for p in projections]`` with one FP8 product for all their bases, under ``torch.no_grad`` (the
    rollout engine's decode step): where each projection is an :class:`~swiftune.models.fp8_linear.FP8Linear`
    without bias, or a fused LoRA layer over one (:func:`fused_lora_forward`), and the bases' codes and scales
    lie adjacent in one buffer (:func:`~swiftune.models.fp8_linear.lay_out_adjacent`, as
    ``quantize_model_fp8`` leaves q/k/v), the product multiplies the spanning ``[sum out, in]`` view once and
    each projection's adapter product is added to its columns as :class:`LoRALinearFunction` adds it. Each
    output column is the same dot product as the projection's own; a kernel may tile the wider product
    differently, so results match each projection's call to its rounding (tests/test_fp8_stacked_qkv.py).
    ``quantized``: ``x``'s codes (:func:`shared_fp8_input`). ``lora_kernel``: each adapter's product added by the LoRA
    decode kernel (:func:`fused_lora_forward`'s two launches). ``None`` where that does not hold: call each."""
    if torch.is_grad_enabled():
        return None
    dtype = input_compute_dtype(x)
    bases, adapters = [], []
    for p in projections:
        if is_fp8_linear(p):
            bases.append(p)
            adapters.append(None)
            continue
        operands = _fused_operands(p, x) if is_fused_lora(p) else None
        if operands is None:
            return None
        name, base_dtype, lora_dtype, base, lora_a, lora_b, fp8 = operands
        if not fp8 or base_dtype != dtype:
            return None
        bases.append(base)
        adapters.append((float(p.scaling[name]), lora_dtype, lora_a, lora_b))
    if any(b.bias is not None or b.scaled_mm != bases[0].scaled_mm for b in bases):
        return None
    weight = adjacent_rows([b.weight for b in bases])
    scale = adjacent_rows([b.weight_scale for b in bases])
    if weight is None or scale is None:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    state = FP8State(scale, bases[0].scaled_mm, inference=True,
                     reduce_in_launch=bases[0].split_k_in_launch)
    y = fp8_matmul(x2.to(dtype), weight, state, dtype, None, quantized)
    outs = list(y.split([b.out_features for b in bases], dim=1))
    inputs: dict[torch.dtype, torch.Tensor] = {}  # x in each adapter dtype, cast once for the group
    kernel = lora_kernel and _takes_lora_decode_kernel(x2, None, True)
    for i, adapter in enumerate(adapters):
        if adapter is None:
            continue
        scaling, lora_dtype, lora_a, lora_b = adapter
        if kernel:  # in place on the product's columns
            lora_decode_add_(outs[i], x2, lora_a.weight.to(lora_dtype), lora_b.weight.to(lora_dtype), scaling)
            continue
        if lora_dtype not in inputs:
            inputs[lora_dtype] = x2.to(lora_dtype)
        h = torch.mm(inputs[lora_dtype], lora_a.weight.to(lora_dtype).t())
        outs[i] = _add_adapter_product(outs[i], h, lora_b.weight.to(lora_dtype), scaling, lora_dtype, dtype)
    return [out.view(*x.shape[:-1], out.shape[-1]) for out in outs]


def _is_peft_lora_linear(module: nn.Module) -> bool:
    """PEFT's ``lora.Linear`` or its QLoRA ``lora.Linear4bit``, exactly (not other subclasses:
    their forwards differ)."""
    if not hasattr(module, "lora_A"):
        return False
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # PEFT absent: nothing to fuse
        return False
    if type(module) is Linear:
        return True
    linear_4bit = _peft_lora_4bit_class()
    return linear_4bit is not None and type(module) is linear_4bit


def _peft_lora_4bit_class() -> type | None:
    if "bitsandbytes" not in sys.modules:  # a model with 4-bit layers has imported it
        return None
    try:
        from peft.tuners.lora import bnb as peft_bnb
    except ImportError:
        return None
    return getattr(peft_bnb, "Linear4bit", None)  # defined only where bitsandbytes has 4-bit support


def is_fused_lora(module: nn.Module) -> bool:
    """Whether :func:`fuse_lora_linears` bound the fused forward on this module."""
    return module.__dict__.get(_FUSED, False)


def fuse_lora_linears(model: nn.Module) -> int:
    """Bind :func:`fused_lora_forward` on every PEFT ``lora.Linear`` of ``model``; return how many
    are fused. Idempotent; a tiled projection keeps its tiling and runs the fused forward per tile."""
    n = 0
    for module in model.modules():
        if not _is_peft_lora_linear(module):
            continue
        n += 1
        if is_fused_lora(module):
            continue
        bound = MethodType(fused_lora_forward, module)
        if not replace_untiled_forward(module, bound):
            module.forward = bound
        module.__dict__[_FUSED] = True
    return n


def unfuse_lora_linears(model: nn.Module) -> nn.Module:
    """Restore PEFT's own forward on every layer :func:`fuse_lora_linears` fused."""
    for module in model.modules():
        if not is_fused_lora(module):
            continue
        if not replace_untiled_forward(module, None):
            module.__dict__.pop("forward", None)
        del module.__dict__[_FUSED]
    return model
