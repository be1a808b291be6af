"""Evaluation of a GRPO policy on held-out prompts (``GRPOTrainer.evaluate``), with TRL 1.16's names.

Each process takes every ``world``-th prompt, samples ``num_generations_eval`` (default
``num_generations``) completions of each and scores them exactly as a training generation does
(``GRPOTrainer.sample_and_score``: the trainer's rollout engine, sampling settings and reward
functions; no training, nothing kept). Then, over every evaluated completion of every process:

* ``{prefix}_reward``, ``{prefix}_reward_std``, ``{prefix}_rewards/<name>/mean`` / ``std``,
  ``{prefix}_frac_reward_zero_std``, ``{prefix}_completions/*`` and ``{prefix}_completion_length``:
  :func:`swiftune.rl.grpo_metrics.generation_metrics` of the whole evaluation set;
* ``{prefix}_loss``: the GRPO loss of the completions under the current policy (on-policy: ratio 1,
  so mostly ``-mean(A)`` plus the KL term), the mean over completions of each batch's loss, as
  transformers' evaluation loop averages TRL's; ``{prefix}_entropy``, ``{prefix}_kl``,
  ``{prefix}_clip_ratio/*``: the loss diagnostics, averaged over the batches;
* what reward functions logged with ``log_metric`` (averaged), ``{prefix}_generation_s``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers.trainer_utils import speed_metrics

from .grpo_metrics import generation_metrics


def _merge(acc: Any, local: list) -> list:
    """Every process's ``local`` items, concatenated (a no-op on one process)."""
    if acc.num_processes == 1:
        return local
    from accelerate.utils import gather_object

    return [x for part in gather_object([local]) for x in part]


def evaluate_rewards(trainer: Any, rows: Sequence[Mapping[str, Any]], prefix: str = "eval") -> dict[str, float]:
    args, acc = trainer.args, trainer.accelerator
    G = args.num_generations_eval or args.num_generations
    mine = list(rows)[acc.process_index::acc.num_processes]
    per_call = max(1, args.per_device_eval_batch_size // G)
    loss_log = trainer._metrics["eval"]
    loss_log.values.clear()
    trainer.reward_logs.take_metrics()  # nothing left over from training
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    losses: list[tuple[float, int]] = []
    logged: list[dict[str, list[float]]] = []
    batch_level = False
    t0, started = time.perf_counter(), time.time()  # speed_metrics reads time.time()
    for a in range(0, len(mine), per_call):
        sampled = trainer.sample_and_score(mine[a:a + per_call], G)
        advantages, batch_level = trainer.advantages_of(sampled, G, local=True)
        lengths = torch.tensor([len(c) for c in sampled.completion_ids], dtype=torch.float32)
        parts.append((sampled.per_func.float(), lengths, ~sampled.finished))
        losses.append((trainer.eval_batch_loss(sampled, advantages, G), len(sampled.completion_ids)))
        logged.append({k: list(v) for k, v in trainer.reward_logs.metrics.items()})
        trainer.reward_logs.metrics.clear()
        trainer.reward_logs.take_extra()
    parts = _merge(acc, parts)
    losses = _merge(acc, losses)
    loss_values = _merge(acc, [{k: list(v) for k, v in loss_log.values.items()}]) + _merge(acc, logged)
    loss_log.values.clear()
    if not parts:
        raise ValueError("nothing to evaluate: the eval dataset has no rows")
    per_func = torch.cat([p[0] for p in parts])
    metrics = generation_metrics(per_func, trainer.reward_weights, trainer.reward_func_names,
                                 torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]), G, batch_level)
    metrics["loss"] = sum(v * n for v, n in losses) / max(sum(n for _, n in losses), 1)
    merged: dict[str, list[float]] = {}
    for d in loss_values:
        for k, vals in d.items():
            merged.setdefault(k, []).extend(v for v in vals if not math.isnan(v))
    metrics.update({k: sum(v) / len(v) for k, v in merged.items() if v})
    metrics["generation_s"] = time.perf_counter() - t0
    metrics["num_tokens"] = float(trainer.state.num_input_tokens_seen)  # TRL: the training count, unchanged here
    out = {f"{prefix}_{k}": v for k, v in metrics.items() if not math.isnan(v)}  # NaN: no value (TRL: None)
    # transformers' evaluation loop adds these three; swiftune's evaluation is its own loop, so it adds them
    # itself: completions over every process, one step per generation call of a process
    steps = -(-len(mine) // per_call)
    out.update(speed_metrics(prefix, started, num_samples=int(per_func.shape[0]), num_steps=steps))
    return out
