"""The decoder-layer loop of :class:`~swiftune.rl.rollout.fast.FastRolloutEngine` for pre-norm families.

A Llama / Mistral / Qwen2 / Qwen3 (and Qwen3-MoE / Mixtral / gpt-oss: ``mlp`` is the MoE block) decoder layer
computes::

    h = h + attn(norm_1(h));   h = h + mlp(norm_2(h))

and the model ends with ``norm(h)``. Run as written, every norm is preceded by a separate residual
add: two elementwise kernels per layer that, during decoding at a few rows, cost about as much as
a small matmul each (the step is bound by kernel count, not bytes). This loop runs the layer's
own projections (LoRA layers included) and MLP module, but folds each residual
add into the following norm with :func:`swiftune.kernels.add_rms_norm`, the last one into the
final norm, and in decode steps runs the q/k norms, RoPE and the two K/V cache writes as one
kernel (:func:`swiftune.kernels.decode_qkv`) before the engine's attention. The roundings are those
of the unfused layer (the kernel rounds the sum to the activation dtype before normalising it).
FP8 projections that quantise their input (the FP8 x FP8 decode kernel at 17-64 rows, ``_scaled_mm``
above) quantise it once for q/k/v (here in decode steps, in swiftune's attention forward in prefill)
and once for gate/up (swiftune's MLP forward), with the bits of each quantising its own
(:func:`swiftune.models.lora_linear.shared_fp8_input`); LoRA layers over FP8 bases (adapters at run
time) too: their base products share the codes, their adapter products multiply the input itself.
In decode steps (``fp8_norm_codes``) the residual add + norm kernel before them makes those codes
itself (:func:`swiftune.kernels.add_rms_norm_fp8`, the quantiser's bytes): one launch fewer per norm;
with ``fp8_glu_codes`` the MLP's activation kernel makes ``down_proj``'s (:func:`swiftune.kernels.glu_fp8`).

It runs only on models patched by :func:`swiftune.patch_model`, whose norms already compute with
swiftune's RMSNorm kernel, so the fused path equals the layers' own forward exactly. Gemma
families (extra norms around attention and MLP, ``(1 + w)`` weights, embedding scale) and
unpatched models keep transformers' own layer forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...kernels import add_rms_norm, add_rms_norm_fp8, decode_qkv, rms_norm
from ...models.families import FAMILIES
from ...models.forwards import gated_activation, gated_activation_fp8
from ...models.lora_linear import is_fused_lora, shared_fp8_input, stacked_fp8_products, takes_shared_fp8_input
from ...models.state import is_bound, patch_state

#: model types whose decoder layers are exactly ``h + attn(norm_1(h))``, ``h + mlp(norm_2(h))``
PRE_NORM_FAMILIES = tuple(t for t, f in FAMILIES.items() if f.pre_norm)


def _eps(norm: nn.Module) -> float:
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def fused_prenorm_supported(decoder: nn.Module, model_type: str, dtype: torch.dtype) -> bool:
    """Whether :func:`prenorm_layers` can replace the layers' forwards for this model."""
    family = FAMILIES.get(model_type)
    if family is None or not family.pre_norm:
        return False
    norms = [decoder.norm]
    for layer in decoder.layers[: decoder.config.num_hidden_layers]:
        if not all(hasattr(layer, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")):
            return False
        attn = layer.self_attn
        if not is_bound(attn):  # decode_attention follows swiftune's attention forward
            return False
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
    # norms patched by swiftune (so the fused kernel computes what the layer's own norm does, bit
    # for bit), plain RMSNorm, weights in the activation dtype
    return all(is_bound(n) and patch_state(n).norm_offset == 0.0
               and getattr(n, "weight", None) is not None
               and n.weight.dtype == dtype and (hasattr(n, "variance_epsilon") or hasattr(n, "eps"))
               for n in norms)


def prenorm_layers(decoder: nn.Module, h: torch.Tensor, position_ids: torch.Tensor,
                   position_embeddings: Any, ctx: Any, ctx_kwarg: str) -> torch.Tensor:
    """All decoder layers and the final norm on the embedded input ``h`` (no grad); ``ctx`` is the
    engine's :class:`~swiftune.rl.rollout.kv_cache.DecodeContext`, passed to the attention modules as
    the keyword ``ctx_kwarg`` in prefill."""
    layers = decoder.layers[: decoder.config.num_hidden_layers]
    first = layers[0].input_layernorm
    state = patch_state(first)
    backend = state.kernel_backend if state is not None else "auto"
    residual = h
    x = rms_norm(h, first.weight, _eps(first), backend=backend)
    cos, sin = position_embeddings
    if 2 * cos.shape[-1] == layers[0].self_attn.head_dim:
        # gpt-oss's rotary module gives one angle per rotated pair (half width), which swiftune's
        # attention forward widens in every layer; widened once here for all of them
        position_embeddings = (torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1))
    decode, options = ctx.mode == "decode", ctx.options
    codes = None  # x's FP8 codes, made by the norm that made x (the first layer's input quantises its own)
    for i, layer in enumerate(layers):
        if decode:
            out = decode_attention(layer.self_attn, x, position_embeddings, ctx, backend, codes)
        else:  # the packed prefill: the module's own forward, the engine's attention function
            out = layer.self_attn(hidden_states=x, attention_mask=None, position_ids=position_ids,
                                  position_embeddings=position_embeddings, **{ctx_kwarg: ctx})
            out = out[0] if isinstance(out, tuple) else out
        gate_up = decode_mlp_projections(layer.mlp, options.fp8_stacked_gate_up, options.lora_decode_kernel) \
            if decode else None
        readers = gate_up if options.fp8_norm_codes else None
        x, residual, codes = _add_norm(out, residual, layer.post_attention_layernorm, readers, backend)
        out = (decode_mlp(layer.mlp, x, codes, options.lora_decode_kernel, options.fp8_stacked_gate_up, gate_up,
                          options.fp8_glu_codes) if gate_up else layer.mlp(x))
        out = out[0] if isinstance(out, tuple) else out  # gpt-oss's MoE block also returns its router scores
        last = i + 1 == len(layers)
        nxt = decoder.norm if last else layers[i + 1].input_layernorm
        readers = (attention_projections(layers[i + 1].self_attn) if decode and options.fp8_norm_codes and not last
                   else None)
        x, residual, codes = _add_norm(out, residual, nxt, readers, backend)
    return x


def _add_norm(out: torch.Tensor, residual: torch.Tensor, norm: nn.Module, readers: tuple | None,
              backend: str) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``add_rms_norm(out, residual)`` and, where the projections ``readers`` would quantise its output the
    same way (:func:`takes_shared_fp8_input`), that output's FP8 codes and scales from the same kernel."""
    if readers is not None and takes_shared_fp8_input(out, readers):
        x, residual, codes, scales = add_rms_norm_fp8(out, residual, norm.weight, _eps(norm), backend=backend)
        return x, residual, (codes, scales)
    x, residual = add_rms_norm(out, residual, norm.weight, _eps(norm), backend=backend)
    return x, residual, None


def attention_projections(attn: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The projections :func:`decode_attention` multiplies its input by."""
    return attn.q_proj, attn.k_proj, attn.v_proj


def gated_projections(mlp: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """A patched gated MLP's ``(gate_proj, up_proj)``, which :func:`decode_mlp` multiplies as one product;
    ``None`` for other MLPs (MoE blocks, unpatched ones), which run their own forward."""
    gated = is_bound(mlp) and patch_state(mlp).activation is not None  # (patched gated MLPs carry their activation)
    return (mlp.gate_proj, mlp.up_proj) if gated and hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj") else None


def decode_mlp_projections(mlp: nn.Module, stacked: bool, lora_kernel: bool) -> tuple[nn.Module, nn.Module] | None:
    """The gate/up projections a decode step runs through :func:`decode_mlp` (as one stacked FP8 product, or, with
    the LoRA decode kernel, an adapted MLP's projections one by one); ``None`` where the MLP's own forward runs
    (then nothing is made for :func:`decode_mlp` to read: no norm-made codes, no shared quantisation)."""
    projections = gated_projections(mlp)
    if projections is None or stacked:
        return projections
    return projections if lora_kernel and _adapted(mlp, projections) else None


def _adapted(mlp: nn.Module, projections: tuple[nn.Module, nn.Module]) -> bool:
    return any(is_fused_lora(p) for p in (*projections, mlp.down_proj))


def decode_mlp(mlp: nn.Module, x: torch.Tensor, codes: tuple[torch.Tensor, torch.Tensor] | None = None,
               lora_kernel: bool = False, stacked: bool = True,
               projections: tuple[nn.Module, nn.Module] | None = None, glu_codes: bool = False
               ) -> torch.Tensor | tuple:
    """One decode step of a gated MLP whose FP8 ``gate_proj`` / ``up_proj`` codes lie in one buffer
    (``quantize_model_fp8``): one product for both (each LoRA adapter added to its own columns), the fused
    activation reading its two column halves in place, then ``down_proj``; what swiftune's MLP forward
    computes, each column the same dot product. Anything else (MoE blocks, other weights, a layout moved
    since) runs the module's own forward. ``codes``: ``x``'s FP8 codes and scales made already
    (:func:`shared_fp8_input`); ``lora_kernel``: runtime LoRA adapters' products added in two launches each
    (:func:`swiftune.models.lora_linear.fused_lora_forward`), gate/up then called one by one where they are not
    stacked (``stacked=False`` or weights not laid out so); without it those run the module's own forward.
    ``projections``: what :func:`decode_mlp_projections` answered for these settings, where the caller asked it
    already (the layer loop, to let the norm make their codes); ``None``: asked here. ``glu_codes``: where
    ``down_proj`` would quantise its input (:func:`takes_shared_fp8_input`), the activation kernel makes those
    codes (:func:`~swiftune.models.forwards.gated_activation_fp8`, the quantiser's bytes) instead of a launch of
    their own."""
    if projections is None:
        projections = decode_mlp_projections(mlp, stacked, lora_kernel)
    if projections is None:
        return mlp(x)
    shared = shared_fp8_input(x, projections, codes)
    products = stacked_fp8_products(projections, x, **shared, lora_kernel=lora_kernel) if stacked else None
    if products is None:
        if not (lora_kernel and _adapted(mlp, projections)):
            return mlp(x)
        products = [p(x, **shared, **_lora_options(p, lora_kernel)) for p in projections]
    down, down_input = mlp.down_proj, {}
    if glu_codes and takes_shared_fp8_input(products[0], (down,)):  # (the activation's output: gate's shape, dtype)
        hidden, *made = gated_activation_fp8(mlp, *products)
        down_input = shared_fp8_input(hidden, (down,), tuple(made))
    else:
        hidden = gated_activation(mlp, *products)
    return down(hidden, **down_input, **_lora_options(down, lora_kernel))


def _lora_options(projection: nn.Module, lora_kernel: bool) -> dict[str, bool]:
    """The keyword that hands a fused LoRA layer (:func:`~swiftune.models.lora_linear.is_fused_lora`) the
    two-launch adapter product; nothing for other layers, whose forwards do not take it."""
    return {"lora_kernel": True} if lora_kernel and is_fused_lora(projection) else {}


def decode_attention(attn: nn.Module, x: torch.Tensor, position_embeddings: Any, ctx: Any, backend: str,
                     codes: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One decode step of a patched attention module (``x [B, 1, hidden]``): its own projections
    and o_proj; q/k norms, RoPE and the K/V cache writes in one kernel (:func:`decode_qkv`); then
    the engine's attention over the cache. Computes what ``fused_attention_forward`` with the
    ``swiftune_rollout`` attention function computes, with one launch where there were five (Qwen3:
    two norms, RoPE, two cache writes) or three (no q/k norms). ``codes``: ``x``'s FP8 codes and scales
    made already (:func:`shared_fp8_input`)."""
    rows = x.shape[0]
    heads, kv_heads, dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    projections = attention_projections(attn)
    shared = shared_fp8_input(x, projections, codes)
    lora_kernel = ctx.options.lora_decode_kernel
    stacked = (stacked_fp8_products(projections, x, **shared, lora_kernel=lora_kernel) if ctx.options.fp8_stacked_qkv
               else None)
    if stacked is None:
        stacked = [p(x, **shared, **_lora_options(p, lora_kernel)) for p in projections]
    q, k, v = (t.view(rows, n, dim) for t, n in zip(stacked, (heads, kv_heads, kv_heads)))
    cos, sin = position_embeddings  # [B, 1, D]
    if cos.dtype != q.dtype:  # as the attention forward does (e.g. under autocast)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    ws, layer = ctx.ws, attn.layer_idx
    scales = {} if ws.k_scale is None else {"k_scales": ws.k_scale[layer], "v_scales": ws.v_scale[layer]}
    q = decode_qkv(q, k, v, q_norm.weight if q_norm is not None else None,
                   k_norm.weight if k_norm is not None else None, _eps(q_norm) if q_norm is not None else 1e-6,
                   cos[:, 0], sin[:, 0], ws.k[layer], ws.v[layer], ws.cur, **scales, backend=backend)
    window = patch_state(attn).attention.window(attn)
    out = ctx.attend_cached(attn.layer_idx, q[:, :, None], attn.scaling, window,
                            sinks=getattr(attn, "sinks", None))  # gpt-oss's per-head sink logits
    return attn.o_proj(out.reshape(rows, 1, heads * dim), **_lora_options(attn.o_proj, lora_kernel))
