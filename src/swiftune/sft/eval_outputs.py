"""What SFT evaluation computes beyond the loss: TRL's ``mean_token_accuracy`` and, for a
``compute_metrics`` function, the logits.

Training never holds the ``[tokens, vocab]`` logits (the fused loss projects chunk by chunk), so:

* ``mean_token_accuracy`` (the share of trained tokens whose label is the arg-max of the logits)
  is counted in evaluation only, chunk by chunk from the last hidden states: one more projection
  of the labelled tokens per evaluation batch, never the whole logits. In training it would cost
  that projection at every micro-batch (the fused loss does not return the arg-max), so training
  does not log it (docs/trl_compat.md).
* ``compute_metrics`` gets what transformers' ``Trainer`` gives it: ``EvalPrediction(predictions=
  logits, label_ids=labels)``, with ``preprocess_logits_for_metrics(logits, labels)`` applied per
  batch. Those logits are built in evaluation only, per batch, ``[rows, length, vocab]`` in the
  head's dtype (TRL 1.16 recomputes them with an extra forward pass; here they come from the same
  forward as the loss): use ``preprocess_logits_for_metrics`` (e.g. an arg-max) to keep only what
  the metric needs. ``labels`` are unshifted (``labels[t]`` is predicted at ``t - 1``), ``-100``
  where untrained and on the first token of every document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACCURACY_CHUNK_TOKENS = 4096  # labelled tokens projected at once: [chunk, vocab] float logits at most


@torch.no_grad()
def token_accuracy_counts(hidden: torch.Tensor, lm_head: nn.Module, shift_labels: torch.Tensor,
                          ignore_index: int = -100) -> tuple[int, int]:
    """``(correct, labelled)``: labelled positions whose arg-max logit is the label.

    ``hidden`` is ``[..., H]`` and ``shift_labels`` its aligned targets (already shifted). A logit
    soft-cap is monotonic, so the arg-max of the raw projection is the model's.
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = shift_labels.reshape(-1)
    rows = (flat_y != ignore_index).nonzero().squeeze(1)
    correct = 0
    for start in range(0, rows.numel(), ACCURACY_CHUNK_TOKENS):
        idx = rows[start:start + ACCURACY_CHUNK_TOKENS]
        logits = F.linear(flat_h.index_select(0, idx), lm_head.weight, lm_head.bias)
        correct += int((logits.argmax(dim=-1) == flat_y.index_select(0, idx)).sum())
    return correct, int(rows.numel())


@torch.no_grad()
def full_logits(hidden: torch.Tensor, lm_head: nn.Module, softcap: float | None) -> torch.Tensor:
    """The model's logits ``[..., vocab]`` from its last hidden states (evaluation only), with the
    final logit soft-cap where the model has one (Gemma 2), as its own forward computes them."""
    logits = lm_head(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
