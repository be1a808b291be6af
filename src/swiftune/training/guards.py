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


class DeferredNonFiniteCheck:
    """The loss and gradient-norm guards without a device sync per step (``SFTConfig(deferred_nonfinite_check=True)``).

    :func:`check_loss` and :func:`check_grad_norm` read their value on the host, which waits for the device to
    finish the backward before the host may launch the optimizer step or prepare the next batch: the device then
    idles through that host work. Here each micro-batch's loss and the step's gradient norm stay on the device:

    * :meth:`add_loss` / :meth:`add_grad_norm` keep them (and whether each is finite) as device tensors;
    * :meth:`found_inf` is the step's verdict on the device, a float32 ``1.0`` when any of them is NaN/inf: a
      fused optimizer given it as its ``found_inf`` (the mechanism PyTorch's ``GradScaler`` uses) skips that
      step's update on the device, leaving the weights and the optimizer's state exactly as they were;
    * :meth:`submit` copies the step's values to the host without waiting (pinned memory, an event on CUDA);
    * :meth:`resolve` reads the submitted step once its copy has landed (before the next optimizer step, a log
      or a save; the next step's forward has normally waited for it already) and raises the error the eager
      guards raise for that step.

    So a non-finite step stops training one step later than the eager guards say it, with the same message and
    the same guarantee: the weights are those of the step before it, and nothing after it was saved."""

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._grad_norm: torch.Tensor | None = None
        self._pending: tuple[int, int, bool, torch.Tensor, Any] | None = None
        self._step_values: torch.Tensor | None = None  # found_inf's gather of this step's values

    def add_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float().reshape(-1)[:1])

    def add_grad_norm(self, grad_norm: Any) -> None:
        if isinstance(grad_norm, torch.Tensor):
            self._grad_norm = grad_norm.detach().float().reshape(-1)[:1]
        elif grad_norm is not None:
            self._grad_norm = torch.tensor([float(grad_norm)])

    def _values(self) -> torch.Tensor | None:
        if not self._losses:
            return None
        device = self._losses[0].device
        grad = self._grad_norm.to(device) if self._grad_norm is not None else torch.zeros(1, device=device)
        return torch.cat([*self._losses, grad])

    def found_inf(self) -> torch.Tensor | None:
        """``1.0`` (float32, on the losses' device) when this step's losses or gradient norm are non-finite."""
        values = self._step_values = self._values()  # kept for submit: one gather of the step's values
        return None if values is None else (~torch.isfinite(values)).any().float()

    def submit(self, step: int) -> None:
        """Start copying optimizer step ``step``'s values to the host; the kept values are cleared."""
        values = self._step_values if self._step_values is not None else self._values()
        self._step_values = None
        micro_steps, has_norm = len(self._losses), self._grad_norm is not None
        self._losses, self._grad_norm = [], None
        if values is None:
            return
        event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = values.clone()
        self._pending = (step, micro_steps, has_norm, host, event)

    def resolve(self, checkpoint_note: Any = "") -> None:
        """Raise :class:`NonFiniteError` if the submitted step was non-finite (waits for its copy, normally
        landed long before). ``checkpoint_note``: the note's text, or a function making it (called only then)."""
        if self._pending is None:
            return
        step, micro_steps, has_norm, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        values = host.tolist()
        losses, grad_norm = values[:micro_steps], values[micro_steps] if has_norm else None
        bad = [i for i, v in enumerate(losses) if not is_finite(v)]
        if not bad and (grad_norm is None or is_finite(grad_norm)):
            return
        note = checkpoint_note() if callable(checkpoint_note) else checkpoint_note
        if bad:
            check_loss(losses[bad[0]], step, bad[0] + 1, micro_steps, note)
        check_grad_norm(grad_norm, step, note)
