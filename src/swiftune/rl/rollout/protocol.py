"""The rollout interface: what the GRPO trainer asks of a generation backend, and what it gets back.

:class:`RolloutEngine` is a ``typing.Protocol``: anything with a
``generate(prompt_ids, num_generations, params)`` method returning :class:`Rollouts`, plus a
``load_weights(model)`` hook called after every optimizer step that changed the policy (a
no-op for an engine that samples from the training model itself; an engine holding its own copy
of the weights, such as a vLLM server, pushes them there). docs/grpo.md says what a vLLM
engine needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@dataclass
class SamplingParams:
    """How to sample (the fields vLLM's ``SamplingParams`` calls the same)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: Sequence[int] = ()
    # transformers' / vLLM's repetition penalty over the prompt and the completion so far (1.0: off)
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_sampling_values(self.max_tokens, self.temperature, self.top_p, self.top_k, self.min_p,
                              self.repetition_penalty)


def check_sampling_values(max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, min_p: Any,
                          repetition_penalty: Any = 1.0) -> None:
    """Refuse sampling values no engine can honour, naming the value and what to set (a ``ValueError``):
    values out of range were taken silently (a negative temperature as greedy, ``top_p`` above 1 as off) or
    ended in a library's error deep in the first step."""
    def bad(name: str, value: Any, rule: str, hint: str) -> ValueError:
        return ValueError(f"{name}={value!r} {rule}; {hint}")

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens", max_tokens, "must be a whole number >= 1", "set the most tokens to sample, e.g. 256")
    if not number(temperature) or temperature < 0:
        raise bad("temperature", temperature, "must be a finite number >= 0", "0 samples greedily, 1.0 plainly")
    if not number(top_p) or not 0 < top_p <= 1:
        raise bad("top_p", top_p, "must be in (0, 1]", "1.0 turns it off")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise bad("top_k", top_k, "must be a whole number >= 1, or None, 0 or -1 (vLLM's) for off", "e.g. 50")
    if min_p is not None and (not number(min_p) or not 0 <= min_p <= 1):
        raise bad("min_p", min_p, "must be in [0, 1] or None", "0 or None turns it off")
    if not number(repetition_penalty) or repetition_penalty <= 0:
        # the penalty divides positive and multiplies negative logits of seen tokens
        raise bad("repetition_penalty", repetition_penalty, "must be a finite number > 0 (1.0: off; above 1.0, "
                  "e.g. 1.1, discourages repeats; below 1.0 favours them)", "set e.g. 1.1")


def check_num_generations(num_generations: Any) -> None:
    """Refuse fewer than one completion per prompt (a ``ValueError`` naming the value)."""
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations={num_generations!r} must be a whole number >= 1 (completions per prompt)")


@dataclass
class Rollouts:
    """Completions of ``P`` prompts x ``G`` generations, prompt-major (``i = p * G + g``).

    Attributes:
        completion_ids: token ids of each completion, the stop token included when one was emitted.
        logprobs: the sampling log-probability of each emitted token (float32 tensors).
        finished: whether the completion ended with a stop token (False: cut at ``max_tokens``).
    """

    completion_ids: list[list[int]]
    logprobs: list[torch.Tensor]
    finished: list[bool]
    num_generations: int = 1
    stats: dict[str, float] = field(default_factory=dict)


def check_prompts(prompt_ids: Sequence[Sequence[int]], num_generations: int | None = None) -> None:
    """Refuse an empty prompt (sampling needs at least one token to condition on) and, when given, a
    ``num_generations`` below 1."""
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    if num_generations is not None:
        check_num_generations(num_generations)


@runtime_checkable
class RolloutEngine(Protocol):
    """What :class:`swiftune.GRPOTrainer` needs from a generation backend."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, params: SamplingParams) -> Rollouts:
        """Sample ``num_generations`` completions of every prompt (prompt-major order)."""
        ...

    def load_weights(self, model: nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (called after optimizer steps)."""
        ...
