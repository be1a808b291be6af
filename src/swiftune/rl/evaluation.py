"""Reward evaluation of a GRPO policy on held-out prompts (``GRPOTrainer.evaluate``).

Each process takes every ``world``-th prompt, samples ``num_generations`` completions of each with
the trainer's rollout engine and sampling settings (no training, nothing kept), scores them with
the trainer's reward functions, and the processes sum their totals, so the metrics are means over
all evaluated completions:

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

from .rewards import compute_rewards
from .rollout import SamplingParams


def evaluate_rewards(trainer: Any, rows: Sequence[Mapping[str, Any]], prefix: str = "eval") -> dict[str, float]:
    args = trainer.args
    acc = trainer.accelerator
    G = args.num_generations
    names = trainer.reward_func_names
    mine = list(rows)[acc.process_index::acc.num_processes]
    per_call = max(1, args.per_device_eval_batch_size // G)
    # totals: reward sum, completions, group-std sum, groups, length sum, clipped, then (sum, count) per function
    totals = torch.zeros(6 + 2 * len(names), dtype=torch.float64)
    if trainer.state.global_step != trainer._engine_step:
        trainer.rollout_engine.load_weights(trainer.model)
        trainer._engine_step = trainer.state.global_step
    t0 = time.perf_counter()
    for a in range(0, len(mine), per_call):
        batch = mine[a:a + per_call]
        prompts = [row["prompt"] for row in batch]
        conversational = isinstance(prompts[0], (list, tuple))
        prompt_ids = [trainer.tokenize_prompt(p) for p in prompts]
        params = SamplingParams(max_tokens=args.max_completion_length, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                stop_token_ids=trainer.stop_token_ids(conversational))
        rollouts = trainer.rollout_engine.generate(prompt_ids, G, params)
        ids = rollouts.completion_ids
        texts = trainer.processing_class.batch_decode(ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [row[k] for row in batch for _ in range(G)] for k in batch[0] if k != "prompt"}
        rewards, per_func = compute_rewards(
            trainer.reward_funcs, [p for p in prompts for _ in range(G)], completions, ids, columns,
            trainer.reward_weights, group_size=G, trainer_state=trainer.state,
        )
        rewards = rewards.double()
        groups = rewards.view(-1, G)
        totals[0] += rewards.sum()
        totals[1] += rewards.numel()
        totals[2] += (groups.std(dim=1) if G > 1 else torch.zeros(groups.shape[0], dtype=torch.float64)).sum()
        totals[3] += groups.shape[0]
        totals[4] += sum(len(c) for c in ids)
        totals[5] += sum(not f for f in rollouts.finished)
        for j in range(len(names)):
            col = per_func[:, j].double()
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
