"""``multi_objective_aggregation="normalize_then_sum"`` (TRL 1.16): advantages of several rewards.

The default, ``sum_then_normalize``, is :func:`swiftune.rl.advantages.group_advantages` of the
weighted reward sum. ``normalize_then_sum`` first puts every reward function on one scale in its group,
so that a function with a large range does not drown the others (``G`` completions a group, ``eps = 1e-4``,
NaN = a ``None`` reward, ignored by the means and deviations)::

    z_if = (r_if - mean_g(r_f)) / (std_g(r_f) + eps)          each function f in its group g
    s_i  = sum_f w_f z_if                                      NaN where every r_if is None
    A_i  = (s_i - mean_batch(s)) / (std_batch(s) + eps)        0 where s_i is NaN

(``std`` Bessel-corrected, as TRL's ``nanstd``.) The batch statistics span every process's completions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

EPS = 1e-4


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1).clamp(min=1)
    var = torch.where(count > 1, var, torch.full_like(var, math.nan))
    out = var.sqrt()
    return out if dim is not None else out.reshape(())


def normalize_then_sum(per_func: torch.Tensor, weights: Sequence[float], group_size: int,
                       gather: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages [N], batch std of s [N])`` from ``per_func [N, F]`` (see the module doc);
    ``gather`` collects ``s`` over processes for the batch statistics."""
    n, f = per_func.shape
    grouped = per_func.double().view(-1, group_size, f)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = _nanstd(grouped, dim=1) if group_size > 1 else torch.zeros_like(mean)
    z = ((grouped - mean) / (std + EPS)).view(n, f)
    w = torch.tensor([float(v) for v in weights], dtype=torch.float64)
    s = (z * w).nansum(dim=1)
    s = torch.where(torch.isnan(per_func).all(dim=1), torch.full_like(s, math.nan), s)
    everyone = gather(s) if gather is not None else s
    batch_std = _nanstd(everyone) if everyone.numel() > 1 else torch.zeros((), dtype=torch.float64)
    adv = (s - torch.nanmean(everyone)) / (batch_std + EPS)
    return torch.nan_to_num(adv, nan=0.0).float(), batch_std.expand(n).float()
