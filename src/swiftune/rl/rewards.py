"""Reward functions with TRL's signature, several at once, weighted, sync or async.

A reward function is any callable ::

    f(prompts, completions, completion_ids=..., **columns) -> list[float | None]

called once per generation with one entry per completion: ``prompts[i]`` (the prompt as it is in
the dataset: a string or a list of messages, repeated for each completion of its group),
``completions[i]`` (the decoded text; for conversational prompts
``[{"role": "assistant", "content": text}]``), ``completion_ids[i]`` (token ids), every other
dataset column (its value for that completion's prompt), ``trainer_state`` and, as TRL 1.16
passes them, ``log_metric(name, value)`` and ``log_extra(column, values)`` (:mod:`swiftune.rl.completions_log`). Functions should
accept ``**kwargs``. It returns one float per completion, or ``None`` where it does not apply
(e.g. a math checker on a code prompt).

Several functions combine as TRL does: ``reward_i = nansum_f(w_f * r_fi)`` (``None`` counts as NaN
and is skipped). ``async def`` functions run concurrently on an asyncio event loop while the
synchronous ones run in order. A function that returns the wrong number of values, a non-number
or NaN/inf stops training with a :class:`RewardFunctionError` naming it and the completion.

Failures inside a function:

* an exception is re-raised as a :class:`RewardFunctionError` naming the function, chained to the
  original (``raise ... from``). To name the row, the function is called again on one completion at
  a time (same arguments, each column cut to that row); the first row that raises the same
  exception type is named with its prompt and completion. A function that only fails on the whole
  batch is reported without a row.
* ``timeout`` (``GRPOConfig.reward_timeout``): each function then runs in a daemon worker thread
  (``async def`` ones: their event loop does), and one that has not returned after ``timeout``
  seconds raises :class:`RewardTimeoutError` naming it. A Python thread cannot be killed: the
  stuck call is abandoned, still running, and ends with the process. Without a timeout (the
  default) synchronous functions run in the calling thread, so ones that rely on the main thread
  (``signal.alarm``-based time limits) keep working.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

RewardFunc = Callable[..., Any]


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something that is not one number (or None) per completion."""


class RewardTimeoutError(RewardFunctionError):
    """A reward function did not return within the reward timeout."""


_TIMED_OUT = object()  # what a call that did not finish in time "returned"


@dataclass
class _Raised:
    """What a call that raised returned: its exception (kept apart from ordinary return values)."""

    error: BaseException


def reward_func_name(func: RewardFunc) -> str:
    """The name metrics use for ``func`` (``__name__``, else its class name)."""
    name = getattr(func, "__name__", None)
    if name is None or name == "<lambda>":
        name = getattr(func, "__qualname__", None) if name is None else name
    return name or type(func).__name__


def is_async_reward(func: RewardFunc) -> bool:
    """Whether calling ``func`` returns a coroutine (``async def`` function or ``__call__``)."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def _in_thread(target: Callable[[], Any], timeout: float | None, name: str) -> Any:
    """``target()`` in a daemon thread: its value, :class:`_Raised`, or ``_TIMED_OUT`` once
    ``timeout`` seconds (``None``: no limit) pass; a stuck thread is left behind, never joined."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = target()
        except BaseException as e:  # handed to the caller's thread
            box["value"] = _Raised(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    return box.get("value", _TIMED_OUT)


def _run_coroutines(coros: list, timeout: float | None = None) -> list:
    """Await ``coros`` concurrently; works whether or not an event loop already runs in this thread.

    Returns one entry per coroutine: its value, :class:`_Raised`, or ``_TIMED_OUT`` when it had not
    finished ``timeout`` seconds after the start (it is then cancelled; a coroutine that blocks the
    loop without awaiting is abandoned with its thread after one more second).
    """
    box: dict[int, Any] = {}

    async def guarded(k: int, coro):
        try:
            box[k] = await coro
        except Exception as e:
            box[k] = _Raised(e)

    async def gather():
        tasks = [asyncio.ensure_future(guarded(k, c)) for k, c in enumerate(coros)]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()

    def collect() -> list:
        return [box.get(k, _TIMED_OUT) for k in range(len(coros))]

    try:
        asyncio.get_running_loop()
        loop_here = True
    except RuntimeError:
        loop_here = False
    if not loop_here and timeout is None:
        asyncio.run(gather())
        return collect()
    # A loop already runs here (a notebook), or the loop must not hold this thread past the timeout.
    out = _in_thread(lambda: asyncio.run(gather()), None if timeout is None else timeout + 1.0,
                     "swiftune-async-rewards")
    if isinstance(out, _Raised):
        raise out.error
    return collect()


def _call(func: RewardFunc, kwargs: dict[str, Any], timeout: float | None, name: str) -> Any:
    """Call ``func(**kwargs)``: its value (maybe a coroutine, not awaited), :class:`_Raised` or
    ``_TIMED_OUT``; in this thread without a timeout, else in a worker thread."""
    if timeout is None:
        try:
            return func(**kwargs)
        except Exception as e:
            return _Raised(e)
    return _in_thread(lambda: func(**kwargs), timeout, f"swiftune-reward-{name}")


def _call_and_await(func: RewardFunc, kwargs: dict[str, Any], timeout: float | None, name: str) -> Any:
    out = _call(func, kwargs, timeout, name)
    if inspect.isawaitable(out):
        out = _run_coroutines([out], timeout)[0]
    return out


def _where(i: int, group_size: int) -> str:
    return f"row {i} (completion {i % group_size} of prompt {i // group_size})" if group_size > 1 else f"row {i}"


def _timeout_error(name: str, timeout: float) -> RewardTimeoutError:
    return RewardTimeoutError(
        f"reward function {name!r} did not return within reward_timeout={timeout:g} s; it is abandoned, still "
        "running in a background thread. Make it faster (or give it its own time limit), or raise reward_timeout"
    )


def _raised_error(
    func: RewardFunc,
    error: BaseException,
    call_kwargs: dict[str, Any],
    columns: Mapping[str, list[Any]],
    n: int,
    group_size: int,
    timeout: float | None,
) -> RewardFunctionError:
    """The error for ``func`` having raised ``error`` on the batch; finds the row by calling it again
    on one completion at a time (see the module doc)."""
    name = reward_func_name(func)
    row, unknown = None, "no row raised it alone"
    per_row = ("prompts", "completions", "completion_ids", *columns)
    for i in range(n):
        kwargs = {k: (v[i:i + 1] if k in per_row else v) for k, v in call_kwargs.items()}
        out = _call_and_await(func, kwargs, timeout, name)
        if out is _TIMED_OUT:
            unknown = f"row {i} alone did not return in time"
            break
        if isinstance(out, _Raised):
            if type(out.error) is type(error):
                row = i
            else:
                unknown = f"row {i} alone raised {type(out.error).__name__} instead"
            break
    what = f"{type(error).__name__}: {error}"
    if row is None:
        return RewardFunctionError(
            f"reward function {name!r} raised {what} on the batch of {n} completions (called again on one "
            f"completion at a time, {unknown}); {_TRACEBACK_HINT}"
        )
    prompt, completion = call_kwargs["prompts"][row], call_kwargs["completions"][row]
    return RewardFunctionError(
        f"reward function {name!r} raised {what} on {_where(row, group_size)} (the first row that raises it "
        f"when called alone): prompt {prompt!r:.80}, completion {completion!r:.80}; {_TRACEBACK_HINT}"
    )


# where the original error's traceback is: chained to this one (a command line prints only the message)
_TRACEBACK_HINT = "its traceback is chained to this error (swiftune's commands print it with --traceback)"


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
        where = _where(i, group_size)
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
    timeout: float | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call every reward function once on the whole batch and combine them.

    Args:
        reward_funcs: the functions (sync or async).
        prompts, completions, completion_ids: one entry per completion.
        columns: other dataset columns, one value per completion, passed as keyword arguments.
        weights: one per function (default 1.0).
        group_size: completions per prompt (only used to name the failing row in errors).
        timeout: seconds each function may take (``None``: no limit); see the module doc.
        **extra: more keyword arguments for every function (``trainer_state``, ``log_metric``, ``log_extra``).

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
    if timeout is not None and not timeout > 0:
        raise ValueError(f"the reward timeout must be a positive number of seconds or None, got {timeout!r}")
    columns = dict(columns or {})
    call_kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                   **columns, **extra}

    def check(j: int, out: Any) -> Any:
        if out is _TIMED_OUT:
            raise _timeout_error(reward_func_name(reward_funcs[j]), timeout)
        if isinstance(out, _Raised) and not isinstance(out.error, Exception):
            raise out.error  # KeyboardInterrupt, SystemExit: not the function's fault
        if isinstance(out, _Raised):
            raise _raised_error(reward_funcs[j], out.error, call_kwargs, columns, n, group_size,
                                timeout) from out.error
        return out

    results: list[Any] = [None] * len(reward_funcs)
    pending: list[tuple[int, Any]] = []
    try:
        for j, func in enumerate(reward_funcs):
            out = check(j, _call(func, call_kwargs, timeout, reward_func_name(func)))
            if inspect.isawaitable(out):
                pending.append((j, out))
            else:
                results[j] = out
    except BaseException:
        for _, coro in pending:  # started, never to be awaited
            getattr(coro, "close", lambda: None)()
        raise
    if pending:
        for (j, _), value in zip(pending, _run_coroutines([c for _, c in pending], timeout)):
            results[j] = check(j, value)
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
