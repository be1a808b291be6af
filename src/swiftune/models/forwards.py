"""swiftune's forwards for the attention, MLP and RMSNorm modules of the supported families.

:func:`swiftune.patch_model` binds these on module *instances* (``module.forward = ...``); the
classes, the parameters and their names stay transformers' own, so checkpoints stay plain.
Each forward computes what the transformers forward of the same module computes, with the
fused kernels of :mod:`swiftune.kernels` in place of the unfused PyTorch ops. Projections that read
one input (q/k/v; gate/up) and would each quantise it to FP8 share one quantisation
(:func:`~swiftune.models.lora_linear.shared_fp8_input`: the same bits, fewer launches).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.pieces import PIECES_KWARG, DocumentOutputs, project_pieces
from ..attention.registry import PACKED_ATTENTION_IMPLEMENTATIONS
from ..kernels import gated_linear_unit, glu_fp8, rms_norm, rope_qk
from .lora_linear import shared_fp8_input
from .state import AttentionSpec, PatchState, patch_state

__all__ = ["AttentionSpec", "fused_attention_forward", "fused_mlp_forward", "fused_rms_norm_forward",
           "gated_activation", "gated_activation_fp8"]


def _state(module: nn.Module) -> PatchState:
    state = patch_state(module)
    if state is None:  # bound by hand, not by patch_model: nothing says which kernels to run
        raise RuntimeError(f"{type(module).__name__} runs a swiftune forward without a patch state; "
                           "use swiftune.patch_model")
    return state


def fused_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of Llama / Mistral / Qwen2 / Qwen3 / Gemma 1-3 / Qwen3-MoE / gpt-oss with one fused
    QK RoPE kernel.

    Same projections and (Qwen3 / Gemma 3) per-head q/k RMSNorm as transformers; RoPE through
    :func:`swiftune.kernels.rope_qk` (in place); then the configured attention function.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    state = _state(self)
    spec: AttentionSpec = state.attention
    backend = state.kernel_backend
    # transformers < 5.2x names the cache ``past_key_values``, later ``cache``: accept both.
    cache = kwargs.pop("cache", None)
    legacy_cache = kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy_cache

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    shared = shared_fp8_input(hidden_states, (self.q_proj, self.k_proj, self.v_proj))  # FP8: one quantise
    query = self.q_proj(hidden_states, **shared).view(hidden_shape)
    key = self.k_proj(hidden_states, **shared).view(hidden_shape)
    value = self.v_proj(hidden_states, **shared).view(hidden_shape).transpose(1, 2)
    del shared  # the codes (a byte per input element) are not held through the attention
    if getattr(self, "q_norm", None) is not None:
        # Qwen3 / Gemma 3 normalise each head over head_dim before RoPE; the norm is over the
        # last axis, so applying it before the transpose (Qwen3's order) is the same for Gemma 3.
        query = self.q_norm(query)
        key = self.k_norm(key)
    cos, sin = position_embeddings
    if 2 * cos.shape[-1] == self.head_dim:
        # gpt-oss's rotary module returns one angle per rotated pair (half width) and rotates the two
        # halves; that is rotate_half's rotation with the angles repeated, which rope_qk computes
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    if cos.dtype != query.dtype:  # e.g. autocast: rotate in q's dtype
        cos, sin = cos.to(query.dtype), sin.to(query.dtype)
    query, key = rope_qk(query.transpose(1, 2), key.transpose(1, 2), cos, sin, backend=backend)

    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, spec.eager)
    extra = {}
    window = spec.window(self)
    if window is not None:
        extra["sliding_window"] = window
    if spec.softcap:
        extra["softcap"] = self.attn_logit_softcapping
    if getattr(self, "sinks", None) is not None:  # gpt-oss: one sink logit per head joins every softmax
        extra["s_aux"] = self.sinks
    if torch.is_grad_enabled() and self.config._attn_implementation in PACKED_ATTENTION_IMPLEMENTATIONS:
        # long documents' outputs may come back apart: projected one by one, o_proj saves views of what
        # the attention saved, not a concatenated copy (swiftune.attention.pieces)
        extra[PIECES_KWARG] = True
    attn_output, attn_weights = attention_interface(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling,
        **extra,
        **kwargs,
    )
    if isinstance(attn_output, DocumentOutputs):
        return project_pieces(self.o_proj, attn_output, input_shape), attn_weights
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def fused_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Gated MLP ``down(act(gate(x)) * up(x))`` with the activation and product fused."""
    shared = shared_fp8_input(x, (self.gate_proj, self.up_proj))  # FP8: one quantise for both
    gate = self.gate_proj(x, **shared)
    up = self.up_proj(x, **shared)
    del shared
    if gate.dtype != up.dtype:  # unusual mixed setups: keep transformers' own arithmetic
        return type(self).forward(self, x)
    return self.down_proj(gated_activation(self, gate, up))


def gated_activation(mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of a gated MLP that :func:`swiftune.patch_model` patched, through its fused kernel
    (SwiGLU or GeGLU, the family's activation): what :func:`fused_mlp_forward` multiplies ``down_proj`` by.
    ``gate`` / ``up`` may be column views of one wider product (read in place)."""
    state = _state(mlp)
    return gated_linear_unit(gate, up, state.activation.glu, backend=state.kernel_backend)


def gated_activation_fp8(mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gated_activation`'s output with its per-row FP8 codes and scales made in the same launch
    (:func:`swiftune.kernels.glu_fp8`, the rowwise quantiser's bytes): what an FP8 ``down_proj`` of a decode
    step would make of its input. No autograd."""
    state = _state(mlp)
    return glu_fp8(gate, up, state.activation.glu, backend=state.kernel_backend)


def fused_rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm through the fused kernel (Gemma's ``(1 + w)`` through ``offset=1``)."""
    if x.dtype != self.weight.dtype:
        # transformers' dtype rules differ by family when weight and input dtypes differ
        # (Llama promotes, Gemma keeps x's dtype): keep its own forward for such setups.
        return type(self).forward(self, x)
    eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
    state = _state(self)
    return rms_norm(x, self.weight, eps, state.norm_offset, backend=state.kernel_backend)
