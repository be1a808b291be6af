"""Drawing the next token from logits, shared by both rollout engines.

Temperature first, then top-k, top-p and min-p filtering (:func:`filter_logits`), then a draw
from the renormalised distribution; the log-probability recorded for each token is under exactly
that filtered, temperature-scaled distribution (temperature 0: greedy, log-probs at temperature 1).
:func:`sample_next` draws with ``torch.multinomial``; :func:`sample_tokens` with Gumbel noise
drawn beforehand into a static buffer (the same distribution, with static shapes and no random
number generation inside the step, so the step can be a CUDA graph).
"""

from __future__ import annotations

import torch

from .protocol import SamplingParams


def seeded_generator(current: torch.Generator | None, device: torch.device, seed: int) -> torch.Generator:
    """``current`` if it already lives on ``device``, else a new generator there seeded with ``seed``:
    an engine keeps one random stream per device, so that the same seed samples the same rollouts."""
    if current is not None and current.device == device:
        return current
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float = 1.0, min_p: float | None = None
) -> torch.Tensor:
    """Set to ``-inf`` the logits outside top-k, outside the top-p nucleus, or below ``min_p`` x max prob.

    ``logits`` ``[B, V]`` float (already divided by the temperature); returns a new tensor. The
    most likely token always survives.
    """
    out = logits.clone()
    vocab = out.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out.masked_fill_(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = before >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        out.masked_fill_(drop, float("-inf"))
    if min_p is not None and min_p > 0:
        probs = torch.softmax(out, dim=-1)
        out.masked_fill_(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return out


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [B, V]``; returns ``(tokens [B], logprobs [B])`` (float32)."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
        logp = torch.log_softmax(scaled, dim=-1)
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def sample_tokens(
    logits: torch.Tensor, uniform: torch.Tensor | None, temperature: float,
    top_k: int | None = None, top_p: float = 1.0, min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` (float32) and its sampling log-prob (static shapes, no sync).

    ``temperature == 0``: argmax, log-prob under ``softmax(logits)``. Otherwise the logits are divided
    by the temperature and filtered (top-k, top-p, min-p), and the token is ``argmax(logp + g)`` with
    Gumbel noise ``g = -log(-log u)`` from ``uniform [B, V]`` in [0, 1): an exact draw from the
    filtered distribution ``softmax(logp)``.
    """
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logp = torch.log_softmax(filter_logits(logits / temperature, top_k, top_p, min_p), dim=-1)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
        tokens = (logp + gumbel).argmax(dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
