"""Per-step metrics for the trainers: a progress bar with loss and tokens/s, ``metrics.jsonl``
and a loss plot.

The trainer counts tokens as batches go through its loss (a :class:`TokenMeter`); the callback
turns those counts and transformers' logs into one JSON object a logged step. A fresh run starts
the file anew; a resumed one first drops the lines after the step it resumes from (steps a killed
run logged after its last checkpoint, which the resumed run logs again), so each step is there once.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm
from transformers import TrainerCallback


class StepFlops:
    """transformers' ``Trainer.floating_point_ops`` estimate, ``6 x input tokens x non-embedding
    parameters``, with the parameter count taken once per model.

    The Trainer recounts the parameters at every step, walking the whole module tree (thousands of
    modules for an 8B model with LoRA on every linear layer), which the host profile of a step shows
    in ``Module.named_modules``. The count of a model does not change while it trains; a different
    model object is counted afresh.
    """

    def __init__(self) -> None:
        self._model: weakref.ref | None = None
        self._count = 0

    def __call__(self, model: Any, inputs: dict[str, Any]) -> int:
        main_input = getattr(model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(model, "num_parameters"):
            return 0
        if self._model is None or self._model() is not model:
            self._model, self._count = weakref.ref(model), model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main_input].numel() * self._count


@dataclass
class TokenMeter:
    """Token counts since the last log: real tokens, trained tokens and padding slots.

    :meth:`take` also gives ``tokens_per_s`` over the time since the previous :meth:`take` (or
    :meth:`start`); the trainers add its result to the logs of every training step, so that every
    integration (tensorboard, wandb, ...) and ``metrics.jsonl`` receive the same numbers.
    """

    tokens: int = 0
    trained_tokens: int = 0
    padding: int = 0
    total_tokens: int = 0
    last_time: float | None = None
    #: the run's tokens over every process, when the trainer summed them (:meth:`sum_total`)
    run_tokens: int | None = None

    def start(self) -> None:
        self.last_time = time.perf_counter()

    def add(self, stats) -> None:
        self.tokens += stats.num_tokens
        self.trained_tokens += stats.num_trained_tokens
        self.padding += stats.num_padding_tokens
        self.total_tokens += stats.num_tokens

    def take(self, sum_over_processes: Callable[[list[float]], list[float]] | None = None) -> dict[str, float]:
        """The counts since the last take, and tokens/s. ``sum_over_processes``: the trainer's sum of a
        few numbers over every process (called on every process at once), so that a multi-process run
        logs the whole step's tokens, not rank 0's share."""
        now = time.perf_counter()
        elapsed = max(now - (self.last_time if self.last_time is not None else now), 1e-9)
        tokens, trained, padding = self.tokens, self.trained_tokens, self.padding
        if sum_over_processes is not None:
            tokens, trained, padding = (int(v) for v in sum_over_processes([tokens, trained, padding]))
        slots = tokens + padding
        out = dict(tokens=tokens, trained_tokens=trained, padding_fraction=padding / slots if slots else 0.0,
                   tokens_per_s=tokens / elapsed if self.last_time is not None else 0.0)
        self.tokens = self.trained_tokens = self.padding = 0
        self.last_time = now
        return out

    def sum_total(self, sum_over_processes: Callable[[list[float]], list[float]]) -> None:
        """:attr:`run_tokens`: :attr:`total_tokens` summed over every process (at the end of a run)."""
        self.run_tokens = int(sum_over_processes([self.total_tokens])[0])


class MetricsCallback(TrainerCallback):
    """Progress bar, ``metrics.jsonl`` (one object a logged training step) and a plot at the end.

    Each line has ``step``, ``loss``, ``learning_rate``, ``tokens`` (real tokens since the last
    line), ``tokens_per_s``, ``padding_fraction`` and whatever else the trainer logged. Evaluation
    results and, at the end, a summary of the run (steps, time, loss, tokens and tokens/s) are printed
    to the console (transformers' own printer is replaced by this callback).
    """

    def __init__(self, meter: TokenMeter, args, plot_key: str = "loss", plot_name: str = "loss.png"):
        self.meter = meter
        self.path = os.path.join(args.output_dir, args.metrics_file) if args.metrics_file else None
        self.plot = os.path.join(args.output_dir, plot_name) if getattr(args, "plot_loss", True) else None
        self.plot_key = plot_key
        self.first_step = 0  # the step this run starts from (a resumed run's checkpoint)
        self.bar = None
        self.last_record: dict[str, Any] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step
        if not state.is_world_process_zero:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        if self.path and state.global_step == 0 and os.path.exists(self.path):
            os.remove(self.path)  # a fresh run; a resumed one appends
        elif self.path and os.path.exists(self.path):
            truncate_metrics(self.path, state.global_step)
        if not args.disable_tqdm:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True)
        self.meter.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or logs is None:
            return
        # a training step logs its loss (GRPO's first step after a resume into a generation saved
        # with the checkpoint has no fresh reward yet: still a step, written like the others)
        if self.plot_key not in logs and "loss" not in logs:
            evals = {k: v for k, v in logs.items() if k.startswith("eval_") and isinstance(v, (int, float))}
            if evals and self.path:  # an evaluation: its own line, beside the training steps
                with open(self.path, "a") as f:
                    f.write(json.dumps({"step": state.global_step, **evals}) + "\n")
            if evals:
                self._print(f"eval at step {state.global_step}: {format_metrics(evals)}")
            if "train_runtime" in logs:
                tokens = self.meter.run_tokens if self.meter.run_tokens is not None else self.meter.total_tokens
                self._print(run_summary(state, logs, self.last_record, tokens, self.first_step))
            return
        # the trainer adds the token counts to its logs (SwiftuneTrainer.log); a trainer that does not
        # gets them here, for metrics.jsonl only
        counts = {} if "tokens_per_s" in logs else self.meter.take()
        record = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))},
                  **counts}
        self.last_record = record
        if self.bar is not None and self.plot_key in logs:
            self.bar.set_postfix({self.plot_key: f"{logs[self.plot_key]:.4f}",
                                  "tok/s": f"{record['tokens_per_s']:.0f}"}, refresh=False)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _print(self, text: str) -> None:
        (self.bar.write if self.bar is not None else tqdm.write)(text)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if state.is_world_process_zero and self.path and self.plot:
            plot_metric(self.path, self.plot, self.plot_key)


def format_metrics(metrics: dict[str, Any], limit: int = 12) -> str:
    """``key=value`` pairs, four significant digits, the first ``limit`` keys."""
    items = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(metrics.items())[:limit]]
    return ", ".join(items) + (", ..." if len(metrics) > limit else "")


def run_summary(state: Any, logs: dict[str, Any], last: dict[str, Any], total_tokens: int, first_step: int = 0) -> str:
    """The console line at the end of training: the steps this run trained (``first_step``: the step it
    resumed from), time, mean loss, tokens and their rate, and the last step's reward where the trainer
    logs one."""
    runtime = float(logs.get("train_runtime", 0.0))
    steps = state.global_step - first_step
    if first_step and steps <= 0:  # a finished run resumed again
        return (f"swiftune: nothing to train: the checkpoint is at step {first_step}, the run's last "
                f"(max_steps {state.max_steps}); the model is the checkpoint's")
    resumed = f" (steps {first_step + 1}-{state.global_step}, resumed)" if first_step else ""
    parts = [f"trained {steps} steps{resumed} in {runtime:.1f} s"]
    if "train_loss" in logs:
        parts.append(f"mean loss {logs['train_loss']:.4g}")
    parts.append(f"{total_tokens} tokens ({total_tokens / runtime:.0f} tokens/s)" if runtime > 0
                 else f"{total_tokens} tokens")
    if "reward" in last:
        parts.append(f"last reward {last['reward']:.4g}")
    return "swiftune: " + ", ".join(parts)


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep the lines of ``path`` up to ``last_step`` (the step a run resumes from); returns how many
    were dropped. A line that is not JSON (cut short by a kill) is dropped too. Rewritten atomically."""
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, (int, float)) and step > last_step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return dropped


def plot_metric(metrics_path: str, png_path: str, key: str = "loss") -> bool:
    """Plot ``key`` against ``step`` from a metrics.jsonl; False (and no file) without matplotlib
    or without any logged value."""
    if not os.path.exists(metrics_path):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in read_metrics(metrics_path) if key in r]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.plot([r["step"] for r in rows], [r[key] for r in rows], lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return True
