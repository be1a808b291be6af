"""``SFTConfig``: transformers' ``TrainingArguments`` plus the supervised fine-tuning knobs.

Field names follow TRL's ``SFTConfig`` where TRL has the same knob, so that a TRL user changes
imports only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import TrainingArguments

TRUNCATION_MODES = ("truncate", "error", "drop")
KERNEL_BACKENDS = ("auto", "triton", "reference")


@dataclass
class SFTConfig(TrainingArguments):
    """Configuration of :class:`swiftune.SFTTrainer`.

    Batch modes (all give the same loss per step and the same gradients):

    * padding-free (the default): each micro-batch is ONE row of the examples concatenated,
      with ``position_ids`` restarting at every example and no padding at all.
    * ``packing=True``: the whole dataset is bin-packed best-fit-decreasing into rows of
      ``max_length`` tokens; a micro-batch is ``per_device_train_batch_size`` such rows, padded to
      the longest of them (positions restart at every example inside a row).
    * ``padding_free=False`` (and no packing): classic right padding (the reference).

    ``padding_free`` left unset (``None``) means padding-free unless ``packing=True``; after
    construction it holds the resolved value. ``packing=True`` with ``padding_free=True`` set
    explicitly is refused: the two are alternative batch layouts (TRL's packing is padding-free
    inside its packed rows; here that is always so), so choose one.

    Every length, count and coefficient is checked at construction (:func:`check_training_arguments`
    for transformers' own fields), before any model or data is loaded: a ``ValueError`` names the
    field, the value and what to set instead.

    ``max_tokens_per_batch`` forms micro-batches by token budget instead of example count.
    The loss is normalised by the number of trained tokens in the whole accumulated batch, so
    ``gradient_accumulation_steps=4`` equals one 4x batch.
    """

    # ----------------------------------------------------------------------- data
    dataset_text_field: str = field(
        default="text", metadata={"help": "Column holding plain text, for datasets of raw text."}
    )
    max_length: int | None = field(
        default=1024,
        metadata={"help": "Longest tokenized example (and packed row). None keeps every example whole."},
    )
    truncation: Literal["truncate", "error", "drop"] = field(
        default="truncate",
        metadata={"help": "What to do with examples longer than max_length: truncate (counted and reported), "
                          "error, or drop."},
    )
    completion_only_loss: bool | None = field(
        default=None,
        metadata={"help": "Train only on completion tokens of prompt/completion data (None: on where it applies)."},
    )
    assistant_only_loss: bool | None = field(
        default=None,
        metadata={"help": "Train only on assistant turns of conversational data (None: on where it applies)."},
    )
    # ---------------------------------------------------------------------- batches
    padding_free: bool | None = field(
        default=None,
        metadata={"help": "Concatenate each micro-batch into one row with restarting position_ids (no padding). "
                          "Unset: on unless packing=True; false: padded batches."},
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Bin-pack the dataset (best-fit decreasing) into rows of max_length tokens."},
    )
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": "Form micro-batches by a token budget instead of per_device_train_batch_size examples."},
    )
    # ---------------------------------------------------------------------- model / kernels
    attention_backend: str = field(
        default="auto",
        metadata={"help": "Packed attention backend: auto, varlen, flash_attn, flex, sdpa or reference (auto on "
                          "CUDA: sdpa for documents averaging >= 4096 tokens, else flash_attn, varlen, flex)."},
    )
    kernel_backend: Literal["auto", "triton", "reference"] = field(
        default="auto",
        metadata={"help": "Fused kernels: auto (Triton on CUDA, reference on CPU), triton or reference."},
    )
    logit_chunk_tokens: int | None = field(
        default=None,
        metadata={"help": "Tokens per chunk of the fused LM head + cross entropy (None: chosen from free memory)."},
    )
    # ---------------------------------------------------------------------- outputs
    metrics_file: str | None = field(
        default="metrics.jsonl",
        metadata={"help": "Per-step metrics (JSON lines) written to output_dir; None disables it."},
    )
    plot_loss: bool = field(default=True, metadata={"help": "Write loss.png to output_dir at the end of training."})

    # TRL-like defaults for TrainingArguments fields
    learning_rate: float = field(default=2e-5, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=1, metadata={"help": "Log (and write metrics) every N steps."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: swiftune's collators need the tokenized columns."}
    )

    def __post_init__(self) -> None:
        if self.packing and self.padding_free:
            raise ValueError(
                "SFTConfig: packing=True and padding_free=True are alternative batch layouts: packing bin-packs "
                "the dataset into rows of max_length tokens (a micro-batch = per_device_train_batch_size rows, "
                "padded to the longest), padding_free concatenates each micro-batch into one row without "
                "padding; set only one of them (examples never attend across a boundary either way)"
            )
        if self.padding_free is None:
            self.padding_free = not self.packing
        super().__post_init__()
        check_training_arguments(self)
        require_int(self, "max_length", 1, "the longest tokenized example in tokens (e.g. 1024), or None to keep "
                    "every example whole", allow_none=True)
        require_choice(self, "truncation", TRUNCATION_MODES)
        require_choice(self, "kernel_backend", KERNEL_BACKENDS)
        check_attention_backend(self)
        require_int(self, "max_tokens_per_batch", 1, "a token budget per micro-batch, or None to batch "
                    "per_device_train_batch_size examples", allow_none=True)
        require_int(self, "logit_chunk_tokens", 1, "tokens per chunk of the fused LM head, or None to choose it "
                    "from free memory", allow_none=True)
        if not isinstance(self.dataset_text_field, str) or not self.dataset_text_field:
            fail(self, "dataset_text_field", self.dataset_text_field, "must name a column",
                 "set it to the column holding the text (default 'text')")
        if self.packing and self.max_length is None:
            raise ValueError("SFTConfig: packing=True needs max_length (the length of a packed row); "
                             "set max_length, e.g. 1024")
        if self.max_tokens_per_batch is not None and self.packing:
            raise ValueError("SFTConfig: max_tokens_per_batch and packing=True are alternatives: packed rows "
                             "already fix the tokens per row; set only one of them")
        if self.max_length is not None and self.max_tokens_per_batch is not None \
                and self.max_tokens_per_batch < self.max_length:
            raise ValueError(f"SFTConfig: max_tokens_per_batch ({self.max_tokens_per_batch}) must be at least "
                             f"max_length ({self.max_length}) so that the longest example fits a batch; raise "
                             f"max_tokens_per_batch or lower max_length")

    @property
    def batch_mode(self) -> str:
        if self.packing:
            return "packed"
        return "padding_free" if self.padding_free else "padded"


# ----------------------------------------------------------------------------- validation helpers
# Shared with GRPOConfig (swiftune.rl.config), which builds on the same TrainingArguments.


def fail(config: Any, name: str, value: Any, need: str, fix: str) -> None:
    """Raise the ``ValueError`` of one bad field: its name, its value, what it must be, what to set."""
    raise ValueError(f"{type(config).__name__}: {name}={value!r} {need}; {fix}")


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
        fail(config, name, value, need + (" or None" if allow_none else ""), f"set {name} to {fix}")


def require_choice(config: Any, name: str, choices: tuple[str, ...]) -> None:
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


def check_training_arguments(args: TrainingArguments) -> None:
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
