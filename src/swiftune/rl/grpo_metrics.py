"""GRPO's logged metrics under TRL 1.16's names and definitions (so that dashboards keep working).

Per generation (over every completion of the generation on every process; :func:`generation_metrics`):

* ``reward`` / ``reward_std``: NaN-ignoring mean and Bessel standard deviation, over the batch, of the
  weighted reward ``sum_f w_f r_f`` (a completion every function returned ``None`` for is left out);
* ``rewards/<name>/mean`` / ``/std``: the same for each function's own values;
* ``frac_reward_zero_std``: share of completions whose group's reward std is 0 (the batch std with
  ``scale_rewards="batch"`` or ``multi_objective_aggregation="normalize_then_sum"``), i.e. no signal;
* ``completions/mean_length``, ``/min_length``, ``/max_length`` (tokens), ``completions/clipped_ratio``
  (share cut at ``max_completion_length`` without a stop token) and ``completions/mean_terminated_length``,
  ``/min_``, ``/max_`` over the completions that did stop (0 when none did);
* ``completion_length``: swiftune's earlier name of ``completions/mean_length``, kept for its users.

Per micro-batch of the loss (:meth:`swiftune.rl.loss.LossOutput.totals`, reduced over processes by
sum and count): ``entropy``, ``kl`` (``beta > 0``), ``clip_ratio/low_mean``, ``/high_mean``,
``/region_mean``, ``clip_ratio/low_min`` / ``high_max`` (the extreme of the per-completion shares),
``cispo_clip_ratio``, ``vespo/phi_seq_mean``.

At a log, each metric is the mean of its values since the last log, NaN values left out; a metric with
no value left is not logged (TRL logs ``None``, which integrations drop).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch


def nanstd(x: torch.Tensor) -> float:
    """Bessel-corrected standard deviation of the non-NaN entries (NaN with fewer than two)."""
    x = x[~torch.isnan(x)].double()
    return float(x.std()) if x.numel() > 1 else math.nan


def nanmean(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)].double()
    return float(x.mean()) if x.numel() else math.nan


def combined_rewards(per_func: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """``sum_f w_f r_f`` ignoring ``None`` (NaN) values, NaN where every function returned ``None``."""
    w = torch.tensor([float(v) for v in weights], dtype=torch.float64)
    out = (per_func.double() * w).nansum(dim=1)
    return torch.where(torch.isnan(per_func).all(dim=1), torch.full_like(out, math.nan), out)


def zero_std_fraction(rewards: torch.Tensor, group_size: int, batch_level: bool) -> float:
    """Share of completions whose reward spread is 0: their group's (or, ``batch_level``, the batch's)."""
    if batch_level:
        std = nanstd(rewards)
        return float(not math.isnan(std) and abs(std) < 1e-8)
    if group_size == 1:  # one completion a prompt (num_generations_eval=1) has no spread: TRL's std of 0
        return 1.0 if rewards.numel() else math.nan
    stds = [nanstd(g) for g in rewards.double().view(-1, group_size)]
    zero = [not math.isnan(s) and abs(s) < 1e-8 for s in stds]  # a group of None rewards has no spread at all
    return sum(zero) / len(zero) if zero else math.nan


def generation_metrics(
    per_func: torch.Tensor,
    weights: Sequence[float],
    names: Sequence[str],
    completion_lengths: torch.Tensor,
    truncated: torch.Tensor,
    group_size: int,
    batch_level_std: bool = False,
) -> dict[str, float]:
    """The per-generation metrics of the module doc from one generation's (gathered) data.

    Args:
        per_func: ``[N, F]`` each reward function's values (NaN: ``None``).
        weights: ``reward_weights``, one per function.
        names: the functions' names (``rewards/<name>/...``).
        completion_lengths: ``[N]`` tokens of each completion.
        truncated: ``[N]`` bool, cut at ``max_completion_length`` without a stop token.
        group_size: completions per prompt (groups contiguous).
        batch_level_std: the zero-std share is the batch's (``scale_rewards="batch"``).
    """
    rewards = combined_rewards(per_func, weights)
    lengths = completion_lengths.double()
    done = lengths[~truncated.bool()]
    if done.numel() == 0:  # TRL: 0 when no completion stopped
        done = torch.zeros(1, dtype=torch.float64)
    out = {
        "reward": nanmean(rewards),
        "reward_std": nanstd(rewards),
        "frac_reward_zero_std": zero_std_fraction(rewards, group_size, batch_level_std),
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.double().mean()),
        "completions/mean_terminated_length": float(done.mean()),
        "completions/min_terminated_length": float(done.min()),
        "completions/max_terminated_length": float(done.max()),
    }
    out["completion_length"] = out["completions/mean_length"]
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"] = nanmean(per_func[:, j])
        out[f"rewards/{name}/std"] = nanstd(per_func[:, j])
    return out


class MetricLog:
    """Values of each metric since the last log; :meth:`means` averages them, NaN left out (TRL)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.values[k].append(float(v))

    def set(self, name: str, value: float) -> None:
        """A metric that is a running total (``num_tokens``): only its newest value counts."""
        self.values[name] = [float(value)]

    def means(self, clear: bool = True) -> dict[str, float]:
        out = {}
        for k, vals in self.values.items():
            valid = [v for v in vals if not math.isnan(v)]
            if valid:
                out[k] = sum(valid) / len(valid)
        if clear:
            self.values.clear()
        return out

    def __bool__(self) -> bool:
        return any(self.values.values())


def reduce_loss_metrics(totals: dict[str, tuple[torch.Tensor, torch.Tensor]], extremes: dict[str, float],
                        accelerator) -> dict[str, float]:
    """One micro-batch's loss metrics over all processes: each mean as ``sum / count`` of the summed
    totals, ``clip_ratio/low_min`` / ``high_max`` as the extreme over processes (NaN ignored)."""
    names = sorted(totals)
    if not names:
        return {}
    device = totals[names[0]][0].device
    stacked = torch.stack([torch.stack([totals[k][0].double(), totals[k][1].double()]) for k in names]).to(device)
    ext_names = sorted(extremes)
    ext = torch.tensor([extremes[k] for k in ext_names], dtype=torch.float64, device=device)
    if accelerator is not None and accelerator.num_processes > 1:
        stacked = accelerator.reduce(stacked, reduction="sum")
        ext = accelerator.gather(ext.reshape(1, -1)) if ext_names else ext
    out = {k: float(stacked[i, 0] / stacked[i, 1].clamp(min=1.0)) for i, k in enumerate(names)}
    ext = ext.reshape(-1, len(ext_names)) if ext_names else ext
    for i, k in enumerate(ext_names):
        col = ext[:, i][~torch.isnan(ext[:, i])]
        pick = torch.min if k.endswith("_min") else torch.max
        out[k] = float(pick(col)) if col.numel() else math.nan
    return out
