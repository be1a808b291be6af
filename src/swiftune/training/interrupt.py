"""Ctrl-C during training: finish the step, save a checkpoint, stop, say where and how to resume.

While a trainer's ``train()`` runs, :class:`InterruptGuard` handles SIGINT: the first Ctrl-C only
sets a flag (the step in progress finishes: its weights and optimizer state stay consistent), and
:class:`InterruptCallback` turns the flag into "save a checkpoint now and stop" at the end of that
step; ``train()`` then raises :class:`TrainingInterrupted` (a ``KeyboardInterrupt``: scripts stop
as before, the shell sees exit status 130) whose message names the checkpoint and the resume
command. A second Ctrl-C stops at once, without saving. Under several processes the flag is
combined over all of them at every step end, so all save the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C after saving ``checkpoint`` (``None``: nothing could be saved)."""

    def __init__(self, message: str, step: int, checkpoint: str | None):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InterruptGuard:
    """``with InterruptGuard() as guard:`` the first SIGINT sets ``guard.requested``; a second one
    raises ``KeyboardInterrupt``. Outside the main thread (signals cannot be handled there) it does
    nothing."""

    def __init__(self, sigterm: bool = False) -> None:
        self.requested = False
        self.reason = "Ctrl-C"
        self._signals = (signal.SIGINT, signal.SIGTERM) if sigterm else (signal.SIGINT,)
        self._previous: dict[int, Any] = {}
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.requested:
            self._restore()
            raise KeyboardInterrupt(f"second {name}: stopped at once, without saving")
        self.requested, self.reason = True, name
        logger.warning("swiftune: %s: finishing this step, then saving a checkpoint and stopping "
                       "(press Ctrl-C again to stop at once, without saving)", name)

    def _restore(self) -> None:
        if self._installed:
            for signum, previous in self._previous.items():
                fallback = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                signal.signal(signum, previous if previous is not None else fallback)
            self._installed = False

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            try:
                for signum in self._signals:
                    self._previous[signum] = signal.getsignal(signum)
                    signal.signal(signum, self._handle)
                self._installed = True
            except (ValueError, OSError):  # an embedded interpreter without signal support
                self._installed = False
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()


def _any_process(flag: bool, args: Any) -> bool:
    """``flag`` or-ed over the processes of a distributed run (one tiny all-reduce; only when the
    Trainer runs distributed)."""
    if getattr(args, "world_size", 1) <= 1:
        return flag
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    device = args.device
    backend = torch.distributed.get_backend()
    dev = device if backend == "nccl" else "cpu"
    t = torch.tensor([1.0 if flag else 0.0], device=dev)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


class InterruptCallback(TrainerCallback):
    """At the end of a step after Ctrl-C: save a checkpoint (whatever ``save_strategy``) and stop."""

    def __init__(self, guard: InterruptGuard | None = None):
        self.guard = guard
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.guard is None:
            return control
        if _any_process(self.guard.requested, args):
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
        return control
