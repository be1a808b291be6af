"""The decoder-layer loop of :class:`~swiftune.rl.engine.FastRolloutEngine` for pre-norm families.

A Llama / Mistral / Qwen2 / Qwen3 decoder layer computes::

    h = h + attn(norm_1(h));   h = h + mlp(norm_2(h))

and the model ends with ``norm(h)``. Run as written, every norm is preceded by a separate residual
add: two elementwise kernels per layer that, during decoding at a few rows, cost about as much as
a small matmul each (the step is bound by kernel count, not bytes). This loop calls the layer's
own attention and MLP modules (projections, LoRA layers, q/k norms, RoPE and the engine's
attention function all as usual) but folds each residual add into the following norm with
:func:`swiftune.kernels.add_rms_norm`, the last one into the final norm. The roundings are those
of the unfused layer (the kernel rounds the sum to the activation dtype before normalising it).

It runs only on models patched by :func:`swiftune.patch_model`, whose norms already compute with
swiftune's RMSNorm kernel, so the fused path equals the layers' own forward exactly. Gemma
families (extra norms around attention and MLP, ``(1 + w)`` weights, embedding scale) and
unpatched models keep transformers' own layer forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..kernels import add_rms_norm, rms_norm

#: model types whose decoder layers are exactly ``h + attn(norm_1(h))``, ``h + mlp(norm_2(h))``
PRE_NORM_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _eps(norm: nn.Module) -> float:
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def fused_prenorm_supported(decoder: nn.Module, model_type: str, dtype: torch.dtype) -> bool:
    """Whether :func:`prenorm_layers` can replace the layers' forwards for this model."""
    if model_type not in PRE_NORM_FAMILIES:
        return False
    norms = [decoder.norm]
    for layer in decoder.layers[: decoder.config.num_hidden_layers]:
        if not all(hasattr(layer, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")):
            return False
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    # norms patched by swiftune (so the fused kernel computes what the layer's own norm does, bit
    # for bit), plain RMSNorm, weights in the activation dtype
    return all(getattr(n, "_swiftune_patched", False) and getattr(n, "_swiftune_norm_offset", None) == 0.0
               and getattr(n, "weight", None) is not None
               and n.weight.dtype == dtype and (hasattr(n, "variance_epsilon") or hasattr(n, "eps"))
               for n in norms)


def prenorm_layers(decoder: nn.Module, h: torch.Tensor, position_ids: torch.Tensor,
                   position_embeddings: Any, attention_kwargs: dict[str, Any]) -> torch.Tensor:
    """All decoder layers and the final norm on the embedded input ``h`` (no grad)."""
    layers = decoder.layers[: decoder.config.num_hidden_layers]
    first = layers[0].input_layernorm
    backend = getattr(first, "_swiftune_kernel_backend", "auto")
    residual = h
    x = rms_norm(h, first.weight, _eps(first), backend=backend)
    for i, layer in enumerate(layers):
        out = layer.self_attn(hidden_states=x, attention_mask=None, position_ids=position_ids,
                              position_embeddings=position_embeddings, **attention_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        post = layer.post_attention_layernorm
        x, residual = add_rms_norm(out, residual, post.weight, _eps(post), backend=backend)
        out = layer.mlp(x)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else decoder.norm
        x, residual = add_rms_norm(out, residual, nxt.weight, _eps(nxt), backend=backend)
    return x
