"""Qwen3-VL (dense): swiftune's kernels and packed attention on the language model.

``Qwen3VLForConditionalGeneration`` is a vision tower (``model.visual``) feeding a Qwen3-style
text decoder (``model.language_model``, modules ``Qwen3VLText*``). :func:`swiftune.patch_model`
treats it like this:

* the text decoder's attention, gated MLPs and RMSNorms (the q/k norms too) get the fused
  forwards of every family (:mod:`swiftune.models.forwards`). RoPE: the decoder's own rotary
  module computes the interleaved multimodal (M-RoPE) tables from the 3-D ``position_ids``
  (temporal / height / width; the three are equal on text tokens) and the fused kernel rotates q
  and k with those tables, which is exactly transformers' ``apply_rotary_pos_emb``;
* the text config's attention implementation becomes ``"swiftune_packed"``; the vision config
  keeps its own (the vision tower already runs each image alone, over its own ``cu_seqlens``;
  ``"eager"``, which FastModel loads with, becomes transformers' ``"sdpa"``), so the vision tower
  is transformers' code unchanged;
* a forward pre-hook on ``Qwen3VLModel`` (:class:`VisionLanguagePackedHook`) builds the packed
  layout once per forward, before the vision tower and the decoder run.

Where the documents of a padding-free or packed row come from: M-RoPE positions do not restart
at documents (they do restart, but image tokens make each channel jump and repeat inside one
example), so no position rule can find the boundaries. Multimodal rows therefore carry
``document_ids`` (``[B, S]``, one label per document; :mod:`swiftune.data.multimodal` makes them),
which the hook pops before transformers sees the call and turns into ``cu_seqlens``
(:func:`swiftune.attention.packing.packed_batch_from_document_ids`). Without ``document_ids``:
4-channel positions use their first (text) channel, transformers' own packed-row convention;
2-D positions restart at documents as for every text decoder; 3-channel positions (or none) are
one document per row, what transformers computes for such a batch.

Deepstack (visual features added to the hidden states of the first decoder layers at the image
tokens' positions) only needs the image tokens' positions in the row, which packing keeps; the
parity test (tests/test_qwen3_vl.py) checks it. transformers adds the features in the text model's
layer loop, *between* two decoder layers; a patched model adds them at the end of each decoder
layer's own forward instead (:func:`install_deepstack_in_layers`: the same sum, in the same place
of the computation), so that a decoder layer's forward maps its input to the next layer's input.
What recomputes one layer from its input relies on that: offloaded checkpointing's *derived* inputs
(a layer's input rebuilt in backward by running the layer before once more,
:mod:`swiftune.training.checkpointing`) would otherwise miss the features (tests/test_vl_offload.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import nn

from ..attention.hf import PACKED_KWARG, PackedContextHook, packed_context_hook
from ..attention.packing import PackedBatch, build_packed_batch, packed_batch_from_document_ids
from ..attention.registry import PACKED_ATTENTION_IMPLEMENTATIONS, register_packed_attention

#: The keyword a multimodal batch gives the model its documents with (``[B, S]`` integer labels).
DOCUMENT_IDS_KWARG = "document_ids"

#: Where the vision tower and its mergers (patch merger, deepstack mergers) live in
#: ``Qwen3VL(Moe)ForConditionalGeneration`` (transformers 5.x): left unquantised by QLoRA and FP8 loads.
VISION_TOWER_MODULES = ("model.visual",)
#: bitsandbytes' skip list for a vision-language model: the vision tower and the LM head (naming a
#: list replaces transformers' default skips, which would have kept the head).
VISION_SKIP_MODULES = (*VISION_TOWER_MODULES, "lm_head")

_NAMED_INPUTS = ("input_ids", "attention_mask", "position_ids")

#: The keyword the text model hands each decoder layer its deepstack features with (:class:`DeepstackFeatures`).
DEEPSTACK_KWARG = "swiftune_deepstack"
_DEEPSTACK_LAYER = "_swiftune_deepstack_layer"  # on each decoder layer: (its index, the forward it wraps)


def adds_its_own_deepstack(layer: nn.Module) -> bool:
    """Whether this decoder layer's own forward adds its deepstack visual features (patch_model installs
    that), so re-running the layer rebuilds the next layer's input whole (offloaded checkpointing asks)."""
    return _DEEPSTACK_LAYER in layer.__dict__

logger = logging.getLogger(__name__)


def text_config_of(config: Any) -> Any:
    """The text decoder's config of a (possibly composite, vision-language) model config."""
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def multimodal_layout(
    batch_size: int,
    seq_len: int,
    *,
    document_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    backend: str = "auto",
) -> PackedBatch:
    """The :class:`PackedBatch` of one vision-language forward (the rules of the module docstring).

    Args:
        batch_size, seq_len: the ``[B, S]`` shape of the input ids.
        document_ids: ``[B, S]`` per-token document labels; when given they alone say where
            documents start (besides row starts and the padding mask).
        position_ids: ``[B, S]``, ``[3, B, S]`` (M-RoPE) or ``[4, B, S]`` (text channel first).
        attention_mask: optional ``[B, S]`` padding mask.
    """
    if document_ids is not None:
        if document_ids.numel() != batch_size * seq_len:  # [B, S], or [S] for one row
            raise ValueError(f"document_ids must be [B, S] = [{batch_size}, {seq_len}], got "
                             f"{tuple(document_ids.shape)}")
        return packed_batch_from_document_ids(document_ids.reshape(batch_size, seq_len), attention_mask,
                                              backend=backend)
    text_positions = None
    if position_ids is not None:
        if position_ids.dim() == 3 and position_ids.shape[0] == 4:
            text_positions = position_ids[0]
        elif position_ids.dim() <= 2:
            text_positions = position_ids
        elif not (position_ids.dim() == 3 and position_ids.shape[0] == 3):
            raise ValueError(f"position_ids must be [B, S], [3, B, S] or [4, B, S], got {tuple(position_ids.shape)}")
    return build_packed_batch(batch_size, seq_len, text_positions, attention_mask, device=device, backend=backend)


class VisionLanguagePackedHook(PackedContextHook):
    """Forward pre-hook of ``Qwen3VLModel``: pops ``document_ids`` and hands the packed layout of
    the forward to every text attention layer (through the call's keyword arguments, which
    transformers passes down to the decoder layers; the vision tower's attention ignores it).

    It is a :class:`~swiftune.attention.hf.PackedContextHook` (so the support checks find it),
    carrying the model's attention backend itself.
    """

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        kwargs = dict(kwargs)
        document_ids = kwargs.pop(DOCUMENT_IDS_KWARG, None)
        # "swiftune_packed", or GRPO's "swiftune_grpo" (the packed attention unless a row layout is passed)
        if text_config_of(module.config)._attn_implementation not in PACKED_ATTENTION_IMPLEMENTATIONS:
            if document_ids is not None:
                raise ValueError(
                    "document_ids was given, but the text decoder does not run swiftune's packed attention: "
                    "its documents would attend to each other. Call swiftune.patch_model(model) first, or pass "
                    "one example per row")
            return args, kwargs
        named = dict(zip(_NAMED_INPUTS, args))
        named.update({k: kwargs[k] for k in _NAMED_INPUTS if k in kwargs})
        ref = named.get("input_ids")
        if ref is None:
            ref = kwargs.get("inputs_embeds")
        if ref is None or ref.dim() < 2:
            return args, kwargs
        bsz, seq_len = ref.shape[0], ref.shape[1]
        mask = named.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (bsz, seq_len)):
            return args, kwargs  # a 4-D mask, or decoding against a longer cache: the layers fall back
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            return args, kwargs  # decoding: queries attend to cached keys, not a packed layout
        kwargs[PACKED_KWARG] = multimodal_layout(
            bsz, seq_len, document_ids=document_ids, position_ids=named.get("position_ids"), attention_mask=mask,
            device=ref.device, backend=self.backend,
        )
        return args, kwargs


@dataclass(frozen=True)
class DeepstackFeatures:
    """The deepstack features of one forward: ``embeds[i]`` (``[image tokens, H]``) is added after
    decoder layer ``i`` at the tokens where ``visual_pos_masks`` (``[B, S]``) is set."""

    visual_pos_masks: torch.Tensor
    embeds: tuple[torch.Tensor, ...]


class DeepstackIntoLayersHook:
    """Forward pre-hook of the text model (``Qwen3VLTextModel``, ``Qwen3VLMoeTextModel``): takes
    ``visual_pos_masks`` / ``deepstack_visual_embeds`` out of the call (so its own loop adds nothing)
    and passes them as one :data:`DEEPSTACK_KWARG` keyword, which transformers hands to every decoder
    layer with the call's other keyword arguments."""

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        embeds = kwargs.get("deepstack_visual_embeds")
        if embeds is None:
            return args, kwargs
        kwargs = dict(kwargs)
        del kwargs["deepstack_visual_embeds"]
        mask = kwargs.pop("visual_pos_masks", None)
        if mask is None:
            raise ValueError("deepstack_visual_embeds without visual_pos_masks: the features have no positions")
        kwargs[DEEPSTACK_KWARG] = DeepstackFeatures(mask, tuple(embeds))
        return args, kwargs


def add_deepstack(hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """``hidden_states`` with ``embeds`` added at the visual positions (a new tensor, as transformers'
    ``_deepstack_process``: the layer's output may be saved for backward)."""
    mask = visual_pos_masks.to(hidden_states.device)
    out = hidden_states.clone()
    out[mask, :] = out[mask, :] + embeds.to(hidden_states.device, hidden_states.dtype)
    return out


def _layer_forward_with_deepstack(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
    """A decoder layer's forward followed by its deepstack features (none past the last merger's layer)."""
    features: DeepstackFeatures | None = kwargs.pop(DEEPSTACK_KWARG, None)
    index, inner = self.__dict__[_DEEPSTACK_LAYER]
    out = (inner or MethodType(type(self).forward, self))(hidden_states, *args, **kwargs)
    if features is None or index >= len(features.embeds):
        return out
    if isinstance(out, tuple):
        return (add_deepstack(out[0], features.visual_pos_masks, features.embeds[index]), *out[1:])
    return add_deepstack(out, features.visual_pos_masks, features.embeds[index])


def install_deepstack_in_layers(model: nn.Module) -> None:
    """Move the deepstack addition of a Qwen3-VL text model into its decoder layers' forwards (module
    docstring): a :class:`DeepstackIntoLayersHook` on the text model and, on each decoder layer
    instance, a forward that runs the layer's (its instance forward, if it has one, else its class's)
    and adds its features. Again: nothing changes. Enable offloaded checkpointing after this (what
    ``FastModel`` and the trainers do), so that its per-layer forward wraps this one."""
    text = getattr(model.base_model, "language_model", None)
    layers = getattr(text, "layers", None)
    if text is None or not isinstance(layers, nn.ModuleList):
        raise RuntimeError(f"{type(model).__name__} has no language_model.layers: this transformers lays Qwen3-VL "
                           "out otherwise, and swiftune cannot place its deepstack features")
    if getattr(model, "_swiftune_offload_checkpointing", False) and _DEEPSTACK_LAYER not in layers[0].__dict__:
        # the offloaded per-layer forward would run inside this one: its recompute would miss the features
        raise RuntimeError("swiftune.patch_model on a Qwen3-VL model with offloaded checkpointing already on: "
                           "patch the model first, then enable the checkpointing (FastModel does it in this order)")
    if not any(isinstance(h, DeepstackIntoLayersHook) for h in text._forward_pre_hooks.values()):
        text.register_forward_pre_hook(DeepstackIntoLayersHook(), with_kwargs=True)
    for index, layer in enumerate(layers):
        if _DEEPSTACK_LAYER not in layer.__dict__:
            layer.__dict__[_DEEPSTACK_LAYER] = (index, layer.__dict__.get("forward"))
            layer.forward = MethodType(_layer_forward_with_deepstack, layer)


def install_vision_language_attention(model: nn.Module, backend: str = "auto") -> None:
    """Switch a vision-language model's text decoder to ``"swiftune_packed"`` (the vision tower
    keeps its implementation) and register :class:`VisionLanguagePackedHook` on the multimodal
    stack (``model.base_model``, e.g. ``Qwen3VLModel``); again: only the backend is updated."""
    name = register_packed_attention()
    config = model.config
    text = text_config_of(config)
    if text._attn_implementation != name:
        vision = getattr(config.vision_config, "_attn_implementation", None)
        choice = {"text_config": name}
        if vision is not None:
            # FastModel loads with "eager" so that the text decoder can be switched; the vision tower
            # then takes transformers' sdpa (the same attention, per image, without [L, L] scores in Python)
            choice["vision_config"] = "sdpa" if vision == "eager" else vision
        try:
            model.set_attn_implementation(choice)
        except (AttributeError, ValueError, TypeError):  # older API: the sub-config attribute is the switch
            text._attn_implementation = name
    install_deepstack_in_layers(model)
    stack = model.base_model
    hook = packed_context_hook(stack)
    if isinstance(hook, VisionLanguagePackedHook):
        hook.backend = backend
    elif hook is None:
        stack.register_forward_pre_hook(VisionLanguagePackedHook(backend), with_kwargs=True)
    else:
        raise RuntimeError(f"{type(stack).__name__} carries a text decoder's packed-context hook; "
                           "vision-language models need VisionLanguagePackedHook")


def rope_index_of(model: nn.Module):
    """The M-RoPE index function (``get_rope_index``) of a vision-language model, PEFT- or
    DDP-wrapped or not: what :class:`swiftune.data.multimodal.MultimodalCollator` runs per example."""
    for module in model.modules():
        fn = getattr(type(module), "get_rope_index", None)
        if callable(fn):
            return module.get_rope_index
    raise ValueError(f"{type(model).__name__} has no get_rope_index: not a Qwen-VL-style model with M-RoPE")


def check_vision_tower_unquantized(model: nn.Module) -> None:
    """After a 4-bit or FP8 load: the vision tower is where :data:`VISION_TOWER_MODULES` says and none
    of its weights is quantised (a RuntimeError otherwise: transformers renamed the module, so the
    skip lists named nothing)."""
    for prefix in VISION_TOWER_MODULES:
        try:
            tower = model.get_submodule(prefix)
        except AttributeError as e:
            raise RuntimeError(f"{type(model).__name__} has no {prefix!r} module: this transformers names the vision "
                               "tower otherwise, so swiftune cannot keep it out of the quantisation; load the model "
                               "unquantised") from e
        quantized = [f"{prefix}.{name}" for name, p in tower.named_parameters()
                     if type(p).__name__ == "Params4bit" or p.element_size() == 1 and p.is_floating_point()]
        if quantized:
            raise RuntimeError(f"the vision tower was quantised ({quantized[0]} and {len(quantized) - 1} more): "
                               "swiftune keeps it in the load dtype; load the model unquantised")


def unquantized_expert_stacks(model: nn.Module) -> dict[str, int]:
    """The fused expert stacks a 4-bit (QLoRA) load of a mixture-of-experts text decoder leaves in the
    load dtype (Qwen3-VL-MoE: each sparse layer's ``mlp.experts.gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``), by name, with their element counts; ``{}`` for a dense model.

    What ``load_in_4bit=True`` quantises on Qwen3-VL-MoE, and why: transformers' bitsandbytes
    quantiser replaces ``nn.Linear`` modules with ``bnb.nn.Linear4bit``, and that is what becomes NF4
    here: the attention projections of every layer and the projections of the dense (``mlp_only``)
    MLPs. The experts of transformers 5 are one module holding two 3-D parameters, read whole by
    the grouped GEMMs (transformers' and swiftune's, :mod:`swiftune.models.experts`); bitsandbytes
    has no 3-D ``Linear4bit`` and no grouped NF4 matmul, so they stay in the load dtype (bf16), as
    the router (a plain parameter, not a linear) does. This is the layout of transformers +
    bitsandbytes + PEFT's own QLoRA on this model (tests/test_qwen3_vl_moe_quantized.py checks both
    hold the same NF4 codes and the same unquantised stacks). Its cost: the experts are most of a
    MoE model's weights (Qwen3-VL-30B-A3B: about 29B of its 31B), so a 4-bit load saves little
    memory on it; quantising the stacks would need an NF4 grouped GEMM (dequantising one expert
    tile at a time, in forward and in backward) that swiftune does not have yet. LoRA on the
    experts runs through PEFT's ``target_parameters`` (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``) on the unquantised stacks."""
    stacks = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts") or name.endswith("mlp.experts.base_layer"):
            for pname, p in module.named_parameters(recurse=False):
                if p.dim() == 3 and type(p).__name__ != "Params4bit":
                    stacks[f"{name}.{pname}"] = p.numel()
    return stacks


def log_unquantized_expert_stacks(model: nn.Module) -> None:
    """After a 4-bit load: one log line naming how many expert weights stayed in the load dtype
    (:func:`unquantized_expert_stacks`; nothing for a dense model)."""
    stacks = unquantized_expert_stacks(model)
    if not stacks:
        return
    numel = sum(stacks.values())
    itemsize = next(p for n, p in model.named_parameters() if n in stacks).element_size()
    logger.warning("swiftune: load_in_4bit on a mixture-of-experts decoder quantises its attention and dense "
                   "projections only: the %d fused expert stacks (%.2f GB in %d-byte weights) stay unquantised "
                   "(bitsandbytes quantises nn.Linear layers, not 3-D expert stacks)", len(stacks),
                   numel * itemsize / 1e9, itemsize)
