"""What the trainer does for TRL 1.16's model-side ``GRPOConfig`` fields (see :mod:`swiftune.rl.trl_fields`).

* ``model_init_kwargs`` / ``trust_remote_code``: keyword arguments of ``FastModel.from_pretrained``
  when the model is a path (an instantiated model with them set is an error, as in TRL);
* ``disable_dropout``: every ``nn.Dropout`` of the policy (and reference) gets ``p = 0``;
* ``sync_ref_model``: every ``ref_model_sync_steps`` optimizer steps the frozen reference copy
  moves towards the policy, ``ref = alpha * policy + (1 - alpha) * ref`` (TD-update, TR-DPO); for
  LoRA, whose reference is the base model under the adapters, there is no copy to move: refused.

TRL 1.16's ``GRPOTrainer`` arguments beyond transformers' (:func:`trl_trainer_arguments`), checked
before any model loads: ``quantization_config`` loads a model given as a path (as TRL);
reward models (a name or an ``nn.Module`` in ``reward_funcs``, their ``reward_processing_classes``),
``tools``, ``rollout_func`` and ``environment_factory`` are refused, naming what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..errors import ConfigError
from ..training.config_checks import from_pretrained_kwargs, warn_once


def model_load_kwargs(args: Any, model: Any) -> dict[str, Any]:
    """``FastModel.from_pretrained`` keyword arguments from the config (only for a model given by path)."""
    kwargs = from_pretrained_kwargs(args.model_init_kwargs, args.trust_remote_code)
    if kwargs and not isinstance(model, str):
        raise ValueError("GRPOConfig.model_init_kwargs / trust_remote_code apply when the model is given as a path; "
                         "this model is already loaded: drop them, or pass the path instead")
    return kwargs


# TRL 1.16 GRPOTrainer arguments that swiftune has no counterpart for: what to do instead
_REFUSED_ARGUMENTS = {
    "tools": "swiftune's rollouts do not call tools; leave tools=None",
    "rollout_func": "pass a swiftune RolloutEngine as rollout_engine= instead (docs/rollout.md), or leave "
                    "rollout_func=None",
    "environment_factory": "swiftune's rollouts run no environments; compute the outcome in a reward function "
                           "instead, or leave environment_factory=None",
}


def trl_trainer_arguments(model: Any, reward_funcs: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` arguments, taken out of ``kwargs`` (which go on to transformers'
    ``Trainer``) before any model loads: a ``ConfigError`` for those swiftune does not run, and the
    extra ``from_pretrained`` keywords they ask for (``quantization_config`` for a model path)."""
    for name, instead in _REFUSED_ARGUMENTS.items():
        if kwargs.pop(name, None) is not None:
            raise ConfigError(f"GRPOTrainer: {name} is not supported: {instead}")
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for f in funcs:
        if isinstance(f, (str, nn.Module)):
            what = f"the reward model {f!r}" if isinstance(f, str) else f"the reward model {type(f).__name__}"
            raise ConfigError(
                f"GRPOTrainer: reward_funcs holds {what}; swiftune does not run reward models (TRL scores "
                "prompt + completion with a sequence-classification model): wrap it in a function "
                "f(prompts, completions, **kwargs) returning one float per completion")
    if kwargs.pop("reward_processing_classes", None) is not None:
        raise ConfigError("GRPOTrainer: reward_processing_classes tokenize for reward models, which swiftune does not "
                          "run; tokenize inside your reward function and leave reward_processing_classes=None")
    quantization_config = kwargs.pop("quantization_config", None)
    if quantization_config is None:
        return {}
    if not isinstance(model, str):
        warn_once("GRPOTrainer.quantization_config", "GRPOTrainer: quantization_config is ignored: the model is "
                  "already loaded (as in TRL); load it with FastModel.from_pretrained(..., load_in_4bit=True) instead")
        return {}
    return {"quantization_config": quantization_config}


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0; returns how many modules changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p != 0:
            module.p = 0.0
            changed += 1
    return changed


class RefModelSync(TrainerCallback):
    """``sync_ref_model``: mix the policy into the reference copy every ``ref_model_sync_steps`` steps."""

    def __init__(self, policy: nn.Module, ref_model: nn.Module, alpha: float, every: int):
        self.policy, self.ref, self.alpha, self.every = policy, ref_model, alpha, every

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            sync_reference(self.policy, self.ref, self.alpha)


@torch.no_grad()
def sync_reference(policy: nn.Module, ref_model: nn.Module, alpha: float) -> None:
    """``ref = alpha * policy + (1 - alpha) * ref`` parameter by parameter (same architecture)."""
    policy_params = dict(policy.named_parameters())
    for name, ref_param in ref_model.named_parameters():
        src = policy_params.get(name)
        if src is None:
            raise RuntimeError(f"sync_ref_model: the reference has {name!r}, the policy does not")
        ref_param.mul_(1.0 - alpha).add_(src.detach().to(ref_param.dtype), alpha=alpha)
