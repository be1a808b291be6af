"""Decode steps through bitsandbytes NF4 layers without a bf16 copy of their weights.

bitsandbytes' ``Linear4bit`` multiplies more than one row by dequantising its whole weight to the compute dtype
first (a write and a read of ``2 N K`` bytes besides the ``N K / 2`` of codes), which made the rollout
engine's NF4 decode step 10x the time to read the codes (docs/benchmarks.md, "rollout_nf4").
:func:`nf4_decode_forward` runs such a layer through :func:`swiftune.kernels.nf4_weight_only_matmul`
instead, which decodes the codes in registers: for a few rows (:data:`NF4_DECODE_MIN_ROWS` to the
binding's ``max_rows``, :data:`NF4_DECODE_MAX_ROWS` by default) without gradients, on CUDA (or the Triton
interpreter); every other call goes to the layer's own forward.
:func:`bind_nf4_decode` binds it on every NF4 layer of a model, on the instance; :func:`unbind_nf4_decode`
restores them. A LoRA layer over a bound NF4 base (adapters at run time) then runs PEFT's own forward for such
calls (:func:`takes_nf4_decode`), whose call of its base layer reaches the kernel.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..kernels.nf4_matmul import NF4Weight, nf4_kernel_runs_on, nf4_kernel_takes, nf4_weight_only_matmul

#: rows up to which a decode step multiplies through the NF4 kernel by default (a G=16 step of one prompt);
#: more rows go to bitsandbytes, whose dequantised copy is then shared by more rows. Binding takes another
#: bound (``max_rows``, up to :data:`NF4_KERNEL_MAX_ROWS`): the kernel decodes each weight tile once per 64 rows
NF4_DECODE_MAX_ROWS = 16
#: the most rows a binding may send to the kernel: one tile of rows (its ``BLOCK_M`` is at most 64), so a step's
#: codes are still read once
NF4_KERNEL_MAX_ROWS = 64
#: rows from which it does: one row stays on bitsandbytes' own matrix-vector kernel, which reads no bf16 copy
#: either and was faster than the NF4 kernel at one row (docs/results/2026-12-03/nf4_lookup_sweep_h200.txt)
NF4_DECODE_MIN_ROWS = 2
_BOUND_ATTR = "swiftune_nf4_decode"
_MAX_ROWS_ATTR = "swiftune_nf4_max_rows"  # the binding's bound on the rows a call sends to the kernel
# the layer's NF4Weight, read once at binding: bitsandbytes keeps the double quantisation's offset as a
# device tensor, and reading it (a device-to-host copy) inside a CUDA-graph capture makes the capture fail
_WEIGHT_ATTR = "swiftune_nf4_weight"


def is_nf4_linear(module: nn.Module) -> bool:
    """A bitsandbytes ``Linear4bit`` holding NF4 codes (not FP4, not yet quantised). Not PEFT's QLoRA layer,
    whose class has the same name and whose ``weight`` is its base layer's: binding it would drop the adapters."""
    bnb = sys.modules.get("bitsandbytes")  # a model with 4-bit layers has imported it
    if bnb is None or not isinstance(module, bnb.nn.Linear4bit):
        return False
    state = getattr(module.weight, "quant_state", None)
    return state is not None and getattr(state, "quant_type", None) == "nf4"


def nf4_weight_of(module: nn.Module) -> NF4Weight:
    """The tensors of an NF4 ``Linear4bit``'s weight, as bitsandbytes' ``quant_state`` holds them."""
    state = module.weight.quant_state
    out_features, in_features = (int(d) for d in state.shape)
    nested = getattr(state, "nested", False)
    return NF4Weight(
        packed=module.weight.data, absmax=state.absmax, code=state.code, blocksize=int(state.blocksize),
        out_features=out_features, in_features=in_features,
        absmax2=state.state2.absmax if nested else None, code2=state.state2.code if nested else None,
        offset=float(state.offset) if nested else 0.0,
        blocksize2=int(state.state2.blocksize) if nested else 256,
    )


def nf4_decode_applies(x: torch.Tensor, max_rows: int = NF4_DECODE_MAX_ROWS) -> bool:
    """Whether a call with input ``x`` goes through the kernel: no gradients, :data:`NF4_DECODE_MIN_ROWS` to
    ``max_rows`` rows, on CUDA (or on CPU when the kernels are interpreted: the tests)."""
    rows = x.numel() // max(1, x.shape[-1])
    if torch.is_grad_enabled() or not NF4_DECODE_MIN_ROWS <= rows <= max_rows:
        return False
    return nf4_kernel_runs_on(x.device)


def takes_nf4_decode(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module`` (a base layer) is bound by :func:`bind_nf4_decode` and a call with ``x`` takes the kernel:
    a fused LoRA node over it then runs PEFT's own forward, whose base call reaches the kernel."""
    return is_nf4_decode_bound(module) and nf4_decode_applies(x, getattr(module, _MAX_ROWS_ATTR))


def nf4_decode_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Bound on an NF4 ``Linear4bit``: few rows without gradients through the NF4 kernel, in the layer's
    compute dtype as bitsandbytes would multiply them; the rest through the layer's own forward."""
    original = getattr(self, _BOUND_ATTR)
    if args or kwargs or not nf4_decode_applies(x, getattr(self, _MAX_ROWS_ATTR)):
        return original(x, *args, **kwargs)
    dtype = getattr(self, "compute_dtype", None) or x.dtype
    y = nf4_weight_only_matmul(x.to(dtype), getattr(self, _WEIGHT_ATTR), self.bias)
    return y.to(x.dtype)


def _bind(module: nn.Module, weight: NF4Weight, max_rows: int) -> None:
    setattr(module, _WEIGHT_ATTR, weight)
    setattr(module, _MAX_ROWS_ATTR, max_rows)
    setattr(module, _BOUND_ATTR, module.forward)
    module.forward = types.MethodType(nf4_decode_forward, module)


def restore_forward(module: nn.Module, original: Any) -> None:
    """Drop the forward bound on ``module``'s instance; ``original`` (the forward it replaced) comes back when
    it was an own forward of the instance, not the class's."""
    del module.forward
    if getattr(original, "__func__", None) is not type(module).forward:
        module.forward = original


def is_nf4_decode_bound(module: nn.Module) -> bool:
    """Whether :func:`bind_nf4_decode` bound ``module``."""
    return getattr(module, _BOUND_ATTR, None) is not None


def _unbind(module: nn.Module) -> None:
    restore_forward(module, getattr(module, _BOUND_ATTR))
    delattr(module, _BOUND_ATTR)
    delattr(module, _WEIGHT_ATTR)
    delattr(module, _MAX_ROWS_ATTR)


def check_nf4_decode_max_rows(max_rows: int, name: str = "max_rows") -> int:
    """``max_rows`` if a binding may take it (an int from :data:`NF4_DECODE_MIN_ROWS` to
    :data:`NF4_KERNEL_MAX_ROWS`), else a ``ValueError`` naming the option (``name``)."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not \
            NF4_DECODE_MIN_ROWS <= max_rows <= NF4_KERNEL_MAX_ROWS:
        raise ValueError(f"{name} must be an int from {NF4_DECODE_MIN_ROWS} to {NF4_KERNEL_MAX_ROWS} (the rows of "
                         f"one tile of the NF4 kernel), got {max_rows!r}")
    return max_rows


def _bind_unbound_layers(model: nn.Module, max_rows: int) -> list[nn.Module]:
    """Bind every NF4 layer not bound yet whose rows start on absmax blocks; returns the layers bound."""
    check_nf4_decode_max_rows(max_rows)
    bound = []
    for module in model.modules():
        if is_nf4_linear(module) and not is_nf4_decode_bound(module):
            weight = nf4_weight_of(module)
            if nf4_kernel_takes(weight):
                _bind(module, weight, max_rows)
                bound.append(module)
    return bound


def bind_nf4_decode(model: nn.Module, max_rows: int = NF4_DECODE_MAX_ROWS) -> int:
    """Bind :func:`nf4_decode_forward` on every NF4 layer of ``model`` (once) whose rows start on absmax blocks
    (:func:`~swiftune.kernels.nf4_matmul.nf4_kernel_takes`; the others keep bitsandbytes' forward); returns how
    many are bound. Calls of :data:`NF4_DECODE_MIN_ROWS` to ``max_rows`` rows (at most
    :data:`NF4_KERNEL_MAX_ROWS`) take the kernel. Each layer's codes and scales are taken at binding: move or
    re-quantise the model only while unbound."""
    return len(_bind_unbound_layers(model, max_rows))


def unbind_nf4_decode(model: nn.Module) -> int:
    """Restore the forwards :func:`bind_nf4_decode` replaced; returns how many."""
    layers = [m for m in model.modules() if is_nf4_decode_bound(m)]
    for module in layers:
        _unbind(module)
    return len(layers)


@contextlib.contextmanager
def nf4_decode_layers(model: nn.Module, enabled: bool = True, max_rows: int = NF4_DECODE_MAX_ROWS) -> Iterator[int]:
    """:func:`bind_nf4_decode` for the ``with`` block (when ``enabled``), yielding how many layers it bound;
    after it, exactly those are unbound again (layers bound before stay bound)."""
    layers = _bind_unbound_layers(model, max_rows) if enabled else []
    try:
        yield len(layers)
    finally:
        for module in layers:
            _unbind(module)
