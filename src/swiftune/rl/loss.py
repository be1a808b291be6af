r"""The GRPO policy loss and its variants, on flat (packed, padding-free) per-token tensors.

Notation. A micro-batch holds ``B`` completions; completion ``i`` has ``|o_i|`` tokens (those
with ``mask = 1``), advantage ``A_i`` and per-token log-probs ``logp_it`` (current policy, with
gradient), ``old_it`` (the policy that sampled the rollouts; equal to ``logp_it.detach()`` when
each generation is used for one optimizer step) and ``ref_it`` (reference policy, for the KL).
Every input is a flat ``[N]`` vector over the completion tokens of the micro-batch plus
``seq_index [N]`` (which completion a token belongs to), so the loss needs no padding.

Importance ratio::

    token    (GRPO):  r_it = exp(logp_it - old_it)
    sequence (GSPO):  r_it = r_i = exp( (1/|o_i|) sum_t (logp_it - old_it) )      for every t

Per-token objective (``eps_l = epsilon``, ``eps_h = epsilon_high``)::

    grpo / bnpo / dr_grpo / dapo:
        l_it = -min( min(r_it, delta) A_i,  clip(r_it, 1 - eps_l, 1 + eps_h) A_i )
        (the min(., delta) cap only when ``delta`` is set: two-sided clipping, INTELLECT-2)
    cispo (MiniMax-M1):
        l_it = -sg[ min(r_it, eps_h) ] A_i logp_it          (sg = stop-gradient)

plus, when ``beta > 0``, the k3 estimator of KL(pi || pi_ref) (Schulman)::

        l_it += beta * ( exp(ref_it - logp_it) - (ref_it - logp_it) - 1 )

Normalisation of ``l_it`` (``m_it`` the mask; ``B`` counts masked-out completions too, as TRL)::

    grpo:     L = (1/B) sum_i [ sum_t m_it l_it / max(1, sum_t m_it) ]    per-sequence mean, batch mean
    bnpo:     L = sum_it m_it l_it / max(1, sum_it m_it)                  tokens of this micro-batch
    dr_grpo:  L = sum_it m_it l_it / (B * max_completion_length)          a constant denominator
    dapo:     L = sum_it m_it l_it / num_items_in_batch                   tokens of the whole
    cispo:    (same as dapo)                                              accumulated, global batch

For grpo / bnpo / dr_grpo the trainer then averages over the micro-batches of an optimizer step
(divides by the gradient-accumulation steps); for dapo / cispo ``num_items_in_batch`` already
counts the tokens of every micro-batch on every process, so the micro-batch losses are summed
(and multiplied by the number of processes, which DDP's gradient averaging divides back out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES


@dataclass
class LossOutput:
    """The loss and its diagnostics (detached scalars; NaN where not applicable)."""

    loss: torch.Tensor
    per_token_loss: torch.Tensor
    kl: torch.Tensor | None
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    clip_region: torch.Tensor
    num_tokens: torch.Tensor

    def metrics(self, loss_type: str) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.kl is not None:
            out["kl"] = float(self.kl)
        if loss_type == "cispo":
            out["cispo_clip_ratio"] = float(self.clip_high)
        else:
            out["clip_ratio/low_mean"] = float(self.clip_low)
            out["clip_ratio/high_mean"] = float(self.clip_high)
            out["clip_ratio/region_mean"] = float(self.clip_region)
        return out


def _per_seq_sum(x: torch.Tensor, seq_index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    return x.new_zeros(num_sequences).index_add_(0, seq_index, x)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    *,
    num_sequences: int | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> LossOutput:
    """The policy loss of one micro-batch (formulas and normalisations: the module docstring).

    Args:
        logps: ``[N]`` float log-probs of the completion tokens under the current policy (grad).
        old_logps: ``[N]`` log-probs under the sampling policy; ``None`` = ``logps.detach()``.
        advantages: ``[B]`` one advantage per completion.
        seq_index: ``[N]`` int64, the completion (``0..B-1``) of each token.
        num_sequences: ``B`` (default ``len(advantages)``).
        loss_type: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` or ``cispo``.
        importance_sampling_level: ``token`` or ``sequence`` (GSPO).
        epsilon, epsilon_high: clipping range ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` defaults to ``epsilon``); for cispo ``epsilon_high`` caps the weight.
        delta: upper cap of the unclipped ratio (two-sided clipping), or None.
        beta: weight of the k3 KL to ``ref_logps`` (needed when ``beta != 0``).
        mask: ``[N]`` 0/1 weights (0 drops a token, e.g. of a truncated completion); default all 1.
        max_completion_length: the denominator of ``dr_grpo``.
        num_items_in_batch: the denominator of ``dapo`` / ``cispo`` (default: this micro-batch's
            token count, which makes them equal to ``bnpo`` on a single micro-batch).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}")
    if logps.dim() != 1 or seq_index.shape != logps.shape:
        raise ValueError(f"logps and seq_index must be flat [N] tensors, got {tuple(logps.shape)}, "
                         f"{tuple(seq_index.shape)}")
    B = int(num_sequences if num_sequences is not None else advantages.numel())
    eps_h = epsilon if epsilon_high is None else epsilon_high
    if old_logps is None:
        old_logps = logps.detach()
    m = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).index_select(0, seq_index)
    ntok_seq = _per_seq_sum(m, seq_index, B)

    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":
        seq_log_ratio = _per_seq_sum(log_ratio * m, seq_index, B) / ntok_seq.clamp(min=1.0)
        log_w = seq_log_ratio.index_select(0, seq_index)
    else:
        log_w = log_ratio
    coef1 = torch.exp(log_w)

    if loss_type == "cispo":
        per_token = -torch.clamp(coef1, max=eps_h).detach() * adv * logps
    else:
        coef2 = torch.clamp(coef1, 1 - epsilon, 1 + eps_h)
        capped = torch.clamp(coef1, max=delta) if delta is not None else coef1
        per_token = -torch.min(capped * adv, coef2 * adv)

    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        per_token_kl = k3_kl(logps, ref_logps)
        per_token = per_token + beta * per_token_kl
    else:
        per_token_kl = None

    weighted = per_token * m
    total_tokens = m.sum()
    if loss_type == "grpo":
        loss = (_per_seq_sum(weighted, seq_index, B) / ntok_seq.clamp(min=1.0)).sum() / max(B, 1)
    elif loss_type == "bnpo":
        loss = weighted.sum() / total_tokens.clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        loss = weighted.sum() / (B * max_completion_length)
    else:  # dapo, cispo
        denom = total_tokens.clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
        loss = weighted.sum() / denom

    with torch.no_grad():
        denom_t = total_tokens.clamp(min=1.0)

        def token_mean(x: torch.Tensor) -> torch.Tensor:
            return (x.to(m.dtype) * m).sum() / denom_t

        if importance_sampling_level == "sequence":  # one ratio per completion: count completions (TRL)
            seq_w = coef1.new_zeros(B).index_copy_(0, seq_index, coef1.detach())
            seq_adv = advantages.to(coef1.dtype)
            has_tokens = (ntok_seq > 0).to(m.dtype)

            def frac(cond: torch.Tensor) -> torch.Tensor:
                return (cond.to(m.dtype) * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)

            w, a = seq_w, seq_adv
        else:
            frac, w, a = token_mean, coef1.detach(), adv
        if loss_type == "cispo":
            high = frac((w > eps_h) & (a > 0))
            low = torch.zeros_like(high)
        else:
            low_c = (w < 1 - epsilon) & (a < 0)
            high_c = (w > 1 + eps_h) & (a > 0)
            low, high = frac(low_c), frac(high_c)
        region = low + high
        kl_mean = token_mean(per_token_kl.detach()) if per_token_kl is not None else None
    return LossOutput(loss, per_token, kl_mean, low, high, region, total_tokens.detach())
