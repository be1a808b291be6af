"""Drawing the next token from logits, shared by both rollout engines.

The order is transformers' ``generate``: the repetition penalty first
(:func:`apply_repetition_penalty`, transformers' ``RepetitionPenaltyLogitsProcessor``, a logits
processor applied also when decoding greedily), then the sampling warpers: temperature, top-k,
top-p and min-p (:func:`filter_logits`), then a draw from the renormalised distribution. The
log-probability recorded for each token is under exactly that processed distribution
(temperature 0: greedy, log-probs of the penalised logits at temperature 1).

The penalty reads a ``seen [rows, vocab]`` bool mask (:func:`seen_mask`: the prompt's tokens,
then :func:`mark_seen` adds each sampled token in place), not a growing list of ids, so a decode
step keeps static shapes and can be a CUDA graph.
:func:`sample_next` draws with ``torch.multinomial``; :func:`sample_tokens` with Gumbel noise
drawn beforehand into a static buffer (the same distribution, with static shapes and no random
number generation inside the step, so the step can be a CUDA graph).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .protocol import SamplingParams

logger = logging.getLogger(__name__)


class SamplingStream:
    """An engine's random stream for its draws: one generator, seeded with ``seed`` on the device it is
    first asked for (a new one, seeded again, when the device changes), so that the same seed samples the
    same rollouts. :meth:`state` / :meth:`resume_from` carry it through a GRPO checkpoint, so that a resumed
    run samples the completions the uninterrupted run samples."""

    def __init__(self, seed: int):
        self.seed = seed
        self._generator: torch.Generator | None = None
        self._resumed: torch.Tensor | None = None

    def on(self, device: torch.device) -> torch.Generator:
        """The generator on ``device``, continued from a resumed state at its first use after a resume."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        if self._resumed is not None:
            restore_generator_state(self._generator, self._resumed)
            self._resumed = None
        return self._generator

    def state(self) -> torch.Tensor | None:
        """The stream's state (None before the first draw)."""
        return None if self._generator is None else self._generator.get_state()

    def resume_from(self, state: torch.Tensor) -> None:
        """Continue from ``state`` (:meth:`state` of a checkpoint) at the next draw."""
        self._resumed = state


def restore_generator_state(generator: torch.Generator, state: torch.Tensor) -> bool:
    """Put ``state`` (``generator.get_state()`` of a checkpoint) into ``generator``; a state of another
    kind of device (a GPU run's checkpoint resumed on CPU) cannot be: a warning, and the seeded stream."""
    try:
        generator.set_state(state.to("cpu", torch.uint8))
    except (RuntimeError, ValueError) as e:
        logger.warning("swiftune: the rollout engine's saved random state does not fit its %s generator (%s): "
                       "sampling continues from the seed, so completions after the resume differ from the "
                       "uninterrupted run's", generator.device.type, str(e).splitlines()[0][:120])
        return False
    return True


def seen_mask(rows: Sequence[Sequence[int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """``[len(rows), vocab]`` bool: ``True`` where a token occurs in that row (ids ``>= vocab`` are left out:
    the model cannot emit them, and transformers' processor drops them the same way)."""
    mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    ids = torch.tensor([int(t) for row in rows for t in row], dtype=torch.long, device=device)
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device),
                                     torch.tensor([len(row) for row in rows], device=device))
    keep = (ids >= 0) & (ids < vocab)
    mask[row_of[keep], ids[keep]] = True
    return mask


def mark_seen(seen: torch.Tensor, tokens: torch.Tensor) -> None:
    """Add each row's new token ``tokens [rows]`` (ids in ``[0, vocab)``) to ``seen [rows, vocab]``, in place."""
    seen.scatter_(1, tokens[:, None], True)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` on a seen mask: each token already in the row
    (prompt or completion so far) has its logit divided by ``penalty`` when positive and multiplied by
    it when negative (``penalty > 1`` makes repeats less likely); other logits are unchanged. Returns
    ``logits`` itself when there is no penalty, else a new tensor."""
    if seen is None or penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


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
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [B, V]``; returns ``(tokens [B], logprobs [B])`` (float32).

    ``seen [B, V]``: the tokens of each row so far, for ``params.repetition_penalty`` (``None``: no penalty).
    """
    logits = apply_repetition_penalty(logits.float(), seen, getattr(params, "repetition_penalty", 1.0))
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
    seen: torch.Tensor | None = None, repetition_penalty: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` (float32) and its sampling log-prob (static shapes, no sync).

    The repetition penalty is applied first (``seen [B, V]``, :func:`apply_repetition_penalty`).
    ``temperature == 0``: argmax, log-prob under ``softmax(logits)``. Otherwise the logits are divided
    by the temperature and filtered (top-k, top-p, min-p), and the token is ``argmax(logp + g)`` with
    Gumbel noise ``g = -log(-log u)`` from ``uniform [B, V]`` in [0, 1): an exact draw from the
    filtered distribution ``softmax(logp)``.
    """
    logits = apply_repetition_penalty(logits.float(), seen, repetition_penalty)
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logp = torch.log_softmax(filter_logits(logits / temperature, top_k, top_p, min_p), dim=-1)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
        tokens = (logp + gumbel).argmax(dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
