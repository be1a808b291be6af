"""Mixture-of-experts support: the router logits of a forward and the load-balancing loss.

Sparse MoE blocks (Qwen3-MoE, gpt-oss, Mixtral) route each token to ``top_k`` of ``E`` experts; transformers adds
``router_aux_loss_coef * aux`` to the loss when ``output_router_logits`` is on, with ``aux`` the
Switch-Transformer load-balancing loss over *all* layers and *all* real tokens of the batch:

    C_e = sum_l sum_t m_t [e in topk(p_lt)]        (assignments, not differentiable)
    P_e = sum_l sum_t m_t p_lte                    (router probabilities, p_lt = softmax(z_lt))
    N   = sum_l sum_t m_t                          (layers x real tokens)
    aux = E * sum_e (C_e / N) (P_e / N)

so d aux / d z_lt = (E m_t / N^2) J_softmax(p_lt)^T C, through the probabilities only.

``aux`` is a batch statistic (a product of two sums), not a sum over documents: it depends on which
tokens share a batch, not on how they are laid out. A padded batch with its attention mask, a
padding-free row, and packed rows with their padding masked out all give the same ``aux`` for the
same documents, which is what :func:`load_balancing_loss` computes from the router logits.

swiftune's losses never ask the model for logits (they project the last hidden states chunk by
chunk), so transformers' own ``aux_loss`` output is not there: :func:`record_router_logits` collects
the router logits of a forward, and :func:`router_aux_loss` turns them into the term to add.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .families import family_of
from .patching import causal_lm_of

__all__ = ["load_balancing_loss", "moe_config", "moe_text_config", "record_router_logits", "router_aux_loss"]


def moe_text_config(model: nn.Module) -> object | None:
    """The config that holds a MoE model's router settings (``num_experts``, ``num_experts_per_tok``,
    ``router_aux_loss_coef``, ``output_router_logits``), or ``None`` for a dense model.

    A text MoE (Qwen3-MoE, gpt-oss, Mixtral) keeps them in its own config; a vision-language MoE
    (Qwen3-VL-MoE) in its ``text_config``, which is also where its transformers forward reads them.
    """
    config = getattr(causal_lm_of(model), "config", None)
    family = family_of(config)
    if family is None or not family.moe:
        return None
    return getattr(config, "text_config", None) if family.vision_language else config


def moe_config(model: nn.Module) -> tuple[int, int, float] | None:
    """``(num_experts, top_k, router_aux_loss_coef)`` of a MoE model (read from
    :func:`moe_text_config`), or ``None`` for a dense one."""
    config = moe_text_config(model)
    if config is None:
        return None
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    return int(experts), int(top_k), float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The load-balancing auxiliary loss (module docstring) of one batch, in float32.

    Args:
        router_logits: one ``[tokens, num_experts]`` tensor per MoE layer, tokens in the order of
            the flattened ``[B, S]`` batch.
        num_experts, top_k: the router's ``E`` and ``k``.
        token_mask: ``[B, S]`` (or flat) 1 for real tokens, 0 for padding; ``None``: all real.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one layer")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if token_mask is None else token_mask.reshape(-1, 1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        p = torch.softmax(logits.to(device=device, dtype=torch.float32), dim=-1)
        # assignments are counted, never differentiated: one-hot of the top-k choices
        chosen = torch.zeros_like(p).scatter_(1, p.detach().topk(top_k, dim=-1).indices, 1.0)
        if mask is not None:
            if mask.shape[0] != p.shape[0]:
                raise ValueError(f"token_mask has {mask.shape[0]} tokens, the router logits {p.shape[0]}")
            chosen, p = chosen * mask, p * mask
            rows = rows + mask.sum()
        else:
            rows = rows + p.shape[0]
        counts = counts + chosen.sum(0)
        probs = probs + p.sum(0)
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def _is_router(module: nn.Module, router_class: str) -> bool:
    return type(module).__name__ == router_class


@contextlib.contextmanager
def record_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the router logits of the forwards run inside the block, one tensor per MoE layer call.

    Hooks are on the router modules themselves, so the logits are the ones the experts were routed
    with (padding-free, packed or padded alike). Leave the block before ``backward``: a gradient
    checkpoint's recompute runs the routers again, and those calls must not be recorded twice.
    A dense model records nothing.
    """
    hf_model = causal_lm_of(model)
    family = family_of(getattr(hf_model, "config", None))
    recorded: list[torch.Tensor] = []
    handles = []
    if family is not None and family.moe:
        def grab(module: nn.Module, args: tuple, output: object) -> None:
            recorded.append(output[0] if isinstance(output, tuple) else output)

        handles = [m.register_forward_hook(grab) for m in hf_model.modules() if _is_router(m, family.router_class)]
        if not handles:  # another transformers layout: say so rather than add no aux loss silently
            raise RuntimeError(f"{type(hf_model).__name__} has no {family.router_class} module to record the "
                               "router logits of (a transformers version whose MoE layout swiftune does not know)")
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def router_aux_loss(
    model: nn.Module, router_logits: Sequence[torch.Tensor], token_mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``router_aux_loss_coef * aux`` for ``model``'s recorded ``router_logits`` (what transformers adds
    to its loss with ``output_router_logits=True``), or ``None`` where there is nothing to add (a dense
    model, nothing recorded, or ``output_router_logits`` off in the config, as transformers does)."""
    settings = moe_config(model)
    config = moe_text_config(model)
    if settings is None or not router_logits or not getattr(config, "output_router_logits", False):
        return None
    num_experts, top_k, coef = settings
    return coef * load_balancing_loss(router_logits, num_experts, top_k, token_mask)
