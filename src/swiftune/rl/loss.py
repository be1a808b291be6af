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
    sapo (soft gate instead of the clip; tau = tau_pos if A_i > 0 else tau_neg):
        l_it = -sigmoid( tau (r_it - 1) ) * 4 / tau * A_i
    luspo: the clipped objective of grpo, summed over each completion (normalisation below)
    vespo (a detached gamma weight of the sequence ratio w_i = exp(sum_t m_it (logp_it - old_it))):
        phi_i = exp( lam + k log w_i - lam w_i )    (k, lam = k_pos, lam_pos if A_i >= 0 else k_neg, lam_neg;
        l_it  = -sg[phi_i] A_i logp_it               the log-ratios clamped to [-20, 20], log w_i to [log 1e-8, 20])

plus, when ``beta > 0``, the k3 estimator of KL(pi || pi_ref) (Schulman)::

        l_it += beta * ( exp(ref_it - logp_it) - (ref_it - logp_it) - 1 )

multiplied by ``r_it`` (with its gradient) when ``kl_bias_correction`` (TRL's ``use_bias_correction_kl``).

Normalisation of ``l_it`` (``m_it`` the mask; ``B`` counts masked-out completions too, as TRL)::

    grpo:     L = (1/B) sum_i [ sum_t m_it l_it / max(1, sum_t m_it) ]    per-sequence mean, batch mean
    sapo:     (same as grpo)
    luspo:    L = (1/B) sum_it m_it l_it                                  per-sequence sum, batch mean
    bnpo:     L = sum_it m_it l_it / max(1, sum_it m_it)                  tokens of this micro-batch
    dr_grpo:  L = sum_it m_it l_it / (B * max_completion_length)          a constant denominator
    dapo:     L = sum_it m_it l_it / num_items_in_batch                   tokens of the whole
    cispo, vespo: (same as dapo)                                          accumulated, global batch

``entropy_mask`` (TRL's ``top_entropy_quantile``) multiplies ``l_it`` before the KL term is added and
leaves every denominator as it is.

For grpo / bnpo / dr_grpo / sapo / luspo the trainer then averages over the micro-batches of an optimizer step
(divides by the gradient-accumulation steps); for dapo / cispo / vespo ``num_items_in_batch`` already
counts the tokens of every micro-batch on every process, so the micro-batch losses are summed
(and multiplied by the number of processes, which DDP's gradient averaging divides back out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the ones with clip_ratio/* metrics


@dataclass
class LossOutput:
    """The loss and its diagnostics (detached; NaN where not applicable).

    ``clip_low`` / ``clip_high`` / ``clip_region`` are token means (completion means at the sequence
    level), ``seq_clip_low`` / ``seq_clip_high`` ``[B]`` each completion's share of clipped tokens
    (NaN for a completion without tokens), ``phi_mean`` vespo's mean weight. ``totals`` holds, for each
    mean metric, its ``(sum, count)`` so that a trainer can reduce it over processes exactly (TRL's
    ``global_masked_mean``).
    """

    loss: torch.Tensor
    per_token_loss: torch.Tensor
    kl: torch.Tensor | None
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    clip_region: torch.Tensor
    num_tokens: torch.Tensor
    seq_clip_low: torch.Tensor | None = None
    seq_clip_high: torch.Tensor | None = None
    phi_mean: torch.Tensor | None = None
    totals: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def metrics(self, loss_type: str) -> dict[str, float]:
        """This micro-batch's metrics under TRL 1.16's names (local: not reduced over processes)."""
        out = {k: float(s / c.clamp(min=1.0)) for k, (s, c) in self.totals.items()}
        if loss_type in CLIPPED_LOSS_TYPES and self.seq_clip_low is not None:
            out["clip_ratio/low_min"] = _nan_extreme(self.seq_clip_low, min)
            out["clip_ratio/high_max"] = _nan_extreme(self.seq_clip_high, max)
        return out


def _nan_extreme(x: torch.Tensor, pick) -> float:
    vals = [v for v in x.tolist() if not math.isnan(v)]
    return float(pick(vals)) if vals else math.nan


def _per_seq_sum(x: torch.Tensor, seq_index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    return x.new_zeros(num_sequences).index_add_(0, seq_index, x)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def vespo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, advantages: torch.Tensor,
                  num_sequences: int, k_pos: float, lambda_pos: float, k_neg: float,
                  lambda_neg: float) -> torch.Tensor:
    """vespo's detached gamma weight ``phi_i = exp(lam + k log w_i - lam w_i)`` per completion ``[B]``
    (``phi(1) = 1``; the clamps of the module doc keep ``exp`` finite)."""
    with torch.no_grad():
        seq = _per_seq_sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, seq_index, num_sequences)
        log_w = torch.clamp(seq, math.log(1e-8), 20.0)
        pos = advantages.to(log_w.dtype) >= 0
        k = torch.where(pos, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
        lam = torch.where(pos, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg)).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


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
    entropy_mask: torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    kl_bias_correction: bool = False,
) -> LossOutput:
    """The policy loss of one micro-batch (formulas and normalisations: the module docstring).

    Args:
        logps: ``[N]`` float log-probs of the completion tokens under the current policy (grad).
        old_logps: ``[N]`` log-probs under the sampling policy; ``None`` = ``logps.detach()``.
        advantages: ``[B]`` one advantage per completion.
        seq_index: ``[N]`` int64, the completion (``0..B-1``) of each token.
        num_sequences: ``B`` (default ``len(advantages)``).
        loss_type: one of :data:`swiftune.rl.config.LOSS_TYPES`.
        importance_sampling_level: ``token`` or ``sequence`` (GSPO).
        epsilon, epsilon_high: clipping range ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` defaults to ``epsilon``); for cispo ``epsilon_high`` caps the weight.
        delta: upper cap of the unclipped ratio (two-sided clipping), or None.
        beta: weight of the k3 KL to ``ref_logps`` (needed when ``beta != 0``).
        mask: ``[N]`` 0/1 weights (0 drops a token, e.g. of a truncated completion); default all 1.
        max_completion_length: the denominator of ``dr_grpo``.
        num_items_in_batch: the denominator of ``dapo`` / ``cispo`` / ``vespo`` (default: this
            micro-batch's token count, which makes them equal to ``bnpo`` on a single micro-batch).
        entropy_mask: ``[N]`` 0/1, the tokens whose policy term counts (``top_entropy_quantile``).
        sapo_temperature_pos, sapo_temperature_neg: sapo's gate temperatures (TRL's defaults).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: vespo's gamma shape (TRL's defaults).
        kl_bias_correction: multiply the k3 KL by the importance ratio ``r_it`` (with its gradient;
            TRL's ``use_bias_correction_kl``): an unbiased KL estimate on reused (off-policy) rollouts.
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

    phi = None
    if loss_type == "cispo":
        per_token = -torch.clamp(coef1, max=eps_h).detach() * adv * logps
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, sapo_temperature_pos), torch.full_like(adv, sapo_temperature_neg))
        per_token = -(torch.sigmoid(tau * (coef1 - 1)) * 4 / tau) * adv
    elif loss_type == "vespo":
        phi = vespo_weights(log_ratio, m, seq_index, advantages, B, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                            vespo_lambda_neg)
        per_token = -phi.index_select(0, seq_index) * adv * logps
    else:
        coef2 = torch.clamp(coef1, 1 - epsilon, 1 + eps_h)
        capped = torch.clamp(coef1, max=delta) if delta is not None else coef1
        per_token = -torch.min(capped * adv, coef2 * adv)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(per_token.dtype)

    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        per_token_kl = k3_kl(logps, ref_logps)
        if kl_bias_correction:
            per_token_kl = per_token_kl * coef1
        per_token = per_token + beta * per_token_kl
    else:
        per_token_kl = None

    weighted = per_token * m
    total_tokens = m.sum()
    if loss_type in ("grpo", "sapo"):
        loss = (_per_seq_sum(weighted, seq_index, B) / ntok_seq.clamp(min=1.0)).sum() / max(B, 1)
    elif loss_type == "luspo":
        loss = weighted.sum() / max(B, 1)
    elif loss_type == "bnpo":
        loss = weighted.sum() / total_tokens.clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        loss = weighted.sum() / (B * max_completion_length)
    else:  # dapo, cispo, vespo
        denom = total_tokens.clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
        loss = weighted.sum() / denom
    return _diagnostics(loss, per_token, per_token_kl, coef1.detach(), advantages, adv, m, seq_index, ntok_seq, B,
                        loss_type, importance_sampling_level, epsilon, eps_h, phi)


def _diagnostics(loss, per_token, per_token_kl, w, advantages, adv, m, seq_index, ntok_seq, B, loss_type, level,
                 epsilon, eps_h, phi) -> LossOutput:
    """TRL 1.16's loss metrics: token means of the clip indicators (completion means at the sequence
    level, where one ratio stands for a whole completion), per-completion clip shares for
    ``clip_ratio/low_min`` / ``high_max``, the token mean of the k3 KL."""
    with torch.no_grad():
        total_tokens = m.sum()
        has_tokens = (ntok_seq > 0).to(m.dtype)

        def token_total(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (x.to(m.dtype) * m).sum(), total_tokens

        def seq_share(x: torch.Tensor) -> torch.Tensor:  # [B] share of each completion's tokens; NaN: none
            share = _per_seq_sum(x.to(m.dtype) * m, seq_index, B) / ntok_seq.clamp(min=1.0)
            return torch.where(ntok_seq > 0, share, torch.full_like(share, math.nan))

        if level == "sequence":  # one ratio per completion: count completions (TRL)
            seq_w = w.new_zeros(B).index_copy_(0, seq_index, w)
            a, x_w = advantages.to(w.dtype), seq_w

            def total(cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return (cond.to(m.dtype) * has_tokens).sum(), has_tokens.sum()

            def per_seq(cond: torch.Tensor) -> torch.Tensor:
                return torch.where(ntok_seq > 0, cond.to(m.dtype), torch.full_like(ntok_seq, math.nan))
        else:
            a, x_w, total, per_seq = adv, w, token_total, seq_share
        totals: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        seq_low = seq_high = phi_mean = None
        zero = total_tokens.new_zeros(())
        low = high = region = zero
        if loss_type == "cispo":
            totals["cispo_clip_ratio"] = total((x_w > eps_h) & (a > 0))
            high = totals["cispo_clip_ratio"][0] / totals["cispo_clip_ratio"][1].clamp(min=1.0)
        elif loss_type in CLIPPED_LOSS_TYPES:
            low_c, high_c = (x_w < 1 - epsilon) & (a < 0), (x_w > 1 + eps_h) & (a > 0)
            for name, cond in (("low", low_c), ("high", high_c), ("region", low_c | high_c)):
                totals[f"clip_ratio/{name}_mean"] = total(cond)
            low, high, region = (totals[f"clip_ratio/{k}_mean"][0] / totals[f"clip_ratio/{k}_mean"][1].clamp(min=1.0)
                                 for k in ("low", "high", "region"))
            seq_low, seq_high = per_seq(low_c), per_seq(high_c)
        elif loss_type == "vespo":
            totals["vespo/phi_seq_mean"] = ((phi * has_tokens).sum(), has_tokens.sum())
            phi_mean = totals["vespo/phi_seq_mean"][0] / has_tokens.sum().clamp(min=1.0)
        kl_mean = None
        if per_token_kl is not None:
            totals["kl"] = token_total(per_token_kl.detach())
            kl_mean = totals["kl"][0] / total_tokens.clamp(min=1.0)
    return LossOutput(loss, per_token, kl_mean, low, high, region, total_tokens.detach(), seq_low, seq_high, phi_mean,
                      totals)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float,
                      values: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's ``top_entropy_quantile``: 1 for the (masked-in) tokens whose entropy is at least the
    ``1 - top_quantile`` quantile of ``values`` (default: the masked-in tokens' entropies; a trainer
    passes every process's), 0 elsewhere. ``top_quantile=0.2`` keeps the 20% most uncertain tokens."""
    with torch.no_grad():
        keep = mask > 0
        values = entropy[keep].float() if values is None else values.float()
        if values.numel() == 0:
            return torch.zeros_like(mask, dtype=entropy.dtype)
        threshold = torch.quantile(values, 1.0 - top_quantile)
        return ((entropy.float() >= threshold) & keep).to(entropy.dtype)
