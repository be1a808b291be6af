"""Attention outputs kept through a layer's recompute in pinned host memory instead of on the GPU.

:mod:`swiftune.attention.kept_outputs` lets the recompute of a checkpointed layer take its sdpa kernels'
outputs (the attention output and its log-sum-exp) from the forward instead of running the kernel again.
Kept on the GPU that costs ``T x Hq x (2 D + 4)`` bytes a layer from the forward to the backward: at 131K
tokens of a Qwen3-8B shape 1.1 GB a layer, 38 GB for all 36. Here they go the way the offloaded layer inputs
go (:mod:`.checkpointing`): copied to host pages on the side stream during the forward, copied back one
layer ahead in the backward (:meth:`HostAttentionOutputs.prefetch`, started with the layer input's), so the
GPU holds two layers' outputs at a time and the copies overlap the compute around them.

The gradients are those of the kept-on-GPU path, bit for bit: the recompute's backward kernel gets the
same bytes, in the same strides (:class:`swiftune.training.offload_memory.HostCopy`).
"""

from __future__ import annotations

from typing import Any

import torch

from .offload_memory import HostCopy


class HostAttentionOutputs:
    """The sdpa kernel outputs of one checkpointed layer call, in host pages from its forward to its
    recompute: :meth:`keep` in the forward (in kernel order), :meth:`prefetch` to start copying them all
    back, :meth:`take` in the recompute (the same order). Floating-point outputs (the attention output and
    the log-sum-exp) go to the host; the others (a kernel's random seed and offset, empty placeholders,
    sizes) are small and stay as they are."""

    def __init__(self, pool: Any, page_bytes: int, stream: Any) -> None:
        self._pool, self._page_bytes, self._stream = pool, page_bytes, stream
        self._kept: list[tuple[bool, list[Any]]] = []  # per kernel call: (returned a tuple, its outputs)
        self._restored: list[Any] | None = None
        self._event: Any = None
        self._device: torch.device | None = None

    def _store(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.numel():
                self._device = value.device
                return HostCopy(self._pool, value, self._page_bytes, self._stream)
            return value.detach()
        return value

    def keep(self, out: Any) -> None:
        """Store one kernel call's outputs (a tensor or a tuple of outputs)."""
        values = list(out) if isinstance(out, tuple) else [out]
        self._kept.append((isinstance(out, tuple), [self._store(v) for v in values]))

    def prefetch(self) -> None:
        """Start copying every kept output back to the device (no-op once started or with nothing kept)."""
        if self._restored is not None or not self._kept:
            return
        restored = []
        for is_tuple, values in self._kept:
            back = []
            for value in values:
                if isinstance(value, HostCopy):
                    value, event = value.restore(self._stream)
                    self._event = event if event is not None else self._event  # one stream: the last covers all
                back.append(value)
            restored.append(tuple(back) if is_tuple else back[0])
        self._restored = restored

    def take(self) -> Any:
        """The next kernel call's outputs, on the device, ready to read on the current stream."""
        self.prefetch()
        if not self._restored:
            raise RuntimeError("swiftune kept attention outputs: this layer's stored outputs were used by an earlier "
                               "backward; a second backward through the same graph is not supported (run the "
                               "forward again)")
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None
        return self._restored.pop(0)


__all__ = ["HostAttentionOutputs"]
