"""Group-relative advantages (GRPO), for each ``scale_rewards`` mode (TRL's definitions).

Rewards come as one flat vector of ``N = B * G`` entries, the ``G`` completions of each prompt
contiguous. With ``mean_g`` / ``std_g`` the mean and (Bessel-corrected) standard deviation of a
completion's group, and ``std_b`` the standard deviation of the whole batch::

    group:  A_i = (r_i - mean_g) / (std_g + eps)
    batch:  A_i = (r_i - mean_g) / (std_b + eps)
    none:   A_i =  r_i - mean_g                     (Dr. GRPO: no std scaling)

``eps = 1e-4`` as TRL. A group whose rewards are all equal gets advantage 0 in every mode.
"""

from __future__ import annotations

import torch

ADVANTAGE_EPS = 1e-4


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_rewards: str = "group",
    eps: float = ADVANTAGE_EPS,
    batch_std: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of ``rewards`` ``[B * G]`` (groups contiguous).

    Args:
        rewards: float rewards, one per completion.
        group_size: ``G``, completions per prompt.
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        eps: added to the standard deviation.
        batch_std: for ``"batch"`` on several processes, the standard deviation of the rewards of
            the whole global batch (default: of ``rewards``).

    Returns:
        ``(advantages [B * G], group_std [B * G])``; ``group_std`` is each completion's group std
        (logged as ``reward_std``).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    std_g = (grouped.std(dim=1) if group_size > 1 else torch.zeros(grouped.shape[0], dtype=rewards.dtype,
                                                                      device=rewards.device))
    std_g = std_g.repeat_interleave(group_size)
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (std_g + eps)
    elif scale_rewards == "batch":
        if batch_std is None:
            batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (batch_std + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    return advantages, std_g
