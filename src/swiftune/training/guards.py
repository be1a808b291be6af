"""Non-finite guards: stop at the first NaN/inf loss or gradient, never save NaN/inf weights.

transformers' ``Trainer`` carries on through a NaN loss (``logging_nan_inf_filter`` even logs the
average of the previous losses in its place) and saves whatever the weights became. The trainers
call these at the three places where a non-finite value first shows:

* :func:`check_loss`: the loss of every micro-batch, after its backward (the Trainer already
  synchronises on that value to filter it, so this costs no extra device sync);
* :func:`check_grad_norm`: the gradient norm of every optimizer step, before the optimizer uses it;
* :func:`check_weights`: every parameter before anything is saved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .loading import first_nonfinite_tensor


class NonFiniteError(FloatingPointError, ValueError):
    """Training produced a NaN or inf (loss, gradient or weight). ``step`` is the optimizer step (1-based).

    A ``ValueError`` too: what to change is an input (learning rate, dtype, data, model), and the
    ``swiftune`` command reports those in one line."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


ADVICE = ("lower learning_rate (or set max_grad_norm), use bf16 rather than fp16, and look for broken rows "
          "in the data")


def is_finite(value: Any) -> bool:
    """Whether a loss / norm (tensor or number) is finite everywhere (one device sync for a tensor)."""
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value.detach()).all())
    return value == value and abs(value) != float("inf")


def check_loss(loss: Any, step: int, micro_step: int | None = None, micro_steps: int | None = None,
               checkpoint_note: str = "") -> None:
    """Raise :class:`NonFiniteError` when ``loss`` is NaN or inf."""
    if loss is None or is_finite(loss):
        return
    value = float(loss.detach().float().reshape(-1)[0]) if isinstance(loss, torch.Tensor) else float(loss)
    where = f" (micro-batch {micro_step} of {micro_steps})" if micro_step is not None and micro_steps else ""
    raise NonFiniteError(
        f"step {step}: the training loss is {value}{where}; stopped before the optimizer step, so the weights "
        f"are still those of step {step - 1} and nothing of step {step} was saved.{checkpoint_note} "
        f"To continue: {ADVICE}; a model whose loss is NaN from step 1 may hold NaN weights.", step)


def check_grad_norm(grad_norm: Any, step: int, checkpoint_note: str = "") -> None:
    """Raise :class:`NonFiniteError` when the gradient norm of ``step`` is NaN or inf."""
    if grad_norm is None or is_finite(grad_norm):
        return
    value = float(grad_norm) if not isinstance(grad_norm, torch.Tensor) else float(grad_norm.detach().float())
    raise NonFiniteError(
        f"step {step}: the gradient norm is {value} (the loss was finite); stopped before the optimizer step, so "
        f"the weights are still those of step {step - 1} and nothing of step {step} was saved.{checkpoint_note} "
        f"To continue: {ADVICE}.", step)


def check_weights(model: nn.Module, step: int, where: str) -> None:
    """Raise :class:`NonFiniteError` naming the first parameter of ``model`` holding NaN or inf.
    ``where`` says what was about to happen (``"saving checkpoint-4"``)."""
    bad = first_nonfinite_tensor(model.named_parameters())
    if bad is None:
        return
    name, what = bad
    raise NonFiniteError(
        f"step {step}: the weight {name} holds non-finite values ({what}); refused {where}: a checkpoint of NaN/inf "
        f"weights is useless and would replace a good one. To continue: {ADVICE}.", step)
