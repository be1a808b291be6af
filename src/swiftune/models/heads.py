"""The decoder's last hidden states and the LM head, for losses that never build the logits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .patching import causal_lm_of


def hidden_states_and_head(model: nn.Module, **forward_kwargs: Any) -> tuple[torch.Tensor, nn.Module, float | None]:
    """Run ``model``'s own forward and return ``(last_hidden_state, lm_head, final_logit_softcap)``.

    The forward goes through the top-level module (so DDP/FSDP hooks run) with
    ``logits_to_keep=1`` (one position projected, not the whole sequence); a forward hook on the
    decoder captures its last hidden state, which the fused losses project chunk by chunk.
    """
    causal_lm = causal_lm_of(model)
    decoder = causal_lm.get_decoder()
    lm_head = causal_lm.get_output_embeddings()
    if hasattr(lm_head, "base_layer"):
        raise NotImplementedError(
            "LoRA on the LM head is not supported by swiftune's fused losses; leave lm_head out of target_modules"
        )
    captured: dict[str, torch.Tensor] = {}

    def grab(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = decoder.register_forward_hook(grab)
    try:
        model(**forward_kwargs, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured["hidden"], lm_head, getattr(causal_lm.config, "final_logit_softcapping", None)
