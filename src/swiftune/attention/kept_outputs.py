"""Attention outputs kept through a checkpointed layer's recompute.

A checkpointed decoder layer runs its forward twice: once in the forward pass, once more in backward to
rebuild what its backward needs. For long sequences the attention kernel is most of that second forward
(its cost grows with the square of the sequence, the projections' only linearly), and its result is small
next to that cost: the output, ``T x Hq x D`` in the activation dtype, and the log-sum-exp of each query
row, ``T x Hq`` in float32. Keeping those two through the recompute (PyTorch's selective activation
checkpointing, ``torch.utils.checkpoint.create_selective_checkpoint_contexts``) lets the recompute take
them instead of running the kernel again; the backward kernel then gets the same ``q, k, v`` (recomputed,
bit-identical: the projections run again on the same input), output and log-sum-exp as without it, so the
gradients are the same.

Only the fused attention kernels that ``F.scaled_dot_product_attention`` dispatches to are kept
(:func:`sdpa_kernel_ops`: cuDNN's, FlashAttention's, the memory-efficient one, and the CPU flash kernel);
everything else in the layer is recomputed as before. Other attention kernels (flex attention, varlen)
are recomputed as they were. The offloaded checkpointing
(:func:`swiftune.training.checkpointing.enable_offloaded_checkpointing`, ``attention_output_layers``)
keeps them for the last ``n`` decoder layers, on the device, from each layer's forward to its backward:
:func:`swiftune.memory.planner.attention_output_bytes` a layer. As with any selective checkpointing, a
graph through such a layer takes one backward (after ``retain_graph=True`` a second backward raises a
``RuntimeError`` from PyTorch's selective checkpointing); the trainers run one backward a forward.

:func:`attention_outputs_in` is the same pair of contexts around a store of the caller's instead of
PyTorch's selective-checkpointing cache: two dispatch modes (``TorchDispatchMode``, PyTorch's documented
extension point for intercepting operators below autograd, as selective checkpointing's own are) that hand
each fused kernel's outputs to the store in the forward and return the store's in the recompute. The
offloaded checkpointing's store keeps them in pinned host memory
(:class:`swiftune.training.host_attention_outputs.HostAttentionOutputs`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

#: the operators ``F.scaled_dot_product_attention`` dispatches to; those this torch lacks are skipped
SDPA_KERNEL_OP_NAMES = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")


@functools.lru_cache(maxsize=1)
def sdpa_kernel_ops() -> frozenset:
    """The ``aten`` overloads of the fused sdpa kernels this torch has."""
    ops = []
    for name in SDPA_KERNEL_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.append(packet.default)
    return frozenset(ops)


def _keep_sdpa_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in sdpa_kernel_ops() else CheckpointPolicy.PREFER_RECOMPUTE


# the keeping or the serving half of the checkpointed layer running now (None: no layer keeps its outputs);
# set only inside a layer's checkpointed function, by the contexts of attention_outputs_context
_LAYER_MODE: ContextVar[Any] = ContextVar("swiftune_kept_attention_outputs", default=None)


class _LayerScope:
    """One half of a layer's pair: names the pair's dispatch mode as the current layer's while the layer runs."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self._token: Any = None

    def __enter__(self) -> None:
        self._token = _LAYER_MODE.set(self.mode)

    def __exit__(self, *exc: Any) -> None:
        _LAYER_MODE.reset(self._token)


def attention_outputs_context() -> tuple[_LayerScope, _LayerScope]:
    """``context_fn`` of a non-reentrant ``checkpoint`` whose layer keeps its sdpa outputs: a fresh pair of
    selective-checkpointing modes (sharing one store) for the forward and the recompute, entered only around
    the attention call (:func:`kept_attention_outputs`), not around the whole layer, whose recompute may run
    other operators than its forward (an offloaded input is copied back, a tiled MLP skips its output)."""
    keeping, serving = create_selective_checkpoint_contexts(_keep_sdpa_outputs)
    return _LayerScope(keeping), _LayerScope(serving)


class AttentionOutputStore(Protocol):
    """Where a layer's fused attention outputs wait from its forward to its recompute."""

    def keep(self, out: Any) -> None: ...

    def take(self) -> Any: ...


class _KeepingInto(TorchDispatchMode):
    """Forward: each fused sdpa kernel runs and its outputs go to the store too."""

    def __init__(self, store: AttentionOutputStore) -> None:
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in sdpa_kernel_ops():
            self.store.keep(out)
        return out


class _ServingFrom(TorchDispatchMode):
    """Recompute: each fused sdpa kernel is not run; its outputs come from the store, in the forward's order."""

    def __init__(self, store: AttentionOutputStore) -> None:
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in sdpa_kernel_ops():
            return self.store.take()
        return func(*args, **(kwargs or {}))


def attention_outputs_in(store: AttentionOutputStore) -> tuple[_LayerScope, _LayerScope]:
    """``context_fn`` of a non-reentrant ``checkpoint`` (bind ``store`` with ``functools.partial``) whose layer
    keeps its sdpa outputs in ``store``: as :func:`attention_outputs_context`, entered only around the
    attention call."""
    return _LayerScope(_KeepingInto(store)), _LayerScope(_ServingFrom(store))


@contextlib.contextmanager
def kept_attention_outputs() -> Iterator[None]:
    """Around one layer's attention (every document of it): in a layer that keeps its outputs, the forward
    stores the sdpa kernels' outputs and the recompute takes them back in the same order; elsewhere nothing."""
    mode = _LAYER_MODE.get()
    if mode is None:
        yield
        return
    token = _LAYER_MODE.set(None)  # one entry a layer call: the serving mode counts its kernels from its entry
    try:
        with mode:
            yield
    finally:
        _LAYER_MODE.reset(token)


def check_attention_output_layers(value: Any, num_layers: int) -> int:
    """``attention_output_layers`` as an int in ``0..num_layers``, or a ``ValueError`` saying what to pass."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= num_layers:
        raise ValueError(f"attention_output_layers must be an int from 0 (keep none) to the model's {num_layers} "
                         f"decoder layers (keep every layer's), got {value!r}")
    return value


@contextlib.contextmanager
def apart_from_kept_attention_outputs() -> Iterator[None]:
    """Around work inside a layer's checkpointed function that is not the layer's own forward (the offloaded
    checkpointing's rerun of the layer before, deriving an input): its attention runs as it would elsewhere,
    and the layer's stored outputs are left for the layer's own attention."""
    token = _LAYER_MODE.set(None)
    try:
        yield
    finally:
        _LAYER_MODE.reset(token)
