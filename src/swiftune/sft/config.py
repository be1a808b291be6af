"""``SFTConfig``: transformers' ``TrainingArguments`` plus the supervised fine-tuning knobs.

Field names follow TRL's ``SFTConfig`` where TRL has the same knob, so that a TRL user changes
imports only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import TrainingArguments

from ..errors import ConfigError
from ..training.config_checks import (KERNEL_BACKENDS, check_attention_backend, check_training_arguments, fail,
                                      require_choice, require_int)
from .trl_fields import check_dict_fields, check_trl_fields

TRUNCATION_MODES = ("truncate", "error", "drop")


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

    Every length, count and coefficient is checked at construction
    (:func:`swiftune.training.config_checks.check_training_arguments` for transformers' own fields),
    before any model or data is loaded: a :class:`swiftune.errors.ConfigError` (a ``ValueError``)
    names the field, the value and what to set instead.

    ``max_tokens_per_batch`` forms micro-batches by token budget instead of example count.
    The loss is normalised by the number of trained tokens in the whole accumulated batch, so
    ``gradient_accumulation_steps=4`` gives the gradients of one batch four times as large.
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
    truncation_mode: Literal["keep_start", "keep_end"] = field(
        default="keep_start",
        metadata={"help": "TRL's: which tokens truncation keeps, the first (keep_start) or the last (keep_end) "
                          "max_length."},
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keywords for apply_chat_template (e.g. {\"enable_thinking\": false}); a row's own "
                          "chat_template_kwargs column updates them."},
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={"help": "TRL's: a .jinja/.j2 file or a tokenizer directory whose chat template replaces the "
                          "tokenizer's."},
    )
    dataset_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "TRL's: {\"skip_prepare_dataset\": true} takes trainer-ready rows (input_ids, labels) as "
                          "they are."},
    )
    dataset_num_proc: int | None = field(
        default=None,
        metadata={"help": "TRL's: processes for dataset preparation. Accepted, not used: swiftune tokenizes in "
                          "batches in one process (a warning says so)."},
    )
    eos_token: str | None = field(
        default=None,
        metadata={"help": "TRL's: the token that ends a sequence or turn (set on the tokenizer and the model's "
                          "configs); None keeps the tokenizer's."},
    )
    pad_token: str | None = field(
        default=None,
        metadata={"help": "TRL's (deprecated there): the padding token set on the tokenizer; None keeps the "
                          "tokenizer's."},
    )
    shuffle_dataset: bool = field(
        default=False,
        metadata={"help": "TRL's: shuffle the prepared dataset (before packing) with the run's seed."},
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
    packing_strategy: str = field(
        default="bfd",
        metadata={"help": "TRL's: bfd (best-fit decreasing; longer documents cut by truncation) or bfd_split "
                          "(longer documents split into max_length pieces, each its own document); wrapped is "
                          "refused (it trains across document boundaries)."},
    )
    eval_packing: bool | None = field(
        default=None,
        metadata={"help": "TRL's: bin-pack the eval dataset too (None: as packing)."},
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "TRL's: pad every batch row to a multiple of this (auto: no padding off Neuron)."},
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
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "TRL's: keywords for FastModel.from_pretrained when the model is given as a path "
                          "(dtype, revision, ...)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "TRL's: allow model code from the Hub when loading from a path."}
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "TRL's: weight of the MoE load-balancing loss added to each micro-batch's loss (None: the "
                          "model config's router_aux_loss_coef; 0.0: off; an error on a model without a router)."},
    )
    loss_type: str = field(
        default="nll",
        metadata={"help": "TRL's: nll (cross entropy) or dft (each token's loss weighted by its detached "
                          "probability, Dynamic Fine-Tuning); chunked_nll is TRL's deprecated alias of nll."},
    )
    activation_offloading: bool = field(
        default=False,
        metadata={"help": "TRL's: keep activations in CPU memory. swiftune: offloaded gradient checkpointing (layer "
                          "inputs in pinned CPU memory, layers recomputed in backward)."},
    )
    logit_chunk_tokens: int | None = field(
        default=None,
        metadata={"help": "Tokens per chunk of the fused LM head + cross entropy (None: chosen from free memory)."},
    )
    cuda_graph_layers: bool = field(
        default=False,
        metadata={"help": "swiftune: run each decoder layer's forward and backward as CUDA graph replays (LoRA, "
                          "padding-free rows, checkpointing; token counts padded to buckets). Steps another layout "
                          "or setup cannot replay run as before. With activation_offloading=True the layer inputs "
                          "wait in pinned host memory between forward and backward."},
    )
    deferred_nonfinite_check: bool = field(
        default=False,
        metadata={"help": "swiftune: check the loss and gradient norm for NaN/inf without a device sync per step: "
                          "the fused optimizer skips a non-finite step's update on the device and training stops "
                          "with the same error one step later (before the next update, log or save). Needs "
                          "optim='adamw_torch_fused' (the default) and one process; turns transformers' "
                          "logging_nan_inf_filter off (it syncs every micro-batch)."},
    )
    # ---------------------------------------------------------------------- outputs
    metrics_file: str | None = field(
        default="metrics.jsonl",
        metadata={"help": "Per-step metrics (JSON lines) written to output_dir; None (none on the command line) "
                          "disables it and the loss.png drawn from it."},
    )
    plot_loss: bool = field(default=True, metadata={"help": "Write loss.png to output_dir at the end of training."})

    # TRL-like defaults for TrainingArguments fields
    learning_rate: float = field(default=2e-5, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=1, metadata={"help": "Log (and write metrics) every N steps."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Read as False: swiftune's tokenized rows hold only what its collators need "
                                          "(transformers' removal would drop completion_mask)."}
    )

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs", "dataset_kwargs", "chat_template_kwargs"]

    def __post_init__(self) -> None:
        # True is TRL's and transformers' default: its intent (the model sees only the columns it needs)
        # is what swiftune's tokenized rows already are, while transformers' removal would drop the
        # collators' completion_mask and silently train the prompt tokens too
        self.remove_unused_columns = False
        check_trl_fields(self)  # before anything else: they decide batch layout and checkpointing
        if self.packing and self.padding_free:
            raise ConfigError(
                "SFTConfig: packing=True and padding_free=True are alternative batch layouts: packing bin-packs "
                "the dataset into rows of max_length tokens (a micro-batch = per_device_train_batch_size rows, "
                "padded to the longest), padding_free concatenates each micro-batch into one row without "
                "padding; set only one of them (examples never attend across a boundary either way)"
            )
        if self.padding_free is None:
            self.padding_free = not self.packing
        super().__post_init__()
        check_training_arguments(self)
        check_dict_fields(self)
        require_int(self, "max_length", 1, "the longest tokenized example in tokens (e.g. 1024), or None to keep "
                    "every example whole", allow_none=True)
        require_choice(self, "truncation", TRUNCATION_MODES)
        require_choice(self, "kernel_backend", KERNEL_BACKENDS)
        check_attention_backend(self)
        require_int(self, "max_tokens_per_batch", 1, "a token budget per micro-batch, or None to batch "
                    "per_device_train_batch_size examples", allow_none=True)
        require_int(self, "logit_chunk_tokens", 1, "tokens per chunk of the fused LM head, or None to choose it "
                    "from free memory", allow_none=True)
        if self.label_smoothing_factor:
            fail(self, "label_smoothing_factor", self.label_smoothing_factor, "is not applied by swiftune's fused "
                 "cross entropy (transformers' LabelSmoother reads the full logits, which it never builds; TRL 1.16 "
                 "deprecates it in SFTTrainer for the same reason)",
                 "set it to 0.0")
        if self.neftune_noise_alpha is not None and not (
                isinstance(self.neftune_noise_alpha, (int, float)) and self.neftune_noise_alpha > 0):
            fail(self, "neftune_noise_alpha", self.neftune_noise_alpha, "must be a number > 0",
                 "e.g. 5, or None for no noise")
        if not isinstance(self.dataset_text_field, str) or not self.dataset_text_field:
            fail(self, "dataset_text_field", self.dataset_text_field, "must name a column",
                 "set it to the column holding the text (default 'text')")
        if self.packing and self.max_length is None:
            raise ConfigError("SFTConfig: packing=True needs max_length (the length of a packed row); "
                             "set max_length, e.g. 1024")
        if self.max_tokens_per_batch is not None and self.packing:
            raise ConfigError("SFTConfig: max_tokens_per_batch and packing=True are alternatives: packed rows "
                             "already fix the tokens per row; set only one of them")
        if self.deferred_nonfinite_check:
            if not isinstance(self.deferred_nonfinite_check, bool):
                fail(self, "deferred_nonfinite_check", self.deferred_nonfinite_check, "must be True or False",
                     "set it to True or False")
            if str(getattr(self.optim, "value", self.optim)) != "adamw_torch_fused":
                raise ConfigError(f"SFTConfig: deferred_nonfinite_check=True skips a non-finite step's update through "
                                  f"the fused AdamW's found_inf; optim={getattr(self.optim, 'value', self.optim)!r} "
                                  f"has none: set optim='adamw_torch_fused' or deferred_nonfinite_check=False")
            if self.fp16:
                raise ConfigError("SFTConfig: deferred_nonfinite_check=True with fp16=True: fp16's loss scaler "
                                  "already skips inf steps and syncs on them; use bf16=True, or "
                                  "deferred_nonfinite_check=False")
            self.logging_nan_inf_filter = False  # its per-micro-batch sync is what the deferred check avoids
        if self.cuda_graph_layers and not self.padding_free:
            raise ConfigError("SFTConfig: cuda_graph_layers=True replays one padding-free row per step; set "
                              "padding_free=True (the default without packing) or cuda_graph_layers=False")
        if self.max_length is not None and self.max_tokens_per_batch is not None \
                and self.max_tokens_per_batch < self.max_length:
            raise ConfigError(f"SFTConfig: max_tokens_per_batch ({self.max_tokens_per_batch}) must be at least "
                             f"max_length ({self.max_length}) so that the longest example fits a batch; raise "
                             f"max_tokens_per_batch or lower max_length")

    @property
    def batch_mode(self) -> str:
        if self.packing:
            return "packed"
        return "padding_free" if self.padding_free else "padded"
