"""``patch_model``: switch a transformers causal LM, in place, to swiftune's kernels and attention.

What changes, per supported family (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text):

* each attention module's ``forward`` (bound on the instance) applies RoPE to q and k with one
  fused kernel, :func:`swiftune.kernels.rope_qk`, instead of the modeling file's
  ``apply_rotary_pos_emb`` (replacing that module-level function would patch every model of
  the process, so it is left alone);
* each gated MLP's ``forward`` fuses activation and product (SwiGLU or GeGLU);
* each RMSNorm's ``forward`` runs the fused RMSNorm kernel (Gemma's ``(1 + w)`` form too);
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
from dataclasses import dataclass
from types import MethodType

from torch import nn

from ..attention import BACKENDS, install_packed_context, register_packed_attention
from .forwards import AttentionSpec, fused_attention_forward, fused_mlp_forward, fused_rms_norm_forward
from .tiled_mlp import replace_untiled_forward

_PATCHED = "_swiftune_patched"  # attribute set on every module whose forward swiftune replaced


def _layer_window(module: nn.Module) -> int | None:
    """Sliding window of a layer that knows its own type (Qwen2/3, Gemma 2/3: layer_types)."""
    return getattr(module, "sliding_window", None)


def _config_window(module: nn.Module) -> int | None:
    """Mistral: one window for every layer, from the config."""
    return getattr(module.config, "sliding_window", None)


def _no_window(module: nn.Module) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """How swiftune patches one architecture family.

    Attributes:
        prefix: class-name prefix of the family's modules (``Qwen3`` -> ``Qwen3Attention``,
            ``Qwen3MLP``, ``Qwen3RMSNorm``).
        window: reads a layer's sliding window the way the family's own forward does.
        softcap: whether the attention call passes ``attn_logit_softcapping``.
        norm_offset: 1.0 for Gemma's ``(1 + w)`` RMSNorm.
    """

    prefix: str
    window: Callable[[nn.Module], int | None] = _no_window
    softcap: bool = False
    norm_offset: float = 0.0


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral", window=_config_window),
    "qwen2": Family("Qwen2", window=_layer_window),
    "qwen3": Family("Qwen3", window=_layer_window),
    "gemma": Family("Gemma", norm_offset=1.0),
    "gemma2": Family("Gemma2", window=_layer_window, softcap=True, norm_offset=1.0),
    "gemma3_text": Family("Gemma3", window=_layer_window, norm_offset=1.0),
}

_ATTENTION_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config")
_MLP_ATTRS = ("gate_proj", "up_proj", "down_proj", "act_fn")

# Activation module class -> (fused kernel, GELU approximation). Matching the module actually in
# the MLP (rather than config strings, whose attribute name differs between families) keeps the
# fused op equal to what transformers would run.
_GLU_KINDS: dict[str, tuple[str, str | None]] = {
    "SiLU": ("swiglu", None),
    "SiLUActivation": ("swiglu", None),
    "GELUActivation": ("geglu", "none"),
    "GELUTanh": ("geglu", "tanh"),
    "PytorchGELUTanh": ("geglu", "tanh"),
    "NewGELUActivation": ("geglu", "tanh"),
}


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside ``model``: unwraps DDP/FSDP-style ``.module`` wrappers
    and PEFT."""
    inner = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) else inner


def _bind(module: nn.Module, forward: Callable, kernel_backend: str) -> None:
    bound = MethodType(forward, module)
    if not replace_untiled_forward(module, bound):  # a tiled MLP keeps its tiling, fused underneath
        module.forward = bound
    module._swiftune_kernel_backend = kernel_backend
    setattr(module, _PATCHED, True)


def _patch_kernels(model: nn.Module, family: Family, kernel_backend: str) -> list[str]:
    """Bind the fused forwards; return descriptions of what could not be patched."""
    eager = getattr(sys.modules.get(type(model).__module__), "eager_attention_forward", None)
    missing: list[str] = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls == f"{family.prefix}Attention":
            if not all(hasattr(module, a) for a in _ATTENTION_ATTRS) or eager is None:
                missing.append(f"RoPE in {name} ({cls} lacks the expected attributes)")
                continue
            module._swiftune_attention_spec = AttentionSpec(family.window, family.softcap, eager)
            _bind(module, fused_attention_forward, kernel_backend)
        elif cls == f"{family.prefix}MLP":
            kind = _GLU_KINDS.get(type(getattr(module, "act_fn", None)).__name__)
            if kind is None or not all(hasattr(module, a) for a in _MLP_ATTRS):
                missing.append(f"MLP {name} (activation {type(getattr(module, 'act_fn', None)).__name__})")
                continue
            module._swiftune_glu = kind
            _bind(module, fused_mlp_forward, kernel_backend)
        elif cls == f"{family.prefix}RMSNorm":
            has_eps = hasattr(module, "variance_epsilon") or hasattr(module, "eps")
            if getattr(module, "weight", None) is None or not has_eps:
                missing.append(f"RMSNorm {name}")
                continue
            module._swiftune_norm_offset = family.norm_offset
            _bind(module, fused_rms_norm_forward, kernel_backend)
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
    family = FAMILIES.get(model_type)
    if family is None:
        warnings.warn(
            f"swiftune.patch_model: {type(hf_model).__name__} (model_type {model_type!r}) is not a supported "
            f"family ({', '.join(sorted(FAMILIES))}); fused RoPE, fused MLP, fused RMSNorm and packed "
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
    if attention is not None:
        _set_attention(hf_model, attention)
    hf_model._swiftune_patch = {"kernels": kernels, "attention": attention, "kernel_backend": kernel_backend}
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo the kernel forwards of :func:`patch_model` (the attention implementation is kept)."""
    for module in causal_lm_of(model).modules():
        if getattr(module, _PATCHED, False):
            if not replace_untiled_forward(module, None):
                del module.forward  # the instance attribute: the class's forward applies again
            delattr(module, _PATCHED)
    return model


def attention_is_plain(model: nn.Module) -> bool:
    """Whether every patched attention layer of ``model`` calls attention without a sliding window
    or soft-cap (what per-document sdpa cannot run, so ``auto`` takes another kernel for such
    layers); ``False`` when no attention layer is patched (nothing is known)."""
    found = False
    for module in model.modules():
        spec = getattr(module, "_swiftune_attention_spec", None)
        if spec is None:
            continue
        found = True
        if spec.window(module) is not None or (spec.softcap and getattr(module, "attn_logit_softcapping", None)):
            return False
    return found


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch_model` has bound swiftune's forwards on ``model``."""
    return any(getattr(m, _PATCHED, False) for m in causal_lm_of(model).modules())
