"""Gradient checkpointing whose saved layer inputs go to pinned CPU memory (``"offload"``).

Plain checkpointing keeps one tensor per decoder layer alive from forward to backward: the
layer's input, ``T x H`` elements.  For a Qwen3-8B shape that is ``36 x 4096 x 2 B = 288 KB`` per
token, 118 GB at 400K tokens: more than what is left of an H200 beside the weights and one
layer's recompute.  This module keeps as many of those inputs on the GPU as a budget allows and
moves the others to pinned host memory while the forward runs, bringing each back just before
backward needs it. The budgets and the pool of pinned pages are in :mod:`.offload_memory`.

Design
------
Each decoder layer *instance* gets a ``forward`` that calls PyTorch's non-reentrant
``torch.utils.checkpoint.checkpoint`` on the layer's own forward, with one twist: the layer input
is not handed to ``checkpoint`` as a tensor but wrapped in a :class:`LayerInput` handle, and the
checkpointed function asks the handle for it.  Non-reentrant checkpointing keeps the *arguments*
of the function alive for the recompute and replaces every tensor saved inside the layer with a
placeholder; gradients still reach the input through the original graph.  So the handle alone
decides where the one surviving tensor lives:

* first forward: the handle returns the live GPU tensor (graph-connected); for an offloaded layer
  it has already queued a device-to-host copy on a side CUDA stream (the stream waits for the
  compute stream, the tensor is ``record_stream``-ed on the side stream so the allocator cannot
  reuse it before the copy is done) into pinned pages, and drops its reference when the forward
  returns: the GPU memory goes back to the allocator as soon as the copy finishes;
* recompute in backward (``checkpoint`` calls the function again): the handle returns the tensor
  restored from host memory, detached, with the original ``requires_grad``.  The copy was
  usually started one layer earlier: when layer ``i``'s input is asked for, the handle of layer
  ``i - 1`` starts its host-to-device copy on the side stream (prefetch), and layer ``i - 1``'s
  recompute waits on that copy's CUDA event, not on the host.

Everything else (RNG state for dropout, autocast, keyword arguments such as
``position_embeddings``/``attention_mask``/``position_ids``, LoRA or full fine-tuning) is
``checkpoint``'s own, unmodified behaviour; no private PyTorch or transformers API is used.  The
previous forward of the instance (or the class's) is what runs inside, and transformers' own
per-layer checkpointing flag is switched off on the instance so a layer is never checkpointed
twice.

Which layers stay on the GPU
----------------------------
With ``B = tokens x hidden x dtype_bytes`` per layer and a GPU budget ``G`` for checkpoints, the
number kept is ``K = min(L, floor(G / B))`` and the *first* ``L - K`` layers are offloaded
(:func:`split_layers`): their copies overlap the forward of the layers after them, and backward
reaches them last, so the kept layers run their backward with no transfer at all and the first
restore overlaps the backward of the lowest kept layer.  Offloaded layers need
``ceil(B / page) x page`` bytes of pinned host memory each; when ``(L - K) x that > host budget``
the missing ones are *derived* (layers 1, 3, 5, ...: no input stored; backward recomputes it by
running the layer before once more, without grad, under that layer's replayed RNG and autocast
state, from its stored input, :meth:`OffloadState.derive_input`), at most every second layer;
never a layer whose input transformers changes between the layers (an unpatched Qwen3-VL's
deepstack features, :func:`inputs_set_between_layers`: a rerun of the layer before would miss
them), the derived ones moved to later layers instead (:func:`plan_avoiding_inputs`);
beyond that a :class:`CheckpointBudgetError` is raised at the first layer of the forward, before
anything is allocated: a clear error instead of a hang or the OOM killer.

Budgets: ``gpu_budget_bytes=None`` on CUDA is measured at the first layer of every forward: free
GPU memory (within the process's memory fraction) minus what the rest of the step needs
(:func:`swiftune.memory.step_reserve`: one layer's recompute and backward, the loss, two transfer
buffers, gradients still to be allocated) and a margin of 5% of what the process may use + 1 GiB.
``host_budget_bytes=None`` is ``MemAvailable`` (psutil or ``/proc/meminfo``) minus
``max(4 GiB, 10% of MemTotal)``, divided among the ranks of this host
(``LOCAL_WORLD_SIZE``: each pins its own pages), plus the pinned pages already held; an explicit
budget is capped by the same figure.

Pinned pages: host buffers are fixed-size pages (64 MiB, or the next power of two of a small
layer), a layer's bytes spread over as many as it needs.  PyTorch's pinned allocator rounds each
allocation up to a power of two; pages that are already powers of two waste nothing, and the
pool keeps them across steps (pinning is slow), so steady-state steps allocate no host memory.

On CPU tensors (tests, CPU training) the same code runs with synchronous copies into ordinary
CPU pages; with no explicit budget every layer stays "on the device", i.e. plain checkpointing.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..attention.backends import planner_attention_terms
from ..attention.kept_outputs import (apart_from_kept_attention_outputs, attention_outputs_context,
                                      attention_outputs_in, check_attention_output_layers)
from ..losses.chunking import free_gpu_bytes, gpu_capacity_bytes
from ..memory import model_shape, step_reserve
from ..memory.planner import (PAGE_BYTES, TrainSetup, attention_layers_on_host, attention_output_bytes,
                              attention_output_device_layers, attention_output_host_bytes, choose_page_bytes,
                              offload_margin_bytes)
from ..models.families import decoder_layers_whose_mlp_feeds_only_the_residual
from ..models.patching import attention_is_plain, causal_lm_of
from ..models.qwen3_vl import adds_its_own_deepstack
from ..models.tiled_mlp import ForwardState, has_tiled_forward, is_tiled, recompute_output_unused
from .layer_forwards import LayerForwardKeys, bind_layer_forwards, drop_cache_arguments, \
    previous_forward, take_layer_input, unbind_layer_forwards
from .host_attention_outputs import HostAttentionOutputs
from .lora_casting import lora_inputs_cast
from .model_walks import ModelWalkIndex
from .offload_memory import CheckpointBudgetError, HostCopy, OffloadPlan, PagePool, host_available_bytes, split_layers

logger = logging.getLogger(__name__)

_STATE = "_swiftune_offload_state"  # on the transformers model: the OffloadState
# on each decoder layer: (state, index), the instance's forward before ours, transformers' flag before ours
_KEYS = LayerForwardKeys("_swiftune_offload_layer", "_swiftune_offload_orig_forward", "_swiftune_offload_prev_gc")


# ------------------------------------------------------------------------------ layer inputs


class LayerInput:
    """Where one checkpointed layer's input lives between forward and backward.

    ``materialize()`` is what the checkpointed function calls: the live tensor during the first
    forward, then the kept (GPU) or restored (host -> GPU) copy during the recompute.
    """

    def __init__(self, state: "OffloadState", index: int, generation: int, x: torch.Tensor, offload: bool,
                 derived: bool = False) -> None:
        self.index, self.generation = index, generation
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.requires_grad = x.requires_grad
        self.offloaded = offload
        self.derived = derived  # stored nowhere: recomputed from the layer before (OffloadState.derive_input)
        # RNG / autocast state of the first forward (which starts right after this), replayed by the
        # recompute. Not left to torch's checkpoint: it saves the RNG state of the devices of its
        # tensor arguments, and this handle is not a tensor, so a CUDA dropout mask would differ.
        self.forward_state = ForwardState(x.device, with_rng=True)
        # set on the layer before a derived one: its forward with the other arguments bound, to
        # recompute the derived input without grad (under ``forward_state``)
        self.rerun: Any = None
        self._state = state  # strong: backward must find its pages even if offloading was disabled since
        self._live: torch.Tensor | None = x
        self._kept: torch.Tensor | None = None if offload or derived else x.detach()
        self._gpu: torch.Tensor | None = None  # prefetched / restored copy
        self._event: Any = None
        self._copy: HostCopy | None = None
        # this layer call's sdpa outputs in host pages (OffloadState.keeps_attention_output_on_host), else None
        self.attention_outputs: HostAttentionOutputs | None = None
        if offload:
            self._offload(state, x)

    # -- transfers
    def _offload(self, state: "OffloadState", x: torch.Tensor) -> None:
        self._copy = HostCopy(state.pool, x, state.page_bytes, state.side_stream(x.device))

    def prefetch(self) -> None:
        """Start the host -> GPU copy (side stream) unless it is on the GPU already; the layer's attention
        outputs kept on the host too, when it keeps them there."""
        if self.attention_outputs is not None:
            self.attention_outputs.prefetch()
        if not self.offloaded or self._gpu is not None or self._live is not None:
            return
        self._gpu, self._event = self._copy.restore(self._state.side_stream(self.device))
        self._state.stats["restored"] += 1

    def peek(self) -> torch.Tensor:
        """The stored input (restored from the host if offloaded), left in place for this layer's
        own recompute, which comes next in backward: what a derived input is recomputed from."""
        if self._kept is not None:
            return self._kept
        if self.derived:
            raise RuntimeError(f"layer {self.index}'s input is derived, not stored")
        self.prefetch()
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._event = None
        assert self._gpu is not None
        return self._gpu

    @property
    def in_recompute(self) -> bool:
        """True once the first forward is done: a call now is checkpointing's recompute."""
        return self._live is None

    def materialize(self) -> torch.Tensor:
        if self._live is not None:  # the first forward
            return self._live
        if self.derived:
            out = self._state.derive_input(self.generation, self.index)
        elif self._kept is not None:
            out = self._kept
        else:
            self.prefetch()  # no-op when prefetched
            if self._event is not None:
                torch.cuda.current_stream(self.device).wait_event(self._event)
                self._event = None
            out, self._gpu = self._gpu, None  # autograd owns it now; freed with the layer's graph
        self._state.prefetch_before(self.generation, self.index)
        return out.detach().requires_grad_(self.requires_grad)

    def forward_done(self) -> None:
        self._live = None


# ------------------------------------------------------------------------------------- state


class OffloadState:
    """Budgets, page pool, side streams and the current plan of one model."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], gpu_budget_bytes: int | None,
                 host_budget_bytes: int | None, page_bytes: int, host_margin_bytes: int | None) -> None:
        self.model_ref = weakref.ref(model)
        self.config = getattr(model, "config", None)
        self._shape: Any = None  # the planner's ModelShape of config, read once
        self.num_layers = len(layers)
        self.gpu_budget_bytes = gpu_budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.page_bytes = page_bytes
        self.host_margin_bytes = host_margin_bytes
        self.pool = PagePool(pin=torch.cuda.is_available())
        self._streams: dict[int, Any] = {}
        self.generation = 0
        self.plan: OffloadPlan | None = None
        self._plan_key: tuple | None = None
        self._handles: dict[tuple[int, int], weakref.ref] = {}
        self.stats = {"offloaded": 0, "kept": 0, "derived_inputs": 0, "restored": 0, "derived_recomputed": 0}
        # layers whose input is never derived (inputs_set_between_layers); set by enable_offloaded_checkpointing
        self.underivable: frozenset[int] = frozenset()
        # the last this many layers keep their sdpa attention outputs through the recompute (attention.kept_outputs)
        self.attention_output_layers = 0
        # ... in pinned host memory (host_attention_outputs) instead of on the GPU; those of this plan that do
        self.attention_outputs_on_host = False
        self.host_attention_layers: frozenset[int] = frozenset()
        self._attention_shortfall: tuple | None = None  # the last (layers on host, input shape) warned of
        # the model's parameters, found once (again on a new adapter set; requires_grad read per call):
        # the GPU budget of every forward reads them, and a walk of the module tree per forward is host time
        self.walks = ModelWalkIndex()

    def side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = torch.cuda.Stream(device=idx)
        return self._streams[idx]

    # -- budgets
    def host_budget(self) -> int:
        avail = self.pool.free_bytes + host_available_bytes(self.host_margin_bytes)
        if self.host_budget_bytes is not None:
            avail = min(avail, self.host_budget_bytes - self.pool.in_use_bytes)
        return max(0, avail)

    def gpu_budget(self, x: torch.Tensor, attention_kernel: str | None = None,
                   max_doc_tokens: int | None = None) -> int:
        if self.gpu_budget_bytes is not None:
            return int(self.gpu_budget_bytes)
        if x.device.type != "cuda":
            return 2**62  # CPU: everything stays, i.e. plain checkpointing
        total = gpu_capacity_bytes(x.device)  # the margin scales with what this process may use
        reserve = self._reserve(x, attention_kernel, max_doc_tokens) + self.kept_attention_bytes(x)
        return max(0, free_gpu_bytes(x.device) - reserve - offload_margin_bytes(total))

    def keeps_attention_output(self, index: int) -> bool:
        """Whether layer ``index`` keeps its attention outputs on the device through its recompute (the last
        ``attention_output_layers`` layers, unless they keep them on the host)."""
        return not self.attention_outputs_on_host and index >= self.num_layers - self.attention_output_layers

    def keeps_attention_output_on_host(self, index: int) -> bool:
        """Whether layer ``index`` keeps its attention outputs in host memory through its recompute (those of
        the last ``attention_output_layers`` for which the plan found host room)."""
        return index in self.host_attention_layers

    def _attention_shape(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        """``(heads, head_dim, tokens, activation bytes)`` of the attention outputs of a forward of input ``x``."""
        if self._shape is None:
            self._shape = _planner_shape(self.config)
        autocast = torch.is_autocast_enabled(x.device.type)
        act_bytes = (torch.get_autocast_dtype(x.device.type) if autocast else x.dtype).itemsize
        return self._shape.heads, self._shape.head_dim, x.numel() // x.shape[-1], act_bytes

    def kept_attention_bytes(self, x: torch.Tensor) -> int:
        """Device bytes the kept attention outputs of one forward of input ``x`` take at once, all layers
        together: every keeping layer's on the device, two layers' (restored and prefetched) from the host."""
        if not self.attention_output_layers:
            return 0
        layers = attention_output_device_layers(self.attention_output_layers, self.attention_outputs_on_host)
        return layers * attention_output_bytes(*self._attention_shape(x))

    def _plan_host_attention_layers(self, x: torch.Tensor, plan: OffloadPlan) -> frozenset[int]:
        """The last layers whose attention outputs the host memory left beside this plan's inputs holds."""
        if not (self.attention_outputs_on_host and self.attention_output_layers):
            return frozenset()
        layer_host = attention_output_host_bytes(*self._attention_shape(x), page_bytes=self.page_bytes)
        room = self.host_budget() - plan.host_bytes
        n = attention_layers_on_host(self.attention_output_layers, room, layer_host)
        if n < self.attention_output_layers and (n, x.shape) != self._attention_shortfall:
            self._attention_shortfall = (n, x.shape)  # said once per shortfall, not every step
            logger.warning("swiftune offloaded checkpointing: host memory holds the attention outputs of %d of the "
                           "%d layers asked to keep them (%.2f GB a layer, %.2f GB left beside the offloaded layer "
                           "inputs); the other %d recompute their attention. Give more host memory "
                           "(offload_host_budget_bytes) or keep fewer layers.", n, self.attention_output_layers,
                           layer_host / 1e9, max(0, room) / 1e9, self.attention_output_layers - n)
        return frozenset(range(self.num_layers - n, self.num_layers))

    def _reserve(self, x: torch.Tensor, attention_kernel: str | None = None, max_doc_tokens: int | None = None) -> int:
        """GPU bytes the rest of the step needs (the planner's formulas).
        ``attention_kernel``: the kernel this forward's attention runs, when it says (``"flex"``,
        ``"sdpa"``); ``max_doc_tokens``: its longest document, when it says (per-document sdpa
        holds a float32 dq for one document at a time)."""
        tokens = x.numel() // x.shape[-1]
        model = self.model_ref()
        if self._shape is None:
            self._shape = _planner_shape(self.config)
        return step_reserve(self._shape, tokens, _setup_of(model, x, attention_kernel, max_doc_tokens, self.walks),
                            self.pending_grad_bytes(x.device))

    def pending_grad_bytes(self, device: torch.device) -> int:
        """Bytes of the gradients this rank has still to allocate on ``device``: its trainable
        parameters without a ``.grad`` yet. Under FSDP2 a parameter is a DTensor whose ``numel()`` is
        the whole tensor's, but the rank allocates only its shard's gradient: the local shard counts."""
        model = self.model_ref()
        if model is None:
            return 0
        pending = 0
        for p in self.walks.trainable(model):
            if p.grad is None and p.device == device:
                local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor shard (FSDP2): this rank's part
                pending += local.numel() * local.element_size()
        return pending

    # -- per forward
    def layer_input(self, index: int, x: torch.Tensor, attention_kernel: str | None = None,
                    max_doc_tokens: int | None = None) -> LayerInput:
        key = (tuple(x.shape), x.dtype, x.device, attention_kernel, max_doc_tokens)
        if index == 0 or self.plan is None or key != self._plan_key:
            self.generation += 1
            layer_bytes = x.numel() * x.element_size()
            plan = split_layers(self.num_layers, layer_bytes, self.gpu_budget(x, attention_kernel, max_doc_tokens),
                                self.host_budget(), self.page_bytes)
            self.plan = plan_avoiding_inputs(plan, self.underivable)
            self.host_attention_layers = self._plan_host_attention_layers(x, self.plan)
            self._plan_key = key
            self._handles = {k: v for k, v in self._handles.items() if v() is not None}
        offload, derived = index in self.plan.offload, index in self.plan.derived
        handle = LayerInput(self, index, self.generation, x, offload, derived)
        self._handles[(self.generation, index)] = weakref.ref(handle)
        self.stats["derived_inputs" if derived else "offloaded" if offload else "kept"] += 1
        return handle

    def derives_next(self, index: int) -> bool:
        return self.plan is not None and index + 1 in self.plan.derived

    def derive_input(self, generation: int, index: int) -> torch.Tensor:
        """Layer ``index``'s input, recomputed in backward: the layer before runs its forward again
        (no grad; the RNG and autocast state of its first forward) on its own stored input."""
        ref = self._handles.get((generation, index - 1))
        source = ref() if ref is not None else None
        if source is None or source.rerun is None:
            raise RuntimeError(
                f"swiftune offloaded checkpointing: layer {index}'s input was not stored and the layer before it "
                "can no longer recompute it (a second backward through the same graph needs retain_graph=True)")
        x_prev = source.peek()
        with torch.no_grad(), source.forward_state.replay():
            out = source.rerun(x_prev)
        self.stats["derived_recomputed"] += 1
        return out[0] if isinstance(out, tuple) else out

    def prefetch_before(self, generation: int, index: int) -> None:
        """Backward is about to recompute layer ``index``: start bringing back ``index - 1`` (or, when
        that one's input is derived, ``index - 2``, which it is recomputed from)."""
        ref = self._handles.get((generation, index - 1))
        handle = ref() if ref is not None else None
        if handle is not None and handle.derived:
            ref = self._handles.get((generation, index - 2))
            handle = ref() if ref is not None else None
        if handle is not None:
            handle.prefetch()


def _deepstack_feature_count(config: Any) -> int:
    """How many deepstack feature sets a vision-language config adds to its text decoder
    (``deepstack_visual_indexes`` of Qwen3-VL's vision config, dense and MoE), looked for through
    the config's sub-configs; 0 for any other model."""
    pending = [config]
    while pending:
        sub = pending.pop()
        if sub is None:
            continue
        indexes = getattr(sub, "deepstack_visual_indexes", None)
        if indexes:
            return len(indexes)
        pending.extend(getattr(sub, name, None) for name in (getattr(sub, "sub_configs", None) or {}))
    return 0


def inputs_set_between_layers(model: nn.Module, layers: list[nn.Module]) -> frozenset[int]:
    """Indices of the decoder layers whose input is not the output of the layer before: what a rerun
    of that layer cannot rebuild, so offloaded checkpointing never derives it.

    transformers' Qwen3-VL text model (dense and MoE) adds deepstack feature set ``i`` to the output
    of layer ``i`` in its own layer loop, after the layer returns, for each ``i`` below the number of
    sets: the inputs of layers ``1 .. n`` are the layer before's output *plus* visual features. A layer
    patched to add its own features (:func:`swiftune.models.qwen3_vl.install_deepstack_in_layers`,
    which ``patch_model`` runs) maps its input to the next layer's again, and does not count."""
    count = min(_deepstack_feature_count(getattr(model, "config", None)), len(layers) - 1)
    return frozenset(i for i in range(1, count + 1) if not adds_its_own_deepstack(layers[i - 1]))


def plan_avoiding_inputs(plan: OffloadPlan, underivable: frozenset[int]) -> OffloadPlan:
    """``plan`` with its derived layers moved off ``underivable`` (:func:`inputs_set_between_layers`):
    as many derived inputs, each at the lowest layer that is not underivable and follows a stored
    one (never two derived in a row), the other layers offloaded and kept as ``plan`` counts them.
    Raises :class:`CheckpointBudgetError` when the other layers leave too few to derive."""
    if not underivable.intersection(plan.derived):
        return plan
    derived: list[int] = []
    for index in range(1, plan.num_layers):
        if len(derived) == len(plan.derived):
            break
        if index not in underivable and (not derived or derived[-1] != index - 1):
            derived.append(index)
    if len(derived) < len(plan.derived):
        raise CheckpointBudgetError(
            f"swiftune offloaded checkpointing: the host memory holds only {len(plan.offload)} of the "
            f"{len(plan.offload) + len(plan.derived)} offloaded layer inputs, and the other "
            f"{len(plan.derived)} would be recomputed in backward by rerunning the layer before; but the "
            f"inputs of layers {sorted(underivable)} are that layer's output plus features transformers adds "
            "between the layers (Qwen3-VL's deepstack visual features), which a rerun would miss, and the "
            f"remaining layers allow only {len(derived)} such recomputes. Patch the model before enabling the "
            "checkpointing (swiftune.patch_model, or FastModel.from_pretrained: the patched layers add their own "
            "features, so any input can be recomputed), or use fewer tokens per step or a larger "
            "host_budget_bytes / gpu_budget_bytes.")
    chosen = set(derived)
    stored = [i for i in range(plan.num_layers) if i not in chosen]
    offloaded = len(plan.offload)
    return replace(plan, offload=tuple(stored[:offloaded]), keep=tuple(stored[offloaded:]), derived=tuple(derived))


def _planner_shape(config: Any) -> Any:
    """The planner's ModelShape of ``config``; a config it cannot read is an error that says how
    to size the budget without it, since a guessed reserve would run out of memory or waste it."""
    try:
        return model_shape(config)
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"swiftune offloaded checkpointing: cannot size the GPU memory the rest of the step needs from "
            f"this model's config ({type(config).__name__}: {e}); the memory planner reads hidden_size, "
            "intermediate_size, num_hidden_layers, num_attention_heads and vocab_size. Pass an explicit GPU "
            "budget: enable_offloaded_checkpointing(model, gpu_budget_bytes=...) or "
            "FastModel.get_peft_model(..., offload_gpu_budget_bytes=...)"
        ) from e


def _setup_of(model: nn.Module | None, x: torch.Tensor, attention_kernel: str | None = None,
              max_doc_tokens: int | None = None, walks: ModelWalkIndex | None = None):
    """The planner's TrainSetup as far as the model and the step tell: LoRA rank/dtype, tiling,
    full FT, autocast, and the attention kernel's memory (``planner_attention_terms``): K/V
    expanded to the query heads (torch's varlen without GQA) and a float32 dq accumulator (flash)
    by default; flex has neither; per-document sdpa keeps the K/V heads and holds the float32 dq
    of its longest document (``max_doc_tokens``) only. ``walks``: where the parameters and the
    answers found by walking the model are kept, asked at every forward (``None``: the model is walked)."""
    rank, lora_bytes, full, casts = 0, 4, False, True
    if model is not None:
        named = walks.named_parameters(model) if walks is not None else model.named_parameters()
        for name, p in named:
            if "lora_A" in name and p.dim() == 2:
                rank, lora_bytes = p.shape[0], p.element_size()
                break
        else:
            full = bool(walks.trainable(model)) if walks is not None else any(p.requires_grad
                                                                              for p in model.parameters())
        if rank:  # PEFT's per-layer input cast, switched off by the trainers (training.lora_casting)
            casts = lora_inputs_cast(model, walks)
    if attention_kernel == "sdpa" and not _every_layer_runs_sdpa(model, x, walks):
        attention_kernel = None  # planned as varlen: some layer (or the dtype) takes another kernel
    tiled = walks.is_tiled if walks is not None else is_tiled  # kept: asked at every forward
    return TrainSetup(
        lora_rank=rank, full_finetune=full, dtype_bytes=x.element_size(), lora_dtype_bytes=lora_bytes,
        tiled_mlp=model is not None and tiled(model),
        tiled_projections=model is not None and tiled(model, projections=True),
        autocast=torch.is_autocast_enabled(x.device.type), lora_input_casts=casts,
        **planner_attention_terms(attention_kernel, max_doc_tokens),
    )


def _every_layer_runs_sdpa(model: nn.Module | None, x: torch.Tensor, walks: ModelWalkIndex | None = None) -> bool:
    """Whether the layout's ``"sdpa"`` holds for every layer: patched attention without sliding
    windows, soft-caps or sinks (:func:`~swiftune.models.patching.attention_is_plain`), in a half
    precision (directly or under autocast; in float32 the fused kernels may refuse grouped K/V
    heads and the retry expands them). ``walks``: where that answer is kept (``None``: the model is walked)."""
    half = x.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(x.device.type)
    if model is None or not half:
        return False
    return walks.attention_is_plain(model) if walks is not None else attention_is_plain(model)


# ------------------------------------------------------------------------------ the wrapper


#: An object passed to the decoder layers as a keyword argument (GRPO's ``RowLayout``, the packed
#: ``PackedBatch``) may name, through this attribute, the attention kernel this forward runs.
#: ``"flex"``: K and V keep their own head count (GQA in the kernel, not expanded to the query
#: heads) and the backward writes dq in the activation dtype (no float32 accumulator); ``"sdpa"``
#: (per-document sdpa): K and V keep their head count; so the GPU budget reserves that much less
#: for the layer being recomputed (``attention.backends.planner_attention_terms``). Anything
#: else: the planner's defaults.
ATTENTION_KERNEL_ATTR = "attention_kernel"
#: ... and, through this one, its longest document in tokens (``PackedBatch.max_seqlen``; GRPO's
#: ``RowLayout.max_seqlen``: the longest prompt + completion one sdpa call covers).
MAX_DOC_TOKENS_ATTR = "max_seqlen"


def _attention_hint(kwargs: dict) -> tuple[str | None, int | None]:
    """(kernel, longest document) named by a keyword argument of the layer, or (None, None)."""
    for value in kwargs.values():
        kernel = getattr(value, ATTENTION_KERNEL_ATTR, None)
        if isinstance(kernel, str):
            longest = getattr(value, MAX_DOC_TOKENS_ATTR, None)
            return kernel, (int(longest) if isinstance(longest, int) else None)
    return None, None


#: Decoder layers whose MLP output only feeds the residual add (nothing after the MLP saves a
#: tensor), so a recompute may skip computing a tiled MLP's output (``recompute_output_unused``).
#: Read from the family records (``Family.mlp_output_feeds_only_residual``): Gemma's
#: post-feed-forward norm, for one, saves the MLP output.
MLP_OUTPUT_FEEDS_ONLY_THE_RESIDUAL = decoder_layers_whose_mlp_feeds_only_the_residual()


def _mlp_to_skip_in_recompute(layer: nn.Module) -> nn.Module | None:
    mlp = getattr(layer, "mlp", None)
    if type(layer).__name__ in MLP_OUTPUT_FEEDS_ONLY_THE_RESIDUAL and mlp is not None and has_tiled_forward(mlp):
        return mlp
    return None


def _run_layer(orig, mlp_to_skip: nn.Module | None, handle: LayerInput, *args, **kwargs):
    recompute = handle.in_recompute
    with apart_from_kept_attention_outputs():  # a derived input reruns the layer before: not this layer's attention
        x = handle.materialize()  # a derived input is recomputed under its own layer's replayed state
    replay = handle.forward_state.replay() if recompute else nullcontext()
    with replay, recompute_output_unused(mlp_to_skip if recompute else None):
        return orig(x, *args, **kwargs)


def _run_on(orig, rest: tuple, kwargs: dict, x: torch.Tensor):
    return orig(x, *rest, **kwargs)


def _offloaded_forward(self: nn.Module, *args, **kwargs):
    state_ref, index = getattr(self, _KEYS.layer)
    state: OffloadState | None = state_ref()
    orig = previous_forward(self, _KEYS)
    if state is None or not (self.training and torch.is_grad_enabled()):
        return orig(*args, **kwargs)
    found = take_layer_input(self, args, kwargs)
    if found is None:
        return orig(*args, **kwargs)
    x, rest = found
    drop_cache_arguments(kwargs)
    handle = state.layer_input(index, x, *_attention_hint(kwargs))
    if state.derives_next(index):  # the next layer's input will be recomputed from this one's
        handle.rerun = partial(_run_on, orig, rest, kwargs)
    try:
        if state.keeps_attention_output_on_host(index):
            handle.attention_outputs = HostAttentionOutputs(state.pool, state.page_bytes, state.side_stream(x.device))
            context_fn = partial(attention_outputs_in, handle.attention_outputs)
        elif state.keeps_attention_output(index):
            context_fn = attention_outputs_context
        else:
            context_fn = noop_context_fn
        return checkpoint(partial(_run_layer, orig, _mlp_to_skip_in_recompute(self), **kwargs), handle, *rest,
                          use_reentrant=False, preserve_rng_state=False, context_fn=context_fn)
    finally:
        handle.forward_done()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM (``model.get_decoder().layers``, PEFT unwrapped)."""
    hf = causal_lm_of(model)
    decoder = hf.get_decoder() if callable(getattr(hf, "get_decoder", None)) else getattr(hf, "model", hf)
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return list(layers)
    # other layouts: transformers' checkpointable blocks, outermost only
    found = [m for m in hf.modules() if isinstance(m, GradientCheckpointingLayer)]
    inner = {id(c) for m in found for c in m.modules() if c is not m}
    found = [m for m in found if id(m) not in inner]
    if found:
        return found
    raise ValueError(f"{type(hf).__name__}: no decoder layers found (expected get_decoder().layers)")


def enable_offloaded_checkpointing(
    model: nn.Module,
    gpu_budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    *,
    page_bytes: int = PAGE_BYTES,
    host_margin_bytes: int | None = None,
    attention_output_layers: int = 0,
    attention_outputs_on_host: bool = False,
) -> nn.Module:
    """Checkpoint every decoder layer, keeping the inputs that do not fit ``gpu_budget_bytes`` in
    pinned host memory (``use_gradient_checkpointing="offload"``).

    Args:
        model: a transformers causal LM or a PEFT model wrapping one (LoRA or full fine-tuning;
            patched or not).  Enable before or after ``get_peft_model``: PEFT keeps the layers.
        gpu_budget_bytes: GPU bytes the kept layer inputs may use; ``None``: measured from free
            memory at the first layer of each forward (CUDA), everything kept (CPU).  ``0``:
            offload every layer.
        host_budget_bytes: cap on the pinned host memory for offloaded inputs; ``None``: what the
            machine has available (``MemAvailable`` minus a margin).
        page_bytes: host page size (a power of two).
        host_margin_bytes: host memory to leave free (default ``max(4 GiB, 10% of MemTotal)``).
        attention_output_layers: the last this many decoder layers keep the outputs of their fused sdpa
            attention kernels on the device from the forward to their backward, and the recompute
            takes them instead of running the kernel again (:mod:`swiftune.attention.kept_outputs`): for long
            sequences most of a recompute's time, for ``T x Hq x (D x 2 + 4)`` bytes a layer (bf16),
            which an automatic GPU budget sets aside before it keeps layer inputs. ``0`` (default):
            every layer recomputes its attention. Other attention kernels are recomputed either way.
        attention_outputs_on_host: keep those outputs in pinned host memory instead
            (:mod:`.host_attention_outputs`): copied there during the forward and back one layer ahead in
            the backward, on the side stream, so the GPU holds two layers' at a time. The host budget holds
            the offloaded layer inputs first; layers whose outputs it has no room for recompute their attention.

    Returns ``model``; calling again updates the budgets.
    """
    if page_bytes < 1 or page_bytes & (page_bytes - 1):
        raise ValueError(f"page_bytes must be a power of two, got {page_bytes}")
    hf = causal_lm_of(model)
    layers = decoder_layers(hf)
    attention_output_layers = check_attention_output_layers(attention_output_layers, len(layers))
    if not isinstance(attention_outputs_on_host, bool):
        raise ValueError(f"attention_outputs_on_host must be True or False, got {attention_outputs_on_host!r}")
    if attention_outputs_on_host and not attention_output_layers:
        raise ValueError("attention_outputs_on_host=True says where kept attention outputs go: also pass "
                         "attention_output_layers=n (the last n decoder layers keep them)")
    state = getattr(hf, _STATE, None)
    if state is None:
        state = OffloadState(hf, layers, gpu_budget_bytes, host_budget_bytes, page_bytes, host_margin_bytes)
        setattr(hf, _STATE, state)
    else:
        state.gpu_budget_bytes, state.host_budget_bytes = gpu_budget_bytes, host_budget_bytes
        state.page_bytes, state.host_margin_bytes = page_bytes, host_margin_bytes
        state.walks.clear()  # the model may have changed since (parameters added by hand are seen again)
    state.underivable = inputs_set_between_layers(hf, layers)
    state.attention_output_layers = attention_output_layers
    state.attention_outputs_on_host = attention_outputs_on_host
    state.plan = None  # planned again at the next forward, with the new settings
    bind_layer_forwards(layers, _offloaded_forward, state, _KEYS)
    if getattr(hf, "config", None) is not None:
        hf.config.use_cache = False  # a KV cache is useless in training and conflicts with recompute
    hf._swiftune_offload_checkpointing = True
    return model


def disable_offloaded_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_offloaded_checkpointing`: the layers' previous forwards and transformers'
    checkpointing flags come back; the free pinned pages are released."""
    hf = causal_lm_of(model)
    unbind_layer_forwards(decoder_layers(hf), _KEYS)
    state = hf.__dict__.pop(_STATE, None)
    if state is not None:
        state.pool.clear()
    hf._swiftune_offload_checkpointing = False
    return model


def offload_stats(model: nn.Module) -> dict[str, Any]:
    """The last plan and counters: kept / offloaded layer indices, bytes per layer, pinned bytes."""
    state: OffloadState | None = getattr(causal_lm_of(model), _STATE, None)
    if state is None:
        return {}
    plan = state.plan
    return {
        "keep": plan.keep if plan else (),
        "offload": plan.offload if plan else (),
        "derived": plan.derived if plan else (),
        "layer_bytes": plan.layer_bytes if plan else 0,
        "host_pinned_bytes": state.pool.held_bytes,
        "host_in_use_bytes": state.pool.in_use_bytes,
        "host_alloc_seconds": state.pool.alloc_seconds,
        "attention_output_layers": state.attention_output_layers,
        "attention_outputs_on_host": state.attention_outputs_on_host,
        "attention_output_layers_on_host": len(state.host_attention_layers),
        **state.stats,
    }


def is_offloaded_checkpointing(model: nn.Module) -> bool:
    return getattr(causal_lm_of(model), _STATE, None) is not None


def release_host_memory(model: nn.Module) -> None:
    """Free the pinned pages the model's offloading keeps for the next step."""
    state: OffloadState | None = getattr(causal_lm_of(model), _STATE, None)
    if state is not None:
        state.pool.clear()


__all__ = [
    "PAGE_BYTES",
    "CheckpointBudgetError",
    "LayerInput",
    "OffloadPlan",
    "choose_page_bytes",
    "decoder_layers",
    "disable_offloaded_checkpointing",
    "enable_offloaded_checkpointing",
    "host_available_bytes",
    "inputs_set_between_layers",
    "is_offloaded_checkpointing",
    "offload_stats",
    "plan_avoiding_inputs",
    "release_host_memory",
    "split_layers",
]
