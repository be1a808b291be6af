"""Reward evaluation of a GRPO policy on held-out prompts (``GRPOTrainer.evaluate``).

Each process takes every ``world``-th prompt, samples ``num_generations`` completions of each and
scores them exactly as a training generation does (``GRPOTrainer.sample_and_score``: the trainer's
rollout engine, sampling settings and reward functions; no training, nothing kept), and the
processes sum their totals, so the metrics are means over all evaluated completions:

* ``{prefix}_reward``: weighted reward (the quantity training maximises), ``{prefix}_reward_std``:
  mean within-group standard deviation, ``{prefix}_rewards/{name}/mean`` per function (``None``
  rewards skipped);
* ``{prefix}_completion_length`` (tokens) and ``{prefix}_completions/clipped_ratio`` (share that hit
  ``max_completion_length`` without a stop token).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def evaluate_rewards(trainer: Any, rows: Sequence[Mapping[str, Any]], prefix: str = "eval") -> dict[str, float]:
    args = trainer.args
    acc = trainer.accelerator
    G = args.num_generations
    names = trainer.reward_func_names
    mine = list(rows)[acc.process_index::acc.num_processes]
    per_call = max(1, args.per_device_eval_batch_size // G)
    # totals: reward sum, completions, group-std sum, groups, length sum, clipped, then (sum, count) per function
    totals = torch.zeros(6 + 2 * len(names), dtype=torch.float64)
    t0 = time.perf_counter()
    for a in range(0, len(mine), per_call):
        sampled = trainer.sample_and_score(mine[a:a + per_call])
        rewards = sampled.rewards.double()
        groups = rewards.view(-1, G)
        totals[0] += rewards.sum()
        totals[1] += rewards.numel()
        totals[2] += (groups.std(dim=1) if G > 1 else torch.zeros(groups.shape[0], dtype=torch.float64)).sum()
        totals[3] += groups.shape[0]
        totals[4] += sum(len(c) for c in sampled.completion_ids)
        totals[5] += int((~sampled.finished).sum())
        for j in range(len(names)):
            col = sampled.per_func[:, j].double()
            ok = ~torch.isnan(col)
            totals[6 + 2 * j] += col[ok].sum()
            totals[7 + 2 * j] += ok.sum()
    totals = acc.reduce(totals.to(args.device), reduction="sum").cpu() if acc.num_processes > 1 else totals
    n = max(float(totals[1]), 1.0)
    metrics = {
        f"{prefix}_reward": float(totals[0]) / n,
        f"{prefix}_reward_std": float(totals[2]) / max(float(totals[3]), 1.0),
        f"{prefix}_completion_length": float(totals[4]) / n,
        f"{prefix}_completions/clipped_ratio": float(totals[5]) / n,
        f"{prefix}_generation_s": time.perf_counter() - t0,
    }
    for j, name in enumerate(names):
        count = float(totals[7 + 2 * j])
        metrics[f"{prefix}_rewards/{name}/mean"] = float(totals[6 + 2 * j]) / count if count else math.nan
    return metrics
