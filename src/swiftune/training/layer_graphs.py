"""CUDA-graphed decoder layers for LoRA training: one graph replay per layer forward, one per backward.

Why: at a few thousand tokens a step, an 8B LoRA step spends most of its wall time in the host
(Python, module calls, autograd nodes and kernel launches of 36 layers, three passes each), not on
the GPU. A CUDA graph replays a layer's kernels from one call. The figures are in
docs/benchmarks.md.

What runs is gradient checkpointing, with the layer's work in two graphs:

* forward: the layer under ``no_grad`` reads its input buffer and writes the next layer's input
  buffer. Only the input stays alive until backward, as with checkpointing.
* backward: the recompute with grad, then ``torch.autograd.grad`` of the output with respect to the
  input and the layer's LoRA parameters. The upstream gradient is read from a static buffer, and the
  results go back into that buffer and into one static buffer per parameter (one set shared by the
  layers of the same shapes and by their graphs of every bucket).

:class:`GraphedLayerFunction` ties the two into autograd. The parameters are its inputs, so their
gradients reach ``.grad`` through autograd's own accumulation: the node returns one copy of the layer's
gradient buffers (views of one flat tensor) after each backward replay, as the next layer's replay
rewrites them.

Static shapes. A graph replays fixed addresses and shapes, but a padding-free step has ``T`` tokens in
``N`` documents, both different every step. So the row is padded to a bucket of ``Tb`` tokens
(:func:`token_bucket`, at most about 1/8 more) by one extra document of zeros. Zeros stay zeros
through RMSNorm, attention and the gated MLP. No real token attends to that document, and its
upstream gradient is zero, so it adds nothing to any gradient. The document offsets are padded to a
power-of-two slot count with zero-length documents, and the kernel's longest-document bound is
``Tb``. Graphs are kept per ``(Tb, slots, autocast)``, in one memory pool shared by every graph:
replays never overlap, and each graph's only live results are its static buffers.

When it applies. Each forward is checked, and anything else runs the layer as before under
non-reentrant checkpointing. The conditions: CUDA; training with grad; one padding-free row (batch
1, no padding mask, the packed layout of :mod:`swiftune.attention`); no KV cache; a varlen
attention kernel that takes the layer (no sliding window, soft-cap or sinks); the layer's trainable
parameters all LoRA adapters, with no active dropout; the same parameter tensors as at capture.
A second forward before the backward of the first would overwrite the saved inputs, so that
backward raises instead of computing wrong gradients.

Layer inputs on the host (``offload_inputs``). The static inputs of every layer stay on the GPU by
default (``L + 1`` buffers at the largest bucket so far). With ``offload_inputs`` the layers read and
write a ring of three device buffers (layer ``i`` reads slot ``i % 3`` and writes slot ``(i + 1) % 3``),
and each layer's input but the last two's is copied into its own pinned host buffer on a side stream while
the layer's forward replays. A forward that would overwrite a slot waits for that slot's copy to the host
(three slots: the copy has the next layer's whole forward to finish). In backward, the input of layer
``i - 1`` comes back into its slot on the side stream while layer ``i``'s backward replays, and layer
``i - 1`` waits for it. The layer outputs the model sees are ring slots, overwritten three layers on; a
forward that asks for hidden states passes ``output_hidden_states`` to the layers, which then run as before
(a layer argument the graphs do not replay).

Off CUDA (the tests) the same buffers, buckets and autograd node run, with each "graph" a Python
closure called in place of a replay, and the copies to and from the host synchronous.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..attention.backends import unsupported_reason
from ..attention.hf import PACKED_KWARG
from ..attention.packing import PackedBatch
from ..models.patching import causal_lm_of
from .checkpointing import decoder_layers, is_offloaded_checkpointing
from .layer_forwards import LayerForwardKeys, bind_layer_forwards, drop_cache_arguments, \
    previous_forward, take_layer_input, unbind_layer_forwards

logger = logging.getLogger(__name__)

__all__ = ["GraphedLayerFunction", "disable_graphed_layers", "enable_graphed_layers", "graphed_layer_stats",
           "is_graphed", "token_bucket"]

_STACK = "_swiftune_graphed_stack"  # on the transformers model: the GraphedStack
# on each decoder layer: (stack ref, index), the instance's forward before ours, transformers' flag before ours
_KEYS = LayerForwardKeys("_swiftune_graphed_layer", "_swiftune_graphed_orig_forward", "_swiftune_graphed_prev_gc")
# keyword arguments a decoder layer may get that the graphs replace or that must be empty
_HANDLED_KWARGS = frozenset({"attention_mask", "position_ids", "position_embeddings", PACKED_KWARG, "use_cache",
                             "cache", "past_key_values", "past_key_value", "cache_position"})
_VARLEN_KERNELS = ("varlen", "flash_attn")
MIN_SLOTS = 8
#: device buffers of the layer inputs with ``offload_inputs``: one being read, one being written, and the one
#: whose copy to the host may still be running
RING_SLOTS = 3


#: the smallest step of the token buckets: multiples of it keep the kernels from specialising differently per bucket
MIN_BUCKET_STEP = 256


def token_bucket(tokens: int, min_step: int = MIN_BUCKET_STEP) -> int:
    """The padded token count of a step's graphs: ``tokens`` rounded up to a multiple of
    ``max(min_step, 2**(floor(log2 tokens) - 3))``, so fewer than ``max(min_step, tokens / 8)`` more (and far fewer
    distinct shapes, hence captures, over a run)."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    step = max(min_step, 2 ** (int(math.log2(tokens)) - 3))
    return -(-tokens // step) * step


def doc_slots(num_docs: int) -> int:
    """Document offsets per graph: a power of two > ``num_docs`` (one slot for the padding document)."""
    return max(MIN_SLOTS, 1 << num_docs.bit_length())


class _Closure:
    """Off CUDA: the "graph" is the captured function itself, called on replay."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@dataclass
class _StepLayout:
    tokens: int
    bucket: int
    slots: int
    autocast: tuple
    packed: PackedBatch  # the real step's layout (identity: which forward this is)
    generation: int
    flags: tuple  # ((name, None or False), ...): the layer's other arguments, replayed as given


class _LayerGraphs:
    """The forward and backward graphs of one layer for one ``(bucket, slots, autocast)``."""

    def __init__(self, forward: Any, backward: Any, params: list[nn.Parameter], param_grads: list[torch.Tensor],
                 param_ptrs: tuple[int, ...]) -> None:
        self.forward, self.backward = forward, backward
        self.params, self.param_grads, self.param_ptrs = params, param_grads, param_ptrs


class GraphedStack:
    """Buffers, graphs and per-step layout of one model's graphed decoder layers."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], use_cuda_graphs: bool | None) -> None:
        self.model_ref = weakref.ref(model)
        self.layers = [weakref.ref(layer) for layer in layers]
        self.use_cuda_graphs = use_cuda_graphs
        self.min_bucket_step = MIN_BUCKET_STEP  # enable_graphed_layers' min_bucket_tokens
        self.capacity = 0
        self.offload_inputs = False  # enable_graphed_layers' offload_inputs (module doc)
        # [1, capacity, H] buffers: layer i reads acts[slot(i)] and writes acts[slot(i + 1)]; L + 1 of them, or
        # RING_SLOTS with offloaded inputs, where host[i] keeps layer i's input (i < L - 2) between its passes
        self.acts: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        self.copy_stream: Any = None  # CUDA: the side stream of the copies to and from the host
        self.to_host: dict[int, Any] = {}  # layer -> CUDA event: its input's copy to the host is done
        self.from_host: dict[int, Any] = {}  # layer -> CUDA event: its input is back in its slot
        self.grad: torch.Tensor | None = None  # [1, capacity, H]: upstream gradient in, input gradient out
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.offsets: dict[int, torch.Tensor] = {}  # slots -> int32 [slots + 1]
        # (bucket, slots) -> the layout the layers see; its per-forward cache (document bounds read on the
        # host by the reference kernel off CUDA) is emptied every step, and a captured kernel may not use one
        self.layouts: dict[tuple[int, int], PackedBatch] = {}
        self.graphs: dict[tuple, _LayerGraphs] = {}  # (layer, bucket, slots, autocast) -> graphs
        # the layers' trainable shapes and dtypes -> static gradient buffers (views of one flat tensor where the
        # dtypes agree): one set shared by every layer of those shapes and by its graphs of every bucket; the
        # autograd node hands autograd a copy right after each replay, before the next layer's replay rewrites it
        self.param_grads: dict[tuple, list[torch.Tensor]] = {}
        self.pool: Any = None
        self.step: _StepLayout | None = None
        self.generation = 0
        self.kernel: str | None = None
        self.warmed: set[tuple] = set()  # (autocast, flags) already run once outside capture
        self.broken: str | None = None  # a capture failed: every later forward falls back, with this reason
        self.stats = {"graphed_forwards": 0, "fallback_forwards": 0, "captures": 0, "last_fallback": ""}

    def __deepcopy__(self, memo: dict) -> None:
        # graphs cannot be copied, and a copy's layers are other modules: a deep copy of a graphed model
        # (a reference model, say) runs its layers ungraphed (see _graphed_forward)
        return None

    # -- eligibility
    def cuda_graphs(self, device: torch.device) -> bool:
        return device.type == "cuda" and self.use_cuda_graphs is not False

    def slot(self, index: int) -> int:
        """The ``acts`` buffer holding layer ``index``'s input (``index = L``: the last layer's output)."""
        return index % RING_SLOTS if self.offload_inputs else index

    def offloads(self, index: int) -> bool:
        """Whether layer ``index``'s input goes to the host: all but the last two, which are still in their
        slots when backward begins."""
        return self.offload_inputs and index < len(self.layers) - 2

    def _fallback(self, why: str) -> None:
        self.step = None
        self.stats["fallback_forwards"] += 1
        self.stats["last_fallback"] = why

    def begin_step(self, x: torch.Tensor, kwargs: dict) -> None:
        """At layer 0 of a forward with grad: the step's layout, or ``None`` (the reason kept in stats)."""
        self.step = None
        packed = kwargs.get(PACKED_KWARG)
        if self.broken is not None:
            return self._fallback(self.broken)
        if x.dim() != 3 or x.shape[0] != 1:
            return self._fallback(f"input of shape {tuple(x.shape)}: one padding-free row is graphed")
        if not isinstance(packed, PackedBatch) or packed.indices is not None or packed.batch_size != 1 \
                or packed.seq_len != x.shape[1]:
            return self._fallback("no packed padding-free layout in the layer's arguments")
        if x.device.type != "cuda" and self.use_cuda_graphs:
            return self._fallback("CUDA graphs need a CUDA tensor")
        # other arguments (output_attentions, ...) are replayed as they are when unset
        flags = tuple(sorted((k, v) for k, v in kwargs.items() if k not in _HANDLED_KWARGS))
        if any(v is not None and v is not False for _, v in flags):
            return self._fallback(f"layer arguments it does not replay: {[k for k, v in flags if v]}")
        if kwargs.get("attention_mask") is not None:
            return self._fallback("a padding mask")
        if any(kwargs.get(k) is not None for k in ("cache", "past_key_values", "past_key_value")) or \
                kwargs.get("use_cache"):
            return self._fallback("a KV cache")
        cos_sin = kwargs.get("position_embeddings")
        if not (isinstance(cos_sin, tuple) and len(cos_sin) == 2 and all(isinstance(t, torch.Tensor) for t in cos_sin)
                and cos_sin[0].dim() == 3 and cos_sin[0].shape[:2] == x.shape[:2]):
            return self._fallback("no [1, T, D] rotary tables in position_embeddings")
        autocast = (torch.is_autocast_enabled(x.device.type),
                    torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None)
        tokens = x.shape[1]
        self.generation += 1
        self.step = _StepLayout(tokens, token_bucket(tokens, self.min_bucket_step), doc_slots(packed.num_docs),
                                autocast, packed, self.generation, flags)
        self._fill_step_buffers(x, cos_sin, packed)

    def _ensure_capacity(self, x: torch.Tensor, cos: torch.Tensor, bucket: int) -> None:
        num_layers = len(self.layers)
        fits = (self.capacity >= bucket and self.acts and self.acts[0].dtype == x.dtype
                and self.acts[0].shape[-1] == x.shape[-1] and self.acts[0].device == x.device
                and self.cos is not None and self.cos.dtype == cos.dtype and self.cos.shape[-1] == cos.shape[-1])
        if fits:
            return
        # a larger step than any so far: new buffers, every graph captured again; a quarter more than
        # the old capacity at least, so that a run's first steps grow it a few times, not at every new bucket
        self.graphs.clear()
        self.offsets.clear()
        self.layouts.clear()
        self.pool = None
        capacity = (max(bucket, token_bucket(self.capacity + self.capacity // 4, self.min_bucket_step)) if self.capacity
                    else bucket)
        hidden = x.shape[-1]
        self.acts, self.host = [], []  # the old ones freed before the new ones are made
        buffers = RING_SLOTS if self.offload_inputs else num_layers + 1
        self.acts = [torch.zeros(1, capacity, hidden, dtype=x.dtype, device=x.device) for _ in range(buffers)]
        if self.offload_inputs:
            pin = x.device.type == "cuda"
            self.host = [torch.empty(1, capacity, hidden, dtype=x.dtype, pin_memory=pin)
                         for i in range(num_layers) if self.offloads(i)]
        self.grad = torch.zeros(1, capacity, hidden, dtype=x.dtype, device=x.device)
        self.cos = torch.ones(1, capacity, cos.shape[-1], dtype=cos.dtype, device=x.device)
        self.sin = torch.zeros(1, capacity, cos.shape[-1], dtype=cos.dtype, device=x.device)
        self.positions = torch.zeros(1, capacity, dtype=torch.long, device=x.device)
        self.capacity = capacity

    def _fill_step_buffers(self, x: torch.Tensor, cos_sin: tuple, packed: PackedBatch) -> None:
        step = self.step
        assert step is not None
        cos, sin = cos_sin
        self._ensure_capacity(x, cos, step.bucket)
        t, tb = step.tokens, step.bucket
        self.cos[:, :t].copy_(cos)
        self.sin[:, :t].copy_(sin)
        if tb > t:  # the padding document: zeros in, an identity rotation
            self.acts[0].data[:, t:tb].zero_()
            self.cos[:, t:tb].fill_(1)
            self.sin[:, t:tb].zero_()
        offsets = self.offsets.get(step.slots)
        if offsets is None:
            offsets = self.offsets[step.slots] = torch.empty(step.slots + 1, dtype=torch.int32, device=x.device)
        n = packed.num_docs
        offsets[: n + 1].copy_(packed.cu_seqlens)
        offsets[n + 1:].fill_(tb)  # the padding document [t, tb), then zero-length ones
        for layout in self.layouts.values():
            layout.cache.clear()

    def static_kwargs(self) -> dict:
        step = self.step
        assert step is not None
        tb = step.bucket
        layout = self.layouts.get((tb, step.slots))
        if layout is None:
            layout = self.layouts[(tb, step.slots)] = PackedBatch(self.offsets[step.slots], tb, 1, tb, None,
                                                                  self.kernel or "varlen")
        return {"attention_mask": None, "position_ids": self.positions[:, :tb],
                "position_embeddings": (self.cos[:, :tb], self.sin[:, :tb]), PACKED_KWARG: layout,
                "use_cache": False, **dict(step.flags)}

    # -- layer inputs to and from the host (offload_inputs)
    def _copy(self, device: torch.device, copy: Callable[[], None], events: dict[int, Any], index: int) -> None:
        """Run ``copy`` after the work queued so far: on CUDA on the side stream, recording ``events[index]``
        (waited for by :meth:`wait_copy`); elsewhere now."""
        if device.type != "cuda":
            copy()
            return
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device=device)
        main = torch.cuda.current_stream(device)
        self.copy_stream.wait_stream(main)
        with torch.cuda.stream(self.copy_stream):
            copy()
            events[index] = torch.cuda.Event()
            events[index].record(self.copy_stream)

    @staticmethod
    def wait_copy(device: torch.device, events: dict[int, Any], index: int) -> None:
        event = events.pop(index, None)
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)

    def input_to_host(self, index: int, bucket: int) -> None:
        """Layer ``index``'s input (in its slot now) into its host buffer, beside the layer's forward."""
        src, dst = self.acts[self.slot(index)][:, :bucket], self.host[index][:, :bucket]
        self._copy(src.device, lambda: dst.copy_(src, non_blocking=True), self.to_host, index)

    def input_from_host(self, index: int, bucket: int) -> None:
        """Layer ``index``'s input back into its slot, beside the backward of the layer above."""
        src, dst = self.host[index][:, :bucket], self.acts[self.slot(index)][:, :bucket]
        self._copy(dst.device, lambda: dst.data.copy_(src, non_blocking=True), self.from_host, index)

    # -- capture
    def layer_graphs(self, index: int, layer: nn.Module, orig: Callable) -> _LayerGraphs | None:
        step = self.step
        assert step is not None
        params = [p for p in layer.parameters() if p.requires_grad]
        key = (index, step.bucket, step.slots, step.autocast, step.flags)
        graphs = self.graphs.get(key)
        ptrs = tuple(p.data_ptr() for p in params)
        if graphs is not None and graphs.param_ptrs == ptrs and len(graphs.params) == len(params):
            return graphs
        try:
            graphs = self._capture(index, layer, orig, params, ptrs)
        except Exception as e:  # noqa: BLE001 - e.g. a kernel that syncs the host: no graph, said once
            self.broken = f"capturing layer {index} failed ({type(e).__name__}: {e})"
            logger.warning("swiftune graphed layers: %s; the layers run with plain checkpointing from now on",
                           self.broken)
            return None
        self.graphs[key] = graphs
        self.stats["captures"] += 1
        return graphs

    def gradient_buffers(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The static parameter-gradient buffers of a layer with these trainable parameters: one set per
        signature (shapes, dtypes, device), shared by the layers that have it and their graphs of every bucket;
        views of one flat tensor when the dtypes agree (one copy hands a layer's gradients to autograd)."""
        signature = tuple((tuple(p.shape), p.dtype, p.device) for p in params)
        kept = self.param_grads.get(signature)
        if kept is not None:
            return kept
        if params and len({p.dtype for p in params}) == 1:
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            buffers = [view.view_as(p) for view, p in zip(flat.split([p.numel() for p in params]), params)]
        else:
            buffers = [torch.zeros_like(p) for p in params]
        self.param_grads[signature] = buffers
        return buffers

    def _capture(self, index: int, layer: nn.Module, orig: Callable, params: list[nn.Parameter],
                 ptrs: tuple[int, ...]) -> _LayerGraphs:
        step = self.step
        assert step is not None and self.grad is not None
        tb = step.bucket
        x_in, x_out = self.acts[self.slot(index)][:, :tb], self.acts[self.slot(index + 1)][:, :tb]
        grad = self.grad[:, :tb]
        kwargs = self.static_kwargs()
        param_grads = self.gradient_buffers(params)
        enabled, dtype = step.autocast
        device_type = x_in.device.type

        def autocast():
            if not enabled:
                return torch.autocast(device_type, enabled=False)
            return torch.autocast(device_type, dtype=dtype, cache_enabled=False)

        def run_forward() -> None:
            with torch.no_grad(), autocast():
                _write(x_out, _first(orig(x_in, **kwargs)))

        def run_backward() -> None:
            with torch.enable_grad(), autocast():
                x = x_in.detach().requires_grad_(True)
                y = _first(orig(x, **kwargs))
                grads = torch.autograd.grad(y, [x, *params], grad, allow_unused=True)
            _write(grad, grads[0])
            for buf, g in zip(param_grads, grads[1:]):
                if g is None:
                    buf.zero_()
                else:
                    _write(buf, g)

        if not self.cuda_graphs(x_in.device):
            return _LayerGraphs(_Closure(run_forward), _Closure(run_backward), params, param_grads, ptrs)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        warm_key = (step.autocast, step.flags)
        if warm_key not in self.warmed:
            # one warm-up outside capture (Triton compiles its kernels, cuBLAS sets up), on a side stream as
            # capture requires; it writes only buffers the step overwrites anyway. Once per setup, not per
            # bucket: buckets are multiples of 256 tokens, so no kernel specialises differently on them
            side = torch.cuda.Stream(device=x_in.device)
            side.wait_stream(torch.cuda.current_stream(x_in.device))
            with torch.cuda.stream(side):
                run_forward()
                run_backward()
            torch.cuda.current_stream(x_in.device).wait_stream(side)
            self.warmed.add(warm_key)
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(forward, pool=self.pool):
            run_forward()
        with torch.cuda.graph(backward, pool=self.pool):
            run_backward()
        layout = kwargs[PACKED_KWARG]
        if layout.cache:  # host-side values of one step baked into a graph would be wrong the next
            raise RuntimeError(f"swiftune graphed layers: the {self.kernel} attention kept per-step values "
                               f"({sorted(map(str, layout.cache))}) in a captured layer")
        return _LayerGraphs(forward, backward, params, param_grads, ptrs)


def _write(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Copy into a static buffer without bumping its autograd version: a graph replay writes the
    same buffers unseen by autograd, and the closures off CUDA must behave the same (the stale-input
    check is :attr:`GraphedStack.generation`, on every device)."""
    buffer.data.copy_(value)


def _copies(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of a layer's gradient buffers, which the next layer's backward rewrites: one copy of their flat
    tensor when they are its views (autograd adds them into ``.grad``, or takes them as ``.grad``)."""
    if not buffers:
        return []
    base = buffers[0]._base
    if base is not None and all(b._base is base for b in buffers) and \
            sum(b.numel() for b in buffers) == base.numel():
        return [view.view_as(b) for view, b in zip(base.clone().split([b.numel() for b in buffers]), buffers)]
    return [b.clone() for b in buffers]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class GraphedLayerFunction(torch.autograd.Function):
    """One decoder layer as one autograd node: forward and backward are graph replays (see the
    module doc). Inputs: the stack, the layer index, its graphs, ``x [1, T, H]``, then the layer's
    trainable parameters (so autograd accumulates their gradients)."""

    @staticmethod
    def forward(ctx, stack: GraphedStack, index: int, graphs: _LayerGraphs, x: torch.Tensor,  # type: ignore[override]
                *params: torch.Tensor) -> torch.Tensor:
        step = stack.step
        assert step is not None
        t, tb = step.tokens, step.bucket
        x_in = stack.acts[stack.slot(index)]
        if x.data_ptr() != x_in.data_ptr() or x.shape[1] != t:
            _write(x_in[:, :t], x)
        if stack.offloads(index):
            stack.input_to_host(index, tb)
        if stack.offload_inputs and index >= RING_SLOTS - 1:
            # the slot this layer writes held the input of the layer RING_SLOTS - 1 below: copied out first
            GraphedStack.wait_copy(x.device, stack.to_host, index - (RING_SLOTS - 1))
        graphs.forward.replay()
        ctx.stack, ctx.index, ctx.graphs, ctx.tokens, ctx.bucket = stack, index, graphs, t, tb
        ctx.generation = step.generation
        return stack.acts[stack.slot(index + 1)][:, :t]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        stack: GraphedStack = ctx.stack
        if ctx.generation != stack.generation:
            raise RuntimeError(
                "swiftune graphed layers: another forward with grad ran between this forward and its backward, and "
                "its layer inputs replaced this one's; run backward before the next forward, or disable the graphs "
                "(swiftune.training.disable_graphed_layers(model), SFTConfig(cuda_graph_layers=False))")
        t, tb = ctx.tokens, ctx.bucket
        grad = stack.grad
        assert grad is not None
        if grad_out.data_ptr() != grad.data_ptr() or grad_out.shape[1] != t:
            _write(grad[:, :t], grad_out)
            if tb > t:
                grad.data[:, t:tb].zero_()
        if stack.offloads(ctx.index):
            GraphedStack.wait_copy(grad.device, stack.from_host, ctx.index)
        if ctx.index >= 1 and stack.offloads(ctx.index - 1):
            # the layer below's input back into its slot (last read by the backward of the layer RING_SLOTS above
            # that one, queued before this point) while this layer's backward replays
            stack.input_from_host(ctx.index - 1, tb)
        ctx.graphs.backward.replay()
        # the input gradient stays in the static buffer for the layer below (whose backward comes next
        # and reads it in place); the first layer's leaves the graphed stack as a tensor of its own, where
        # its input wants one (the embeddings' output does not with LoRA)
        if not ctx.needs_input_grad[3]:
            grad_x = None
        else:
            grad_x = grad[:, :t] if ctx.index > 0 else grad[:, :t].clone()
        return (None, None, None, grad_x, *_copies(ctx.graphs.param_grads))


def _graphed_forward(self: nn.Module, *args, **kwargs):
    stack_ref, index = getattr(self, _KEYS.layer)
    stack: GraphedStack | None = stack_ref()
    orig = previous_forward(self, _KEYS)
    if not (self.training and torch.is_grad_enabled()):
        return orig(*args, **kwargs)
    if stack is None or stack.layers[index]() is not self:  # a deep copy's layer: checkpointed, not graphed
        drop_cache_arguments(kwargs)
        return checkpoint(partial(orig, **kwargs), *args, use_reentrant=False)
    found = take_layer_input(self, args, kwargs)
    if found is None:
        return orig(*args, **kwargs)
    x, rest = found
    if index == 0:
        if rest:
            stack._fallback("positional layer arguments")
        else:
            stack.begin_step(x, kwargs)
    step = stack.step
    if step is not None and (step.packed is not kwargs.get(PACKED_KWARG) or rest):
        stack._fallback("a layer of the forward saw another layout")
        step = None
    reason = None if step is None else _layer_refuses(self, x, stack)
    if step is None or reason is not None:
        if reason is not None:
            stack._fallback(reason)
        drop_cache_arguments(kwargs)
        return checkpoint(partial(orig, **kwargs), x, *rest, use_reentrant=False)
    graphs = stack.layer_graphs(index, self, orig)
    if graphs is None:
        stack._fallback(stack.broken or "capture failed")
        return checkpoint(partial(orig, **kwargs), x, *rest, use_reentrant=False)
    if index == 0:
        stack.stats["graphed_forwards"] += 1
    return GraphedLayerFunction.apply(stack, index, graphs, x, *graphs.params)


def _layer_refuses(layer: nn.Module, x: torch.Tensor, stack: GraphedStack) -> str | None:
    """Why this layer cannot be graphed this step, or ``None``. Read per forward (cheap attribute
    checks): the parameters' trainability may change between steps."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or getattr(attn, "sinks", None) is not None:
        return "not a plain attention decoder layer (attention sinks or no self_attn)"
    config = getattr(attn, "config", None)
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    if getattr(attn, "sliding_window", None) or getattr(config, "attn_logit_softcapping", None):
        return "a sliding window or soft-capped attention"
    if getattr(layer, "mlp", None) is None or hasattr(layer.mlp, "experts"):
        return "a mixture-of-experts MLP"
    for name, p in layer.named_parameters():
        if p.requires_grad and "lora_" not in name:
            return f"a trainable base parameter ({name}): graphs take LoRA adapters only"
        if hasattr(p, "to_local"):
            return "sharded (DTensor) parameters: FSDP's gathers are not captured"
    for m in layer.modules():
        if isinstance(m, nn.Dropout) and m.p > 0 and m.training:
            return "active dropout"
    if stack.kernel is None:
        stack.kernel = _varlen_kernel(attn, x)
        if stack.kernel is None:
            return "no varlen attention kernel takes this layer"
    return None


def _varlen_kernel(attn: nn.Module, x: torch.Tensor) -> str | None:
    if x.device.type != "cuda":
        return "reference"  # off CUDA: the per-document reference (the closures are not graphs)
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    q = torch.empty(1, heads, attn.head_dim, dtype=dtype, device=x.device)
    k = torch.empty(1, kv_heads, attn.head_dim, dtype=dtype, device=x.device)
    for name in _VARLEN_KERNELS:
        if unsupported_reason(name, q, k, None, None, 0.0) is None:
            return name
    return None


def enable_graphed_layers(model: nn.Module, *, use_cuda_graphs: bool | None = None,
                          min_bucket_tokens: int = MIN_BUCKET_STEP, offload_inputs: bool = False) -> nn.Module:
    """Run every decoder layer of a LoRA model as CUDA graphs in training (see the module doc).

    Args:
        model: a transformers causal LM or a PEFT model wrapping one, patched by swiftune (its packed
            attention gives the layers their layout). Checkpointing is implied: do not also enable
            offloaded checkpointing.
        use_cuda_graphs: ``None`` (default): graphs on CUDA, closures elsewhere; ``False``: closures
            everywhere (the same buffers and node, no capture; for tests and debugging).
        min_bucket_tokens: the smallest step of the token buckets (:func:`token_bucket`); the default keeps
            the kernels' shapes multiples of 256; tests off CUDA pass less to pad their few tokens less.
        offload_inputs: keep the layer inputs in pinned host memory between their forward and backward, with a
            ring of three device buffers (module doc): ``L - 2`` layer inputs fewer on the GPU, at the largest
            bucket so far, for copies that overlap the replays.
    Returns ``model``.
    """
    if isinstance(min_bucket_tokens, bool) or not isinstance(min_bucket_tokens, int) or min_bucket_tokens < 1:
        raise ValueError(f"min_bucket_tokens must be a positive int, got {min_bucket_tokens!r}")
    hf = causal_lm_of(model)
    if is_offloaded_checkpointing(hf):
        raise ValueError("graphed layers replace checkpointing; they do not combine with offloaded checkpointing "
                         "(use_gradient_checkpointing='offload'): use one, or enable_graphed_layers(model, "
                         "offload_inputs=True) for graphed layers with their inputs on the host")
    layers = decoder_layers(hf)
    stack = getattr(hf, _STACK, None)
    if stack is None:
        stack = GraphedStack(hf, layers, use_cuda_graphs)
        setattr(hf, _STACK, stack)
    stack.use_cuda_graphs = use_cuda_graphs
    stack.min_bucket_step = min_bucket_tokens
    if stack.offload_inputs != bool(offload_inputs):  # other buffers: made again, and every graph captured again
        stack.offload_inputs, stack.capacity = bool(offload_inputs), 0
    bind_layer_forwards(layers, _graphed_forward, stack, _KEYS)
    if getattr(hf, "config", None) is not None:
        hf.config.use_cache = False
    return model


def disable_graphed_layers(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_graphed_layers`; the graphs and buffers are freed."""
    hf = causal_lm_of(model)
    unbind_layer_forwards(decoder_layers(hf), _KEYS)
    hf.__dict__.pop(_STACK, None)
    return model


def is_graphed(model: nn.Module) -> bool:
    return getattr(causal_lm_of(model), _STACK, None) is not None


def graphed_layer_stats(model: nn.Module) -> dict[str, Any]:
    """Counters: graphed and fallback forwards, captures, the last fallback's reason, the buffers' capacity,
    the bytes of the static parameter-gradient buffers (one set for the layers of one shape, whatever the
    buckets) and of the host buffers of the offloaded layer inputs."""
    stack: GraphedStack | None = getattr(causal_lm_of(model), _STACK, None)
    if stack is None:
        return {}
    # the distinct buffers the kept graphs write (a set per layer and graph, were they not shared)
    buffers = {b.data_ptr(): b for graphs in stack.graphs.values() for b in graphs.param_grads}
    grad_bytes = sum(b.numel() * b.element_size() for b in buffers.values())
    host_bytes = sum(b.numel() * b.element_size() for b in stack.host)
    return {**stack.stats, "capacity_tokens": stack.capacity, "graph_sets": len(stack.graphs),
            "gradient_buffer_bytes": grad_bytes, "host_input_bytes": host_bytes}
