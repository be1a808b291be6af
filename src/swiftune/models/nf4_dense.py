"""Rollouts from bitsandbytes NF4 layers through a compute-dtype copy of their weights, made once per call.

A decode step multiplies a few rows by every weight. Through bitsandbytes' ``Linear4bit`` each multiply of
more than one row dequantises the whole weight first (a write and a read of ``2 N K`` bytes besides the
``N K / 2`` of codes), every step; swiftune's NF4 kernel (:mod:`swiftune.models.nf4_decode`) decodes in
registers instead but is latency-bound at a few rows. Both are slower than the same step on bf16 weights
(docs/benchmarks.md, "rollout_nf4"). When the GPU has room, the rollout engine therefore dequantises each
NF4 layer once, at the start of a ``generate`` call, into a copy in the layer's compute dtype, multiplies
the decode steps by that copy, and frees it at the end: the weights are dequantised once per rollout
instead of once per step. Training is untouched: the copy is only used without gradients, the 4-bit
codes stay the parameters, and a LoRA adapter over the layer still runs at run time (PEFT's forward calls
the base layer, which multiplies by the copy).

For more than one row the products are bitsandbytes' own: it multiplies by the same dequantised weight
with ``torch.nn.functional.linear``. (One row goes through its matrix-vector kernel, which sums in
another order.)
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .nf4_decode import is_nf4_decode_bound, is_nf4_linear, restore_forward

_DENSE_ATTR = "swiftune_nf4_dense"  # (the layer's own forward, its weight in the compute dtype)

__all__ = ["nf4_dense_bytes", "nf4_dense_forward", "nf4_dense_layers"]


def _compute_dtype(module: nn.Module) -> torch.dtype:
    return getattr(module, "compute_dtype", None) or module.weight.quant_state.dtype


def _takes_dense(module: nn.Module) -> bool:
    """An NF4 layer in bitsandbytes' own layout (not repacked for its CPU kernel), bound neither to the NF4
    kernel nor to a copy yet."""
    return (is_nf4_linear(module) and not getattr(module.weight.quant_state, "packing_format_for_cpu", False)
            and not is_nf4_decode_bound(module) and getattr(module, _DENSE_ATTR, None) is None)


def nf4_dense_bytes(model: nn.Module) -> int:
    """Bytes of the copies :func:`nf4_dense_layers` would make: every NF4 layer's weight in its compute dtype."""
    total = 0
    for module in model.modules():
        if _takes_dense(module):
            out_features, in_features = (int(d) for d in module.weight.quant_state.shape)
            total += out_features * in_features * _compute_dtype(module).itemsize
    return total


def nf4_dense_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Bound on an NF4 ``Linear4bit`` by :func:`nf4_dense_layers`: without gradients, ``x W^T + b`` by the
    dequantised copy in the compute dtype (the dtype bitsandbytes multiplies in), returned in ``x``'s dtype;
    with gradients, the layer's own forward."""
    original, weight = getattr(self, _DENSE_ATTR)
    if args or kwargs or torch.is_grad_enabled():
        return original(x, *args, **kwargs)
    bias = None if self.bias is None else self.bias.to(weight.dtype)
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def _dequantized(module: nn.Module) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    state = module.weight.quant_state
    return bnbf.dequantize_4bit(module.weight.data, state).to(_compute_dtype(module)).reshape(state.shape)


@contextlib.contextmanager
def nf4_dense_layers(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """For the ``with`` block (when ``enabled``): every NF4 layer of ``model`` not bound yet multiplies by a
    dequantised copy of its weight (:func:`nf4_dense_forward`); yields how many layers. After the block the
    layers get their own forwards back and the copies are freed. A layer already bound to the NF4 decode
    kernel (:func:`~swiftune.models.nf4_decode.bind_nf4_decode`) is left to it."""
    layers: list[nn.Module] = []
    try:
        if enabled:
            for module in model.modules():
                if _takes_dense(module):
                    setattr(module, _DENSE_ATTR, (module.forward, _dequantized(module)))
                    module.forward = types.MethodType(nf4_dense_forward, module)
                    layers.append(module)
        yield len(layers)
    finally:
        for module in layers:
            restore_forward(module, getattr(module, _DENSE_ATTR)[0])
            delattr(module, _DENSE_ATTR)
