"""What SFT evaluation gives a ``compute_metrics`` function beyond the loss: the logits.

Training never holds the ``[tokens, vocab]`` logits (the fused loss projects chunk by chunk; TRL's
``mean_token_accuracy`` and ``entropy`` come from that loss's per-token side outputs, see
``losses.linear_cross_entropy(return_token_stats=True)``). ``compute_metrics`` gets what
transformers' ``Trainer`` gives it: ``EvalPrediction(predictions=logits, label_ids=labels)``, with
``preprocess_logits_for_metrics(logits, labels)`` applied per batch. Those logits are built in
evaluation only, per batch, ``[rows, length, vocab]`` in the head's dtype (TRL 1.16 recomputes them
with an extra forward pass; here they come from the same forward as the loss): use
``preprocess_logits_for_metrics`` (e.g. an arg-max) to keep only what the metric needs. ``labels``
are unshifted (``labels[t]`` is predicted at ``t - 1``), ``-100`` where untrained and on the first
token of every document.
"""

from __future__ import annotations

import torch
from torch import nn

@torch.no_grad()
def full_logits(hidden: torch.Tensor, lm_head: nn.Module, softcap: float | None) -> torch.Tensor:
    """The model's logits ``[..., vocab]`` from its last hidden states (evaluation only), with the
    final logit soft-cap where the model has one (Gemma 2), as its own forward computes them."""
    logits = lm_head(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
