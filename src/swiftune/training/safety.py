"""What both trainers add to transformers' ``Trainer`` so that faults end in a clear error and
finished work is never lost (:class:`RunSafetyMixin`, mixed in before ``Trainer``):

* NaN/inf: the first non-finite loss (every micro-batch) or gradient norm (every optimizer step)
  stops training with an error naming the step, before the optimizer uses it; weights are checked
  before training and before every save, and non-finite ones are never written (:mod:`.guards`);
* checkpoints are written into a hidden folder and renamed to ``checkpoint-N`` once complete, with
  a completion marker holding the run's key settings; ``resume_from_checkpoint=True`` takes the
  newest complete one and warns when its settings differ from the run's; a failed write (a full
  disk) says so, removes the partial folder and leaves the previous checkpoints usable
  (:mod:`.checkpoints`);
* one run per ``output_dir`` (:mod:`.run_lock`);
* Ctrl-C (and SIGTERM with ``enable_jit_checkpoint=True``) finishes the step, saves a checkpoint and
  stops with a message saying how to resume (:mod:`.interrupt`).

A trainer sets :attr:`settings_keys` / :attr:`trainer_kind` and may write more files into each
checkpoint in :meth:`save_checkpoint_extras` (GRPO: the rollout buffer).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from typing import Any

from ..errors import ConfigError
from .loading import first_nonfinite_tensor
from .checkpoints import (
    FINAL_STAGING_NAME,
    TRAINER_STATE_NAME,
    checkpoint_name,
    checkpoint_problem,
    dataset_fingerprint,
    is_write_failure,
    newest_complete_checkpoint,
    prepare_staging,
    publish,
    remove_stale_staging,
    resolve_resume,
    resume_problem,
    rotate_checkpoints,
    run_settings,
    save_failure,
    staging_run_dir,
    warn_on_changed_settings,
    warn_on_earlier_checkpoints,
    write_marker,
)
from .guards import DeferredNonFiniteCheck, NonFiniteError, check_grad_norm, check_loss, check_weights, is_finite
from .interrupt import InterruptCallback, InterruptGuard, TrainingInterrupted
from .run_lock import RunLock

logger = logging.getLogger(__name__)

# TrainingArguments fields a resumed run should share with its checkpoint (the schedule length,
# logging and saving options may change).
COMMON_SETTINGS_KEYS = (
    "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay", "optim", "adam_beta1",
    "adam_beta2", "per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "seed", "data_seed",
    "bf16", "fp16",
)


class RunSafetyMixin:
    """Mixed into a ``transformers.Trainer`` subclass, before ``Trainer`` (see the module doc)."""

    trainer_kind: str = "trainer"
    settings_keys: tuple[str, ...] = COMMON_SETTINGS_KEYS
    _staging_run_dir: str | None = None

    # ------------------------------------------------------------------------ hooks for trainers

    def save_checkpoint_extras(self, checkpoint_dir: str) -> None:
        """Write the trainer's own files into ``checkpoint_dir`` (every process; before the marker)."""

    def run_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records and a resume compares."""
        settings = run_settings(self.trainer_kind, self.args, self.settings_keys, model=self.model,
                                num_processes=self.accelerator.num_processes)
        return {**settings, **self._data_fingerprint()}

    def _data_fingerprint(self) -> dict[str, Any]:
        """The training data's fingerprint (:func:`dataset_fingerprint`), computed once per dataset."""
        dataset = getattr(self, "train_dataset", None)
        cached = self.__dict__.get("_swiftune_data_fingerprint")
        if cached is None or cached[0] is not dataset:
            cached = self.__dict__["_swiftune_data_fingerprint"] = (
                dataset, dataset_fingerprint(dataset) if dataset is not None else {})
        return cached[1]

    # ------------------------------------------------------------------------ train

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any):
        args = self.args
        lock = RunLock(args.output_dir).acquire() if self.is_world_process_zero() else None
        # enable_jit_checkpoint (transformers' option): SIGTERM, a scheduler's preemption, too; transformers' own
        # handler saved before the optimizer step and ended train() as if finished (the command exited 0)
        sigterm = bool(getattr(args, "enable_jit_checkpoint", False))
        if sigterm:
            self._drop_jit_checkpoint_callback()
        guard = InterruptGuard(sigterm=sigterm)
        stopper = InterruptCallback(guard)
        self.add_callback(stopper)
        try:
            with guard:
                if self.is_world_process_zero():
                    remove_stale_staging(args.output_dir)  # may publish a staged checkpoint: before any lists
                self.accelerator.wait_for_everyone()
                resume = resolve_resume(resume_from_checkpoint, args.output_dir)
                if resume is not None:
                    settings = self.run_settings()
                    problem = resume_problem(resume, settings)
                    if problem is not None:  # every process reads the marker: all stop here
                        raise ConfigError(f"resume_from_checkpoint: cannot resume from {resume}: {problem}")
                    if self.is_world_process_zero():
                        warn_on_changed_settings(resume, settings)
                if resume is None:
                    self._refuse_nonfinite_start()
                    if self.is_world_process_zero():
                        warn_on_earlier_checkpoints(args.output_dir, args.save_total_limit)
                output = super().train(resume_from_checkpoint=resume, trial=trial,
                                       ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self.remove_callback(stopper)
            if lock is not None:
                lock.release()
        if stopper.stopped_at is not None:
            self._stopped_by_ctrl_c(stopper.stopped_at, trial, guard.reason)
        self._resolve_deferred_check()  # the last step's verdict (a deferred check's)
        return output

    def _run_epoch(self, *args: Any, **kwargs: Any):
        # A run resumed from a checkpoint of its last step (a finished run resumed again, e.g. a job
        # requeued after it ended): transformers' loop checks max_steps only after a step, so it
        # trained one step past max_steps (on a schedule past its end) and saved that as the result.
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _drop_jit_checkpoint_callback(self) -> None:
        """Remove transformers' JIT checkpoint callback and give SIGTERM its handler of before (the
        guard of :meth:`train` handles SIGTERM instead)."""
        for callback in list(self.callback_handler.callbacks):
            if type(callback).__name__ == "JITCheckpointCallback":
                manager = getattr(callback, "jit_manager", None)
                if manager is not None and manager._original_sigterm_handler is not None:
                    signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
                self.remove_callback(callback)

    def _refuse_nonfinite_start(self) -> None:
        bad = first_nonfinite_tensor(self.model.named_parameters())
        if bad is not None:
            raise NonFiniteError(f"the model holds non-finite weights before the first step: {bad[0]} ({bad[1]}); "
                                 "it was loaded or built with NaN/inf weights, and every loss and gradient would be "
                                 "NaN. Train from a finite checkpoint.", 0)

    def _stopped_by_ctrl_c(self, step: int, trial: Any, reason: str = "Ctrl-C") -> None:
        run_dir = super()._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, checkpoint_name(step))
        saved = folder if checkpoint_problem(folder) is None else None
        where = f"saved {saved}" if saved else "no checkpoint could be saved"
        message = (f"training stopped by {reason} after step {step} of {self.state.max_steps}: {where}. Resume with "
                   f"trainer.train(resume_from_checkpoint=True) and the same output_dir (the command line: the same "
                   f"command with --resume_from_checkpoint true).")
        logger.warning("swiftune: %s", message)
        raise TrainingInterrupted(message, step, saved)

    # ------------------------------------------------------------------------ non-finite guards

    def _checkpoint_note(self) -> str:
        newest, _ = newest_complete_checkpoint(self.args.output_dir)
        if newest is None:
            return ""
        return f" The newest complete checkpoint is {newest}: resume from it after the change."

    # A deferred check (SFTConfig(deferred_nonfinite_check=True)) keeps the loss and gradient norm on the device
    # and has the fused optimizer skip a non-finite step's update there (guards.DeferredNonFiniteCheck); the
    # verdict is read before the next optimizer step, a log, a save and at the end of training.

    @property
    def _deferred_check(self) -> DeferredNonFiniteCheck | None:
        return self.__dict__.get("_deferred_nonfinite_check")

    def create_optimizer(self, *args: Any, **kwargs: Any):
        optimizer = super().create_optimizer(*args, **kwargs)
        if getattr(self.args, "deferred_nonfinite_check", False):  # a new optimizer (a new train()): new hooks
            torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper, or the optimizer
            if self.args.world_size > 1:
                # each process would judge its own losses: one could skip an update the others apply
                raise ValueError(f"deferred_nonfinite_check=True runs in one process for now; this run has "
                                 f"{self.args.world_size}: set deferred_nonfinite_check=False for multi-GPU training")
            if not torch_optimizer.defaults.get("fused"):
                raise ValueError(f"deferred_nonfinite_check=True needs a fused optimizer (it skips a non-finite "
                                 f"step's update on the device through the optimizer's found_inf), got "
                                 f"{type(torch_optimizer).__name__} without fused=True; set optim='adamw_torch_fused' "
                                 f"or deferred_nonfinite_check=False")
            check = self.__dict__["_deferred_nonfinite_check"] = DeferredNonFiniteCheck()

            def before_step(opt, args, kwargs):
                self._resolve_deferred_check()  # the step before this one
                opt.found_inf = check.found_inf()

            def after_step(opt, args, kwargs):
                opt.found_inf = None
                check.submit(self.state.global_step + 1)

            torch_optimizer.register_step_pre_hook(before_step)
            torch_optimizer.register_step_post_hook(after_step)
        return optimizer

    def _resolve_deferred_check(self) -> None:
        if self._deferred_check is not None:
            self._deferred_check.resolve(self._checkpoint_note)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        self._resolve_deferred_check()  # never log a step whose loss was NaN: stop there instead
        super().log(logs, *args, **kwargs)

    def training_step(self, model, *args: Any, **kwargs: Any):
        loss = super().training_step(model, *args, **kwargs)
        if self._deferred_check is not None:
            if loss is not None:
                self._deferred_check.add_loss(loss)
            return loss
        step = self.state.global_step + 1
        if getattr(self, "_guard_step", None) != step:
            self._guard_step, self._guard_micro = step, 0
        self._guard_micro += 1
        if loss is not None and not is_finite(loss):  # the Trainer's NaN filter syncs on it next anyway
            micro_steps = (getattr(self, "current_gradient_accumulation_steps", None)
                           or self.args.gradient_accumulation_steps)
            check_loss(loss, step, self._guard_micro, micro_steps, self._checkpoint_note())
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self._deferred_check is not None:
            self._deferred_check.add_grad_norm(grad_norm)
            return grad_norm
        # fp16 with a loss scaler: inf gradients are expected now and then (the scaler skips the step)
        if getattr(self.accelerator, "scaler", None) is None and grad_norm is not None and not is_finite(grad_norm):
            check_grad_norm(grad_norm, self.state.global_step + 1, self._checkpoint_note())
        return grad_norm

    # ------------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._resolve_deferred_check()
        if self._staging_run_dir is None:  # a checkpoint's weights were checked before staging it
            target = output_dir or self.args.output_dir
            if os.path.basename(os.path.normpath(target)) == FINAL_STAGING_NAME:  # the commands' staged final save
                target = os.path.dirname(os.path.normpath(target))
            check_weights(self.model, self.state.global_step, f"saving the model to {target}")
        super().save_model(output_dir, _internal_call)

    def _get_output_dir(self, trial: Any) -> str:
        if self._staging_run_dir is not None:  # the Trainer writes checkpoint-N under the staging folder
            return self._staging_run_dir
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial: Any) -> None:
        step = self.state.global_step
        run_dir = super()._get_output_dir(trial=trial)
        name = checkpoint_name(step)
        final = os.path.join(run_dir, name)
        self._resolve_deferred_check()  # a non-finite step is never saved, as with the eager guards
        check_weights(self.model, step, f"saving {final}")
        main = self.args.should_save
        if self.args.push_to_hub:  # uploads read the folder in the background: write it in place
            super()._save_checkpoint(model, trial)
            self.save_checkpoint_extras(final)
            self.accelerator.wait_for_everyone()
            if main:
                write_marker(final, step, self.run_settings(), self.args.save_only_model)
            return
        staging = staging_run_dir(run_dir, step)
        try:
            if main:
                prepare_staging(run_dir, step)
            self.accelerator.wait_for_everyone()
            staged = os.path.join(staging, name)
            self._staging_run_dir = staging
            try:
                super()._save_checkpoint(model, trial)
                self.save_checkpoint_extras(staged)
            finally:
                self._staging_run_dir = None
            self.accelerator.wait_for_everyone()
            if main:
                best = self.state.best_model_checkpoint
                if best and os.path.abspath(best).startswith(os.path.abspath(staging) + os.sep):
                    self.state.best_model_checkpoint = os.path.join(run_dir, os.path.relpath(best, staging))
                    self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
                write_marker(staged, step, self.run_settings(), self.args.save_only_model)
                publish(staged, final)
                rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
            self.accelerator.wait_for_everyone()
        except BaseException as error:
            self._staging_run_dir = None
            if main:
                shutil.rmtree(staging, ignore_errors=True)
            if is_write_failure(error):
                raise save_failure(error, run_dir, step) from error
            raise

