"""What the trainer does for TRL 1.16's model-side ``GRPOConfig`` fields (see :mod:`swiftune.rl.trl_fields`).

* ``model_init_kwargs`` / ``trust_remote_code``: keyword arguments of ``FastModel.from_pretrained``
  when the model is a path (an instantiated model with them set is an error, as in TRL);
* ``disable_dropout``: every ``nn.Dropout`` of the policy (and reference) gets ``p = 0``;
* ``sync_ref_model``: every ``ref_model_sync_steps`` optimizer steps the frozen reference copy
  moves towards the policy, ``ref = alpha * policy + (1 - alpha) * ref`` (TD-update, TR-DPO); for
  LoRA, whose reference is the base model under the adapters, there is no copy to move: refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..training.config_checks import from_pretrained_kwargs


def model_load_kwargs(args: Any, model: Any) -> dict[str, Any]:
    """``FastModel.from_pretrained`` keyword arguments from the config (only for a model given by path)."""
    kwargs = from_pretrained_kwargs(args.model_init_kwargs, args.trust_remote_code)
    if kwargs and not isinstance(model, str):
        raise ValueError("GRPOConfig.model_init_kwargs / trust_remote_code apply when the model is given as a path; "
                         "this model is already loaded: drop them, or pass the path instead")
    return kwargs


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
