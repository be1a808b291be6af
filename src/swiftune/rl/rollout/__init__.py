"""Rollouts: prompt token ids in, sampled completion ids and their sampling log-probs out.

The package holds the interface and both engines that implement it:

* :mod:`.protocol`: :class:`RolloutEngine` (what the trainer calls), :class:`SamplingParams`,
  :class:`Rollouts`;
* :mod:`.sampling`: filtering and drawing the next token, shared by the engines;
* this module: :class:`TransformersRolloutEngine`, sampling through transformers' own forward and
  KV cache (any causal LM);
* :mod:`.fast`: :class:`~swiftune.rl.rollout.fast.FastRolloutEngine`, a static KV cache and the
  decode step as CUDA graphs, for the supported families; its cache and per-call state in
  :mod:`.kv_cache`, its fused layer loop in :mod:`.layers`, its CUDA graphs in :mod:`.cuda_graphs`.

:class:`TransformersRolloutEngine` samples from the training model itself (same weights in
memory, LoRA adapters applied by the PEFT forward) with transformers' KV cache:

* each distinct prompt is prefilled **once** (left-padded batch), then its cache rows are repeated
  ``num_generations`` times (``DynamicCache.batch_repeat_interleave``);
* decoding is batched; a finished row (stop token emitted) leaves the batch
  (``DynamicCache.batch_select_indices``), so long tails do not keep computing finished rows;
* sampling (:func:`~swiftune.rl.rollout.sampling.sample_next`) with a seeded ``torch.Generator``,
  the repetition penalty over the prompt and the tokens sampled so far (a ``seen`` mask per row);
* it runs under ``torch.no_grad()`` with the model in eval mode (no dropout; gradient
  checkpointing is inactive in eval mode) and restores the training mode afterwards, so no
  autograd graph or training activation is kept; the KV cache is freed when it returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...models.patching import causal_lm_of
from .protocol import RolloutEngine, Rollouts, SamplingParams, check_prompts
from .sampling import SamplingStream, filter_logits, mark_seen, sample_next, sample_tokens, seen_mask

if TYPE_CHECKING:
    from transformers import DynamicCache


def cache_kwarg(model: nn.Module) -> str:
    """The name of the KV-cache argument of ``model``'s forward (``cache`` in newer transformers)."""
    params = inspect.signature(causal_lm_of(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_supports(cache: object, method: str) -> bool:
    """Whether the KV cache has ``method`` (``batch_repeat_interleave`` / ``batch_select_indices``)."""
    return callable(getattr(cache, method, None))


def new_cache(model: nn.Module) -> DynamicCache:
    """An empty transformers ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=causal_lm_of(model).config)
    except TypeError:  # pragma: no cover - older signature
        return DynamicCache()


class TransformersRolloutEngine:
    """Batched KV-cache sampling from the training model itself (see the module docstring).

    Args:
        model: the policy (a transformers causal LM or a PEFT model); not copied.
        pad_token_id: filler for left padding (never attended to).
        seed: seed of the engine's ``torch.Generator``; the same seed and calls give the same samples.
        max_batch_size: most completions decoded at once (None: all of a call).
    """

    def __init__(self, model: nn.Module, pad_token_id: int = 0, seed: int = 0, max_batch_size: int | None = None):
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.seed = seed
        self.max_batch_size = max_batch_size
        self._stream = SamplingStream(seed)
        self._cache_arg = cache_kwarg(model)

    def load_weights(self, model: nn.Module) -> None:
        """The engine samples from the training model itself: nothing to copy."""
        self.model = model

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generator(self) -> torch.Generator:
        return self._stream.on(self._device())

    def rng_state(self) -> torch.Tensor | None:
        """The sampling stream's state (None before the first draw): GRPO checkpoints store it."""
        return self._stream.state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Continue the sampling stream from ``state`` (:meth:`rng_state` of a checkpoint), from the next draw."""
        self._stream.resume_from(state)

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, params: SamplingParams) -> Rollouts:
        if not prompt_ids:
            return Rollouts([], [], [], num_generations)
        check_prompts(prompt_ids, num_generations)
        per_chunk = len(prompt_ids) if self.max_batch_size is None else max(1, self.max_batch_size // num_generations)
        out = Rollouts([], [], [], num_generations)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for a in range(0, len(prompt_ids), per_chunk):
                    ids, logps, done, steps = self._generate_chunk(prompt_ids[a:a + per_chunk], num_generations, params)
                    out.completion_ids += ids
                    out.logprobs += logps
                    out.finished += done
                    out.stats["decode_steps"] = out.stats.get("decode_steps", 0.0) + steps
        finally:
            self.model.train(was_training)
        return out

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=True, logits_to_keep=1, **{self._cache_arg: cache},
        )
        return out.logits[:, -1, :]

    def _first_decode_positions(self, prompt_positions: torch.Tensor) -> torch.Tensor:
        """The position ``[rows, 1]`` of each row's first decoded token, from its prompt's
        left-padded text positions ``[rows, width]`` (already repeated for the group); engines whose
        positions are not the text ones (multimodal RoPE) shift them per row."""
        return prompt_positions[:, -1:] + 1

    def _generate_chunk(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> tuple[list[list[int]], list[torch.Tensor], list[bool], int]:
        device = self._device()
        gen = self.generator()
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long, device=device)
            mask[r, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = new_cache(self.model)
        if n > 1 and not cache_supports(cache, "batch_repeat_interleave"):  # older cache API: prefill every copy
            ids, mask, pos = (t.repeat_interleave(n, dim=0) for t in (ids, mask, pos))
            n_after = 1
        else:
            n_after = n
        logits = self._forward(ids, mask, pos, cache)
        # the repetition penalty's tokens so far, per batch row: the prompt's (no padding), then each sample's
        seen = (seen_mask([p for p in prompts for _ in range(n // n_after)], logits.shape[-1], device)
                if getattr(params, "repetition_penalty", 1.0) != 1.0 else None)
        if n_after > 1:  # one prefill per distinct prompt, its cache shared by the group's rows
            cache.batch_repeat_interleave(n_after)
            logits = logits.repeat_interleave(n_after, dim=0)
            mask = mask.repeat_interleave(n_after, dim=0)
            pos = pos.repeat_interleave(n_after, dim=0)
            seen = seen.repeat_interleave(n_after, dim=0) if seen is not None else None
        can_prune = cache_supports(cache, "batch_select_indices")
        rows = logits.shape[0]
        stop = torch.as_tensor(sorted(set(int(s) for s in params.stop_token_ids)), dtype=torch.long, device=device)
        tokens_out = torch.full((rows, params.max_tokens), -1, dtype=torch.long, device=device)
        logps_out = torch.zeros((rows, params.max_tokens), dtype=torch.float32, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        active = torch.arange(rows, device=device)  # original row of each row still in the batch
        alive = torch.ones(rows, dtype=torch.bool, device=device)  # rows of the batch still sampling
        next_pos = self._first_decode_positions(pos)
        steps = 0
        for step in range(params.max_tokens):
            tok, lp = sample_next(logits, params, gen, seen)
            if seen is not None:
                mark_seen(seen, tok)
            rec = active[alive]
            tokens_out[rec, step] = tok[alive]
            logps_out[rec, step] = lp[alive]
            lengths[rec] += 1
            steps += 1
            hit = (torch.isin(tok, stop) if stop.numel() else torch.zeros_like(tok, dtype=torch.bool)) & alive
            finished[active[hit]] = True
            alive = alive & ~hit
            if step + 1 == params.max_tokens:
                break
            keep = alive.nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            if can_prune and keep.numel() < active.numel():  # finished rows leave the batch
                cache.batch_select_indices(keep)
                active, tok, alive = active[keep], tok[keep], alive[keep]
                mask, next_pos = mask[keep], next_pos[keep]
                seen = seen[keep] if seen is not None else None
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = self._forward(tok[:, None], mask, next_pos, cache)
            next_pos = next_pos + 1
        del cache
        lengths_l = lengths.tolist()
        toks = tokens_out.cpu()
        lps = logps_out.cpu()
        return ([toks[r, :lengths_l[r]].tolist() for r in range(rows)],
                [lps[r, :lengths_l[r]].clone() for r in range(rows)],
                finished.cpu().tolist(), steps)


# The fast engine imports the protocol and sampling modules, not this one, so importing it last
# is safe; it is re-exported so that ``swiftune.rl.rollout`` names every engine.
from .fast import FastRolloutEngine, FastSamplingParams  # noqa: E402

__all__ = [
    "FastRolloutEngine",
    "FastSamplingParams",
    "RolloutEngine",
    "Rollouts",
    "SamplingParams",
    "TransformersRolloutEngine",
    "cache_kwarg",
    "cache_supports",
    "filter_logits",
    "mark_seen",
    "new_cache",
    "sample_next",
    "sample_tokens",
    "seen_mask",
]
