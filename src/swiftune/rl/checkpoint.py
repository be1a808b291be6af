"""The rollout buffer in GRPO checkpoints, so that a resumed run continues mid-generation exactly.

With ``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps`` one
generation serves several optimizer steps, and a checkpoint can fall between them. Its micro-batches
(packed rows, advantages, masks, old and reference log-probs) were built from the policy as it was
at generation time; regenerating after a resume would sample from, and take old log-probs under,
a later policy. So every checkpoint also stores, per process, the micro-step counter and the
buffer (``rollouts-rank{r}.pt``, CPU tensors, caches dropped), and resuming puts them back.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch


def rollout_state_path(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, f"rollouts-rank{rank}.pt")


def _to(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor moved and every per-forward ``cache`` dict emptied (dataclasses, lists)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(x, device) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: ({} if f.name == "cache" else _to(getattr(obj, f.name), device))
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def save_rollout_state(checkpoint_dir: str, rank: int, micro_step: int, buffer: list | None) -> None:
    os.makedirs(checkpoint_dir, exist_ok=True)
    torch.save({"micro_step": micro_step, "buffer": _to(buffer, "cpu") if buffer is not None else None},
               rollout_state_path(checkpoint_dir, rank))


def load_rollout_state(checkpoint_dir: str, rank: int, device: torch.device) -> tuple[int, list | None] | None:
    """``(micro_step, buffer)`` saved with the checkpoint, or None (a checkpoint from before this existed)."""
    path = rollout_state_path(checkpoint_dir, rank)
    if not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own dataclasses of tensors
    buffer = state["buffer"]
    return int(state["micro_step"]), (_to(buffer, device) if buffer is not None else None)
