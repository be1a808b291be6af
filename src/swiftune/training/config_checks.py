"""Checks of config fields shared by the trainers' configs (``SFTConfig``, ``GRPOConfig``).

Both configs extend transformers' ``TrainingArguments``; these helpers check what transformers
leaves unchecked, and each field a config adds, at construction, before any model or data loads.
A bad field raises :class:`swiftune.errors.ConfigError` (a ``ValueError``) whose message names the
config, the field, the value, what it must be and what to set instead.

They live in the training runtime, below both trainers, so that neither trainer imports the other.
"""

from __future__ import annotations

import os

import math
import warnings
from typing import Any

from ..errors import ConfigError

KERNEL_BACKENDS = ("auto", "triton", "reference")


def fail(config: Any, name: str, value: Any, need: str, fix: str) -> None:
    """Raise the :class:`ConfigError` of one bad field: its name, its value, what it must be, what to set."""
    raise ConfigError(f"{type(config).__name__}: {name}={value!r} {need}; {fix}")


_ABSENT = object()  # a field this transformers version does not have: nothing to check


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require_int(config: Any, name: str, minimum: int, fix: str, *, allow_none: bool = False) -> None:
    """``config.<name>`` is an int >= ``minimum`` (or None where ``allow_none``)."""
    value = getattr(config, name, _ABSENT)
    if value is _ABSENT or (value is None and allow_none):
        return
    if not _is_int(value) or value < minimum:
        need = f"must be an integer >= {minimum}" + (" or None" if allow_none else "")
        fail(config, name, value, need, f"set {name} to {fix}")


def require_number(config: Any, name: str, fix: str, *, low: float | None = None, high: float | None = None,
                   low_open: bool = False, high_open: bool = False, allow_none: bool = False) -> None:
    """``config.<name>`` is a finite number in the given range (or None where ``allow_none``)."""
    value = getattr(config, name, _ABSENT)
    if value is _ABSENT or (value is None and allow_none):
        return
    ok = _is_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            need = f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            need = f"must be {'>' if low_open else '>='} {low}"
        elif high is not None:
            need = f"must be {'<' if high_open else '<='} {high}"
        else:
            need = "must be a finite number"
        if (low is not None or high is not None) and not _is_number(value):
            need = "must be a finite number " + need.removeprefix("must be ")  # nan / inf / not a number
        fail(config, name, value, need + (" or None" if allow_none else ""), f"set {name} to {fix}")


def require_choice(config: Any, name: str, choices: tuple[str, ...]) -> None:
    """``config.<name>`` is one of ``choices``."""
    value = getattr(config, name)
    if value not in choices:
        fail(config, name, value, f"is not one of {', '.join(choices)}", f"set {name} to one of them")


def check_attention_backend(config: Any) -> None:
    """``attention_backend``: auto, a swiftune packed backend, or an attention implementation
    transformers knows (kept as is when the trainer loads the model from a path)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..attention import BACKENDS

    value = config.attention_backend
    known = ("auto", *BACKENDS)
    if value in known or value == "eager" or value in ALL_ATTENTION_FUNCTIONS or (
            isinstance(value, str) and "/" in value):  # a Hub kernel such as kernels-community/flash-attn
        return
    fail(config, "attention_backend", value, f"is not one of {', '.join(known)} (nor a transformers attention "
         "implementation)", "set attention_backend to auto (or one of those)")


def check_training_arguments(args: Any) -> None:
    """The lengths, counts and coefficients of transformers' ``TrainingArguments`` that it does not
    check itself (it checks warmup_steps, logging_steps == 0 and the step multiples of
    load_best_model_at_end). Runs after ``TrainingArguments.__post_init__``."""
    require_int(args, "per_device_train_batch_size", 1, "the examples (completions for GRPO) per device and "
                "micro-batch, e.g. 8")
    require_int(args, "per_device_eval_batch_size", 1, "the examples per device in an evaluation batch, e.g. 8")
    require_int(args, "gradient_accumulation_steps", 1, "the micro-batches per optimizer step (1: no accumulation)")
    require_number(args, "learning_rate", "the peak learning rate, e.g. 2e-5", low=0)
    require_number(args, "weight_decay", "0.0 (off) or a positive decay, e.g. 0.01", low=0)
    require_number(args, "adam_beta1", "a value in [0, 1), e.g. 0.9", low=0, high=1, high_open=True)
    require_number(args, "adam_beta2", "a value in [0, 1), e.g. 0.999", low=0, high=1, high_open=True)
    require_number(args, "adam_epsilon", "a small positive number, e.g. 1e-8", low=0)
    require_number(args, "max_grad_norm", "the gradient-norm clip, e.g. 1.0 (0 or None: no clipping)", low=0,
                   allow_none=True)
    if not _is_int(args.max_steps) or (args.max_steps < 1 and args.max_steps != -1):
        fail(args, "max_steps", args.max_steps, "must be a positive number of optimizer steps, or -1",
             "set max_steps to the steps to train, or -1 to train num_train_epochs epochs")
    require_number(args, "num_train_epochs", "the epochs to train, e.g. 1 (or set max_steps)", low=0)
    if args.max_steps == -1 and args.num_train_epochs == 0:
        fail(args, "num_train_epochs", args.num_train_epochs, "trains nothing (max_steps is -1)",
             "set num_train_epochs > 0 or max_steps to the steps to train")
    require_number(args, "logging_steps", "the steps between logs, e.g. 1 (a value < 1 is a fraction of the run)",
                   low=0, low_open=True)
    if getattr(args, "save_strategy", None) == "steps":
        require_number(args, "save_steps", "the steps between checkpoints, e.g. 500 (or save_strategy='no')",
                       low=0, low_open=True)
    if getattr(args, "eval_strategy", None) == "steps":
        require_number(args, "eval_steps", "the steps between evaluations, e.g. 100 (or eval_strategy='no')",
                       low=0, low_open=True, allow_none=True)
    require_int(args, "save_total_limit", 1, "the checkpoints to keep, or None to keep all", allow_none=True)
    require_int(args, "seed", 0, "a non-negative integer, e.g. 42")
    require_int(args, "data_seed", 0, "a non-negative integer, or None to use seed", allow_none=True)
    require_int(args, "dataloader_num_workers", 0, "0 (load in the main process) or the worker processes")
    output_dir = getattr(args, "output_dir", None)
    if output_dir and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        fail(args, "output_dir", output_dir, "is a file, not a folder", "give a folder (new or existing) for the "
             "model, checkpoints and metrics")
    check_report_to(args)


def check_report_to(args: Any) -> None:
    """Each ``report_to`` integration is installed: transformers finds out only when the trainer builds
    its callbacks, after the model has loaded, and then raises with a traceback."""
    try:
        from transformers.integrations.integration_utils import (INTEGRATION_TO_CALLBACK,
                                                                 get_available_reporting_integrations)
    except ImportError:  # another transformers layout: leave it to transformers
        return
    asked = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
    known = [r for r in asked if r in INTEGRATION_TO_CALLBACK]
    missing = [r for r in known if r not in get_available_reporting_integrations()] if known else []
    if missing:
        fail(args, "report_to", args.report_to, f"names {', '.join(missing)}, which is not installed here",
             f"install it (e.g. pip install {missing[0].replace('_', '-')}) or set report_to='none'")


_warned_once: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int = 2) -> None:
    """``message`` as a warning the first time ``key`` (a config class and field) is seen in this
    process: a field accepted but not (fully) honoured says so once, not at every construction.
    ``stacklevel`` counts from the caller, as ``warnings.warn``'s does."""
    if key in _warned_once:
        return
    _warned_once.add(key)
    warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def from_pretrained_kwargs(model_init_kwargs: dict[str, Any] | None, trust_remote_code: bool) -> dict[str, Any]:
    """TRL's ``model_init_kwargs`` / ``trust_remote_code`` as keywords of ``FastModel.from_pretrained``:
    ``torch_dtype`` (transformers' old name) becomes ``dtype`` unless ``dtype`` is given too."""
    kwargs = dict(model_init_kwargs or {})
    if trust_remote_code:
        kwargs.setdefault("trust_remote_code", True)
    if "torch_dtype" in kwargs and "dtype" not in kwargs:
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    return kwargs
