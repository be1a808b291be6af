"""Reinforcement learning: GRPO and its variants (see docs/grpo.md).

* :class:`GRPOConfig` / :class:`GRPOTrainer` - the trainer (TRL's names and meanings).
* :mod:`~swiftune.rl.rewards` - reward functions (TRL's signature), weights, async.
* :mod:`~swiftune.rl.advantages` - group advantages.
* :mod:`~swiftune.rl.loss` - the policy loss of every ``loss_type`` and GSPO.
* :mod:`~swiftune.rl.rollout` - the :class:`RolloutEngine` interface and both built-in engines
  (:class:`TransformersRolloutEngine`, :class:`FastRolloutEngine`).
* :mod:`~swiftune.rl.policy` - completion log-probs on packed, optionally shared-prompt rows.
"""

from .advantages import group_advantages
from .config import GRPOConfig
from .loss import LossOutput, grpo_loss, k3_kl
from .policy import PolicyRow, build_policy_row, completion_logprobs
from .rewards import RewardFunctionError, compute_rewards
from .rollout import FastRolloutEngine, FastSamplingParams, RolloutEngine, Rollouts, SamplingParams, TransformersRolloutEngine
from .trainer import GRPOTrainer



__all__ = [
    "FastRolloutEngine",
    "FastSamplingParams",
    "GRPOConfig",
    "GRPOTrainer",
    "LossOutput",
    "PolicyRow",
    "RewardFunctionError",
    "RolloutEngine",
    "Rollouts",
    "SamplingParams",
    "TransformersRolloutEngine",
    "build_policy_row",
    "completion_logprobs",
    "compute_rewards",
    "grpo_loss",
    "group_advantages",
    "k3_kl",
]
