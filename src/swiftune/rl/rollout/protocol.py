"""The rollout interface: what the GRPO trainer asks of a generation backend, and what it gets back.

:class:`RolloutEngine` is a ``typing.Protocol``: anything with a
``generate(prompt_ids, num_generations, params)`` method returning :class:`Rollouts`, plus a
``load_weights(model)`` hook called after every optimizer step that changed the policy (a
no-op for an engine that samples from the training model itself; an engine holding its own copy
of the weights, such as a vLLM server, pushes them there). docs/grpo.md says what a vLLM
engine needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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


def check_prompts(prompt_ids: Sequence[Sequence[int]]) -> None:
    """Refuse an empty prompt: sampling needs at least one token to condition on."""
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")


@runtime_checkable
class RolloutEngine(Protocol):
    """What :class:`swiftune.GRPOTrainer` needs from a generation backend."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, params: SamplingParams) -> Rollouts:
        """Sample ``num_generations`` completions of every prompt (prompt-major order)."""
        ...

    def load_weights(self, model: nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (called after optimizer steps)."""
        ...
