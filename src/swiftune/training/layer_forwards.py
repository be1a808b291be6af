"""Binding a training runtime's forward on the decoder layers, and taking it off again.

Offloaded checkpointing (:mod:`.checkpointing`) and graphed layers (:mod:`.layer_graphs`) each run
every decoder layer through a forward of their own, bound on the layer *instance*: the class and the
modeling file stay transformers' own. Each keeps, in the instance's ``__dict__`` under its own
names, the forward the instance had before (``None``: the class's) and transformers' per-layer
checkpointing flag, which it switches off, because the runtime checkpoints the layer itself and a
layer must never be checkpointed twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType
from typing import Any

from torch import nn

__all__ = ["CACHE_KWARGS", "LayerForwardKeys", "bind_layer_forwards", "drop_cache_arguments", "layer_input",
           "previous_forward", "take_layer_input", "unbind_layer_forwards"]

#: what transformers names a layer's KV cache argument across versions and families
CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


@dataclass(frozen=True)
class LayerForwardKeys:
    """The ``__dict__`` names one runtime keeps on each layer: its (state, index), the previous
    forward, transformers' previous checkpointing flag."""

    layer: str
    previous: str
    checkpointing_flag: str


def bind_layer_forwards(layers: list[nn.Module], forward: Callable, state: Any, keys: LayerForwardKeys) -> None:
    """Bind ``forward(layer, *args, **kwargs)`` on every layer, with ``(weakref(state), index)`` under
    ``keys.layer``; a layer bound before keeps its first previous forward (calling again updates the state)."""
    for i, layer in enumerate(layers):
        if keys.layer not in layer.__dict__:
            layer.__dict__[keys.previous] = layer.__dict__.get("forward")
            layer.__dict__[keys.checkpointing_flag] = layer.__dict__.get("gradient_checkpointing")
            layer.forward = MethodType(forward, layer)
        layer.__dict__[keys.layer] = (weakref.ref(state), i)
        if getattr(layer, "gradient_checkpointing", False):
            layer.gradient_checkpointing = False


def unbind_layer_forwards(layers: list[nn.Module], keys: LayerForwardKeys) -> None:
    """Give every bound layer back its previous forward and checkpointing flag."""
    for layer in layers:
        if keys.layer not in layer.__dict__:
            continue
        previous = layer.__dict__.pop(keys.previous, None)
        if previous is None:
            layer.__dict__.pop("forward", None)
        else:
            layer.forward = previous
        flag = layer.__dict__.pop(keys.checkpointing_flag, None)
        if flag is None:
            layer.__dict__.pop("gradient_checkpointing", None)
        else:
            layer.gradient_checkpointing = flag
        del layer.__dict__[keys.layer]


def previous_forward(layer: nn.Module, keys: LayerForwardKeys) -> Callable:
    """The forward the layer had before the runtime bound its own (the class's when none)."""
    return layer.__dict__.get(keys.previous) or MethodType(type(layer).forward, layer)


def layer_input(args: tuple, kwargs: dict) -> tuple[Any, tuple] | None:
    """``(hidden_states, other positional arguments)`` of a decoder layer call (``hidden_states`` popped
    from ``kwargs`` when given by name), or ``None`` when the call has none."""
    if args:
        return args[0], args[1:]
    if "hidden_states" in kwargs:
        return kwargs.pop("hidden_states"), ()
    return None


def take_layer_input(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, tuple] | None:
    """:func:`layer_input`, after turning off transformers' own per-layer checkpointing flag on ``layer``
    (transformers sets it again after our forward is bound): a runtime forward that checkpoints or
    graphs the layer itself must never have it checkpointed twice."""
    if getattr(layer, "gradient_checkpointing", False):
        layer.gradient_checkpointing = False
    return layer_input(args, kwargs)


def drop_cache_arguments(kwargs: dict) -> None:
    """As transformers' checkpointing does: no KV cache in a checkpointed layer (the recompute would
    update it a second time)."""
    for k in CACHE_KWARGS:
        if kwargs.get(k) is not None:
            kwargs[k] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
