"""Reward functions with TRL's signature, several at once, weighted, sync or async.

A reward function is any callable ::

    f(prompts, completions, completion_ids=..., **columns) -> list[float | None]

called once per generation with one entry per completion: ``prompts[i]`` (the prompt as it is in
the dataset: a string or a list of messages, repeated for each completion of its group),
``completions[i]`` (the decoded text; for conversational prompts
``[{"role": "assistant", "content": text}]``), ``completion_ids[i]`` (token ids), every other
dataset column (its value for that completion's prompt) and ``trainer_state``. Functions should
accept ``**kwargs``. It returns one float per completion, or ``None`` where it does not apply
(e.g. a math checker on a code prompt).

Several functions combine as TRL does: ``reward_i = nansum_f(w_f * r_fi)`` (``None`` counts as NaN
and is skipped). ``async def`` functions run concurrently on an asyncio event loop while the
synchronous ones run in order. A function that returns the wrong number of values, a non-number
or NaN/inf stops training with a :class:`RewardFunctionError` naming it and the completion.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

RewardFunc = Callable[..., Any]


class RewardFunctionError(ValueError):
    """A reward function returned something that is not one number (or None) per completion."""


def reward_func_name(func: RewardFunc) -> str:
    """The name metrics use for ``func`` (``__name__``, else its class name)."""
    name = getattr(func, "__name__", None)
    if name is None or name == "<lambda>":
        name = getattr(func, "__qualname__", None) if name is None else name
    return name or type(func).__name__


def is_async_reward(func: RewardFunc) -> bool:
    """Whether calling ``func`` returns a coroutine (``async def`` function or ``__call__``)."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def _run_coroutines(coros: list) -> list:
    """Await ``coros`` concurrently; works whether or not an event loop already runs in this thread."""

    async def gather():
        return await asyncio.gather(*coros)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    # A loop already runs here (a notebook): run ours in a helper thread.
    box: dict[str, Any] = {}

    def target():
        try:
            box["result"] = asyncio.run(gather())
        except BaseException as e:  # re-raised below, in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="swiftune-async-rewards")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def check_reward_values(name: str, values: Any, num_completions: int, group_size: int = 1) -> list[float]:
    """Validate one function's output; ``None`` -> NaN. Raises :class:`RewardFunctionError`."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence) and not hasattr(values, "__len__"):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(values).__name__}; it must return a list with one float "
            f"(or None) per completion ({num_completions})"
        )
    values = list(values)
    if len(values) != num_completions:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for {num_completions} completions; it must "
            "return exactly one float (or None) per completion"
        )
    out: list[float] = []
    for i, v in enumerate(values):
        where = f"row {i} (completion {i % group_size} of prompt {i // group_size})" if group_size > 1 else f"row {i}"
        if v is None:
            out.append(math.nan)
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if hasattr(v, "item") and not isinstance(v, numbers.Real):  # numpy scalars
            try:
                v = v.item()
            except (TypeError, ValueError):
                pass
        if not isinstance(v, numbers.Real):
            raise RewardFunctionError(
                f"reward function {name!r} returned a non-number for {where}: {type(v).__name__} {v!r:.80}; "
                "return a float, or None to skip the completion"
            )
        v = float(v)
        if not math.isfinite(v):
            raise RewardFunctionError(
                f"reward function {name!r} returned {v} for {where}; rewards must be finite "
                "(return None to skip a completion)"
            )
        out.append(v)
    return out


def compute_rewards(
    reward_funcs: Sequence[RewardFunc],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: Mapping[str, list[Any]] | None = None,
    weights: Sequence[float] | None = None,
    group_size: int = 1,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call every reward function once on the whole batch and combine them.

    Args:
        reward_funcs: the functions (sync or async).
        prompts, completions, completion_ids: one entry per completion.
        columns: other dataset columns, one value per completion, passed as keyword arguments.
        weights: one per function (default 1.0).
        group_size: completions per prompt (only used to name the failing row in errors).
        **extra: more keyword arguments for every function (``trainer_state``).

    Returns:
        ``(rewards [N], rewards_per_func [N, F])`` float32 CPU tensors; ``rewards_per_func`` holds NaN
        where a function returned ``None``, and ``rewards`` is the weighted ``nansum`` over functions.
    """
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"{len(prompts)} prompts, {n} completions and {len(completion_ids)} completion_ids differ")
    if weights is None:
        weights = [1.0] * len(reward_funcs)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"{len(weights)} reward_weights for {len(reward_funcs)} reward functions")
    kwargs = dict(columns or {})
    kwargs.update(extra)
    results: list[Any] = [None] * len(reward_funcs)
    pending: list[tuple[int, Any]] = []
    for j, func in enumerate(reward_funcs):
        out = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        if inspect.isawaitable(out):
            pending.append((j, out))
        else:
            results[j] = out
    if pending:
        for (j, _), value in zip(pending, _run_coroutines([c for _, c in pending])):
            results[j] = value
    per_func = torch.tensor(
        [check_reward_values(reward_func_name(f), r, n, group_size) for f, r in zip(reward_funcs, results)],
        dtype=torch.float32,
    ).reshape(len(reward_funcs), n).T.contiguous()
    all_none = torch.isnan(per_func).all(dim=1)
    if bool(all_none.any()):
        rows = all_none.nonzero().squeeze(1).tolist()
        warnings.warn(
            f"every reward function returned None for completions {rows[:8]}{'...' if len(rows) > 8 else ''}; "
            "their reward is 0", stacklevel=2,
        )
    w = torch.tensor([float(x) for x in weights], dtype=torch.float32)
    rewards = (per_func * w).nansum(dim=1)
    return rewards, per_func
