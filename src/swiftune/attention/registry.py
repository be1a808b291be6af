"""Every attention function swiftune registers with transformers, in one place.

transformers picks a layer's attention function by ``config._attn_implementation`` from
``AttentionInterface``, and builds each forward's mask through ``AttentionMaskInterface`` under
the same name. swiftune registers three names:

* :data:`ATTENTION_NAME` (``"swiftune_packed"``): packed attention, set by ``patch_model``;
  its mask function returns the 2-D padding mask as it came, never an ``[S, S]`` mask (leaving
  the name out of the mask registry would make transformers drop the 2-D mask altogether);
* :data:`GRPO_ATTENTION_NAME` (``"swiftune_grpo"``): GRPO's policy rows (shared-prompt rows when
  a ``RowLayout`` is passed, else the packed attention unchanged), with the same mask function;
* :data:`ROLLOUT_ATTENTION_NAME` (``"swiftune_rollout"``): the fast rollout engine's KV-cache
  attention, switched on only for the duration of a call; it receives no mask (the engine
  calls the layers itself), so it has no mask function.

Registering is idempotent; each ``register_*`` returns the name to set as the attention
implementation. Installing a name on a model is left to the layers above (``patch_model``, the
GRPO policy forward, the rollout engine), which know how to reach the causal LM.
"""

from __future__ import annotations

from .hf import ATTENTION_NAME, packed_attention_forward, packed_attention_mask
from .kv_cache import ROLLOUT_ATTENTION_NAME, rollout_attention_forward
from .shared_prompt import GRPO_ATTENTION_NAME, grpo_attention_forward

#: Attention implementations that keep packed documents apart (what the trainers may pack for).
PACKED_ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = (ATTENTION_NAME, GRPO_ATTENTION_NAME)


def _register_with_padding_mask(name: str, forward) -> str:
    """Register ``forward`` under ``name`` with the attention registry, and the mask function that
    hands the 2-D padding mask through unchanged with the mask registry."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, packed_attention_mask)
    return name


def register_packed_attention() -> str:
    """Register ``"swiftune_packed"`` with transformers' attention and mask registries."""
    return _register_with_padding_mask(ATTENTION_NAME, packed_attention_forward)


def register_grpo_attention() -> str:
    """Register ``"swiftune_grpo"`` with transformers' attention and mask registries."""
    return _register_with_padding_mask(GRPO_ATTENTION_NAME, grpo_attention_forward)


def register_rollout_attention() -> str:
    """Register ``"swiftune_rollout"`` with transformers' attention registry."""
    from transformers import AttentionInterface

    AttentionInterface.register(ROLLOUT_ATTENTION_NAME, rollout_attention_forward)
    return ROLLOUT_ATTENTION_NAME
