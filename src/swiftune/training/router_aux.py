"""The MoE load-balancing term of a training loss, as TRL 1.16's trainers add it.

TRL reads ``router_aux_loss_coef`` from its config: ``None`` takes the model config's own
coefficient, ``0.0`` switches the term off, and a non-zero value on a model without a router is
an error. Where the term is on, TRL's SFTTrainer also sets ``output_router_logits`` on the model
config (so the model's own forward, and a saved config, say the same) and adds ``coef * aux`` to
each micro-batch's loss, divided by the accumulation steps when the loss is normalised by the global
token count (the Trainer then leaves the accumulation to the loss). TRL's GRPOTrainer leaves the
config alone (it asks each policy forward for the router logits) and adds ``coef * aux`` to each
micro-batch's loss, divided by the accumulation steps in training.

swiftune's losses never ask the model for its logits, so the router logits are recorded from the
router modules during the forward (:func:`swiftune.models.moe.record_router_logits`) and the term
is :func:`swiftune.models.moe.load_balancing_loss` over the batch's real tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..models.moe import load_balancing_loss, moe_config, moe_text_config, record_router_logits
from ..models.patching import causal_lm_of

__all__ = ["RouterAuxLoss", "real_token_mask"]


def real_token_mask(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """``[B, S]`` 1 for real tokens of a collated batch, or ``None`` when every token is real: a
    padded batch's ``attention_mask``; padding-free and packed rows say how many of their leading
    tokens are real (``row_tokens``; the rest of a row is its padding document)."""
    if batch.get("attention_mask") is not None:
        return batch["attention_mask"]
    row_tokens = batch.get("row_tokens")
    ids = batch["input_ids"]
    if row_tokens is None or int(row_tokens.sum()) == ids.numel():
        return None
    width = torch.arange(ids.shape[1], device=ids.device)
    return (width.unsqueeze(0) < row_tokens.to(ids.device).unsqueeze(1)).long()


class RouterAuxLoss:
    """A trainer's MoE load-balancing term (module docstring); disabled for a dense model."""

    def __init__(self, model: nn.Module, coef: float | None, field: str = "router_aux_loss_coef",
                 configure_model: bool = True):
        """``configure_model``: set the model config's ``output_router_logits`` / ``router_aux_loss_coef``
        to match (TRL's SFTTrainer does; its GRPOTrainer does not); on a vision-language MoE
        (Qwen3-VL-MoE) those of its ``text_config``, where the model keeps its router settings."""
        settings = moe_config(model)
        if coef and settings is None:
            raise ConfigError(f"{field}={coef}: {type(causal_lm_of(model)).__name__} is not a mixture-of-experts "
                              f"model swiftune supports, so there is no router loss to weight; leave {field} unset")
        self.num_experts, self.top_k, model_coef = settings or (0, 0, 0.0)
        self.coef = float(model_coef if coef is None else coef)
        self.enabled = settings is not None and self.coef != 0.0
        # the config transformers' own forward reads these from: a vision-language MoE's text_config
        config = moe_text_config(model)
        if configure_model and settings is not None and config is not None:
            config.output_router_logits = self.enabled  # as TRL: the config says whether the term is on
            config.router_aux_loss_coef = self.coef

    @contextlib.contextmanager
    def recording(self, model: nn.Module) -> Iterator[list[torch.Tensor]]:
        """The router logits of the forwards inside the block (nothing when disabled). Leave it
        before ``backward``: a checkpoint's recompute runs the routers again."""
        if not self.enabled:
            yield []
            return
        with record_router_logits(model) as logits:
            yield logits

    def term(self, router_logits: list[torch.Tensor], token_mask: torch.Tensor | None,
             accumulation_steps: int = 1) -> torch.Tensor | None:
        """``coef * aux / accumulation_steps`` of one micro-batch, or ``None`` when disabled."""
        if not self.enabled:
            return None
        aux = load_balancing_loss(router_logits, self.num_experts, self.top_k, token_mask)
        return self.coef * aux / accumulation_steps
