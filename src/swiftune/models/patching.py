"""``patch_model``: switch a transformers causal LM, in place, to swiftune's kernels and attention.

What changes, per supported family (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text, and
the mixture-of-experts families Qwen3-MoE and gpt-oss, whose routers stay transformers' own):

* each attention module's ``forward`` (bound on the instance) applies RoPE to q and k with one
  fused kernel, :func:`swiftune.kernels.rope_qk`, instead of the modeling file's
  ``apply_rotary_pos_emb`` (replacing that module-level function would patch every model of
  the process, so it is left alone);
* each gated MLP's ``forward`` fuses activation and product (SwiGLU or GeGLU);
* each RMSNorm's ``forward`` runs the fused RMSNorm kernel (Gemma's ``(1 + w)`` form too);
* each MoE experts module (fused 3-D expert weights) runs as grouped GEMMs
  (:func:`swiftune.models.experts.grouped_experts_forward`);
* each PEFT LoRA linear already there runs as one autograd node
  (:func:`swiftune.models.lora_linear.fuse_lora_linears`; PEFT's arithmetic in fewer calls);
* the model's attention implementation becomes ``"swiftune_packed"`` (registered with
  transformers' ``AttentionInterface``), and the decoder stack computes the packed document
  layout once per forward.

Classes, parameters and their names do not change: ``save_pretrained`` writes a plain
transformers checkpoint, and the attention implementation is not serialised into config.json.
Other architectures get a warning naming them and run unpatched.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from functools import partial
from types import MethodType

from torch import nn

from ..attention import BACKENDS, install_packed_context, register_packed_attention
from .families import FAMILIES, Family, family_of, supported_model_types
from .experts import grouped_experts_forward
from .forwards import fused_attention_forward, fused_mlp_forward, fused_rms_norm_forward
from .state import (
    AttentionSpec,
    GatedActivation,
    ModelPatch,
    PatchState,
    is_bound,
    mark_unbound,
    model_patch,
    patch_state,
    set_model_patch,
    set_patch_state,
)
from .lora_linear import fuse_lora_linears, unfuse_lora_linears
from .qwen3_vl import install_vision_language_attention
from .tiled_mlp import replace_untiled_forward

__all__ = ["FAMILIES", "attention_is_plain", "causal_lm_of", "fuse_lora_if_patched", "is_patched", "patch_model",
           "unpatch_model"]


_ATTENTION_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config")
_MLP_ATTRS = ("gate_proj", "up_proj", "down_proj", "act_fn")

# Activation module class -> (fused kernel, GELU approximation). Matching the module actually in
# the MLP (rather than config strings, whose attribute name differs between families) keeps the
# fused op equal to what transformers would run.
_GLU_KINDS: dict[str, GatedActivation] = {
    "SiLU": GatedActivation("swiglu"),
    "SiLUActivation": GatedActivation("swiglu"),
    "GELUActivation": GatedActivation("geglu", "none"),
    "GELUTanh": GatedActivation("geglu", "tanh"),
    "PytorchGELUTanh": GatedActivation("geglu", "tanh"),
    "NewGELUActivation": GatedActivation("geglu", "tanh"),
}


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside ``model``: unwraps DDP/FSDP-style ``.module`` wrappers
    and PEFT."""
    inner = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) else inner


def _bind(module: nn.Module, forward: Callable, state: PatchState) -> None:
    bound = MethodType(forward, module)
    if not replace_untiled_forward(module, bound):  # a tiled MLP keeps its tiling, fused underneath
        module.forward = bound
    set_patch_state(module, state)


def _patch_kernels(model: nn.Module, family: Family, kernel_backend: str) -> list[str]:
    """Bind the fused forwards; return descriptions of what could not be patched."""
    eager = getattr(sys.modules.get(type(model).__module__), "eager_attention_forward", None)
    missing: list[str] = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls == family.attention_class:
            if not all(hasattr(module, a) for a in _ATTENTION_ATTRS) or eager is None:
                missing.append(f"RoPE in {name} ({cls} lacks the expected attributes)")
                continue
            spec = AttentionSpec(family.window, family.softcap, eager)
            _bind(module, fused_attention_forward, PatchState(kernel_backend, attention=spec))
        elif family.gated_mlp and cls == family.mlp_class:
            kind = _GLU_KINDS.get(type(getattr(module, "act_fn", None)).__name__)
            if kind is None or not all(hasattr(module, a) for a in _MLP_ATTRS):
                missing.append(f"MLP {name} (activation {type(getattr(module, 'act_fn', None)).__name__})")
                continue
            _bind(module, fused_mlp_forward, PatchState(kernel_backend, activation=kind))
        elif family.experts is not None and cls == family.experts_class:
            if not all(hasattr(module, a) for a in ("gate_up_proj", "down_proj")):
                missing.append(f"experts {name} ({cls} lacks gate_up_proj / down_proj)")
                continue
            _bind(module, partial(grouped_experts_forward, spec=family.experts), PatchState(kernel_backend))
        elif cls == family.norm_class:
            has_eps = hasattr(module, "variance_epsilon") or hasattr(module, "eps")
            if getattr(module, "weight", None) is None or not has_eps:
                missing.append(f"RMSNorm {name}")
                continue
            _bind(module, fused_rms_norm_forward, PatchState(kernel_backend, norm_offset=family.norm_offset))
    return missing


def _set_attention(model: nn.Module, backend: str) -> None:
    name = register_packed_attention()
    if model.config._attn_implementation != name:
        try:
            model.set_attn_implementation(name)
        except (AttributeError, ValueError):  # older API: the config attribute is the switch
            model.config._attn_implementation = name
    install_packed_context(model.base_model, backend)


def patch_model(
    model: nn.Module,
    *,
    kernels: bool = True,
    attention: str | None = "auto",
    kernel_backend: str = "auto",
) -> nn.Module:
    """Switch ``model`` in place to swiftune's fused kernels and packed attention.

    Args:
        model: a transformers causal LM (or a PEFT model wrapping one).
        kernels: bind the fused RoPE / MLP / RMSNorm forwards.
        attention: packed attention backend, ``"auto"`` or one of ``varlen``, ``flash_attn``,
            ``flex``, ``reference``; ``None`` keeps the model's attention implementation.
        kernel_backend: ``"auto"``, ``"triton"`` or ``"reference"`` for the fused kernels.

    Returns:
        ``model`` itself. Patching again is harmless (it only updates the backends).
    """
    if attention is not None and attention != "auto" and attention not in BACKENDS:
        raise ValueError(f"attention must be 'auto', None or one of {BACKENDS}, got {attention!r}")
    if kernel_backend not in ("auto", "triton", "reference"):
        raise ValueError(f"kernel_backend must be 'auto', 'triton' or 'reference', got {kernel_backend!r}")
    hf_model = causal_lm_of(model)
    config = getattr(hf_model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = family_of(config)
    if family is None:
        warnings.warn(
            f"swiftune.patch_model: {type(hf_model).__name__} (model_type {model_type!r}) is not a supported "
            f"family ({supported_model_types()}); fused RoPE, fused MLP, fused RMSNorm and packed "
            "attention stay unpatched: it runs as plain transformers.",
            stacklevel=2,
        )
        return model
    if getattr(config, "use_bidirectional_attention", False) and attention is not None:
        warnings.warn(
            f"swiftune.patch_model: {type(hf_model).__name__} uses bidirectional attention; packed (causal) "
            "attention stays unpatched.",
            stacklevel=2,
        )
        attention = None
    if kernels:
        missing = _patch_kernels(hf_model, family, kernel_backend)
        if missing:
            warnings.warn(
                f"swiftune.patch_model: {type(hf_model).__name__}: unpatched: {'; '.join(missing)}", stacklevel=2
            )
    if attention is not None and family.vision_language:  # the text decoder only; the vision tower keeps its own
        install_vision_language_attention(hf_model, attention)
    elif attention is not None:
        _set_attention(hf_model, attention)
    set_model_patch(hf_model, ModelPatch(kernels=kernels, attention=attention, kernel_backend=kernel_backend))
    fuse_lora_if_patched(model)  # adapters PEFT added before patching (added later: get_peft_model, trainers)
    return model


def fuse_lora_if_patched(model: nn.Module) -> int:
    """Fuse ``model``'s PEFT LoRA linears (:func:`~swiftune.models.lora_linear.fuse_lora_linears`)
    when :func:`patch_model` last ran on it with kernels other than ``"reference"`` (which keeps
    PEFT's own forwards too, and undoes an earlier fusion); return how many are fused."""
    hf_model = causal_lm_of(model)
    record = model_patch(hf_model)
    if record is None or not record.kernels or record.kernel_backend == "reference":
        unfuse_lora_linears(hf_model)
        return 0
    return fuse_lora_linears(hf_model)


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo the kernel forwards of :func:`patch_model` and the fused LoRA linears (the attention
    implementation is kept)."""
    unfuse_lora_linears(causal_lm_of(model))
    for module in causal_lm_of(model).modules():
        if is_bound(module):
            if not replace_untiled_forward(module, None):
                del module.forward  # the instance attribute: the class's forward applies again
            mark_unbound(module)
    return model


def attention_is_plain(model: nn.Module) -> bool:
    """Whether every patched attention layer of ``model`` calls attention without a sliding window,
    soft-cap or attention sinks (gpt-oss: what per-document sdpa cannot run, so ``auto`` takes
    another kernel for such layers); ``False`` when no attention layer is patched (nothing is known)."""
    found = False
    for module in model.modules():
        state = patch_state(module)
        spec = state.attention if state is not None else None
        if spec is None:
            continue
        found = True
        if spec.window(module) is not None or (spec.softcap and getattr(module, "attn_logit_softcapping", None)):
            return False
        if getattr(module, "sinks", None) is not None:
            return False
    return found


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch_model` has bound swiftune's forwards on ``model``."""
    return any(is_bound(m) for m in causal_lm_of(model).modules())
