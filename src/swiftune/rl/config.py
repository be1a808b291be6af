"""``GRPOConfig``: transformers' ``TrainingArguments`` plus the GRPO knobs.

Field names and meanings follow TRL's ``GRPOConfig`` wherever TRL has the same knob, so that a
TRL user changes imports only. The objective of each ``loss_type`` is written out in
:mod:`swiftune.rl.loss` and docs/grpo.md.

Batch vocabulary (TRL's):

* ``per_device_train_batch_size`` counts **completions** per micro-batch on one process;
* one *generation* samples ``per_device_train_batch_size * steps_per_generation`` completions per
  process, i.e. that number divided by ``num_generations`` prompts, each sampled ``num_generations``
  times (a *group*); it is consumed as ``steps_per_generation`` micro-batches, ``num_iterations``
  times over;
* ``steps_per_generation`` defaults to ``gradient_accumulation_steps``: one generation per
  optimizer step, and then the rollouts are exactly on-policy when ``num_iterations == 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments

from ..errors import ConfigError
from ..training.config_checks import (KERNEL_BACKENDS, check_attention_backend, check_training_arguments, fail,
                                      require_choice, require_int, require_number)
from .trl_fields import TRLGRPOFields, check_trl_fields

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
ROLLOUT_ENGINES = ("auto", "fast", "transformers")
#: the fast engine's KV cache (``FastRolloutEngine(kv_cache_dtype=...)``; the same names as rollout.kv_cache's)
ROLLOUT_KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass
class GRPOConfig(TrainingArguments, TRLGRPOFields):
    """Configuration of :class:`swiftune.GRPOTrainer` (TRL's names and meanings).

    Objective (per completion ``i`` of a group of ``G``, token ``t``; ``r = pi / pi_old``)::

        l_it = -min(r_it A_i, clip(r_it, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL3_it

    with the ratio capped at ``delta`` in the unclipped term when ``delta`` is set, ``r_it``
    replaced by the sequence's geometric-mean ratio for ``importance_sampling_level="sequence"``
    (GSPO), and ``l_it = -min(r_it, epsilon_high).detach() A_i log pi_it`` for ``cispo``. The
    normalisation of ``sum l_it`` depends on ``loss_type`` (see :func:`swiftune.rl.loss.grpo_loss`).

    Every length, count and coefficient is checked at construction, before any model or data is
    loaded (a :class:`swiftune.errors.ConfigError`, a ``ValueError``, names the field, the value and
    what to set instead): among them
    ``num_generations >= 2`` (as TRL: a group of one has no advantage), ``temperature > 0``,
    ``max_prompt_length`` a positive number of tokens or ``None`` for no limit, ``epsilon``,
    ``epsilon_high`` and ``beta`` >= 0.
    """

    # ----------------------------------------------------------------------- generation
    num_generations: int = field(
        default=8, metadata={"help": "Completions sampled per prompt (the group size G of the advantages)."}
    )
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Longest prompt in tokens; longer prompts keep their last tokens "
                                        "(None: no limit, as TRL 1.16, which has no such field)."}
    )
    max_completion_length: int = field(default=512, metadata={"help": "Most tokens sampled per completion "
                                                                      "(TRL 1.16's default, 512)."})
    temperature: float = field(
        default=1.0,
        metadata={"help": "Sampling temperature; the policy log-probs use the same temperature (as TRL)."},
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: keep the smallest set of tokens of "
                                                        "cumulative probability >= top_p (1.0: off)."})
    top_k: int | None = field(default=0, metadata={"help": "Keep only the k most likely tokens (0 / None: off; "
                                                           "TRL's default 0)."})
    min_p: float | None = field(
        default=None, metadata={"help": "Drop tokens with probability below min_p times the top one's (None: off)."}
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "Micro-batches consumed per generation (None: gradient_accumulation_steps, i.e. one "
                          "generation per optimizer step)."},
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={"help": "Completions per generation over all processes (TRL's meaning); an alternative to "
                          "steps_per_generation = generation_batch_size / (per_device_train_batch_size x processes)."},
    )
    rollout_engine: str = field(
        default="auto",
        metadata={"help": "Built-in rollout engine: fast (static KV cache, shared-prompt prefill, CUDA-graph decode "
                          "on CUDA; see docs/rollout.md), transformers (its generate with a KV cache), or auto: fast "
                          "on CUDA for the families it supports, transformers otherwise."},
    )
    rollout_kv_cache_dtype: str = field(
        default="auto",
        metadata={"help": "The fast rollout engine's KV cache: auto (the model's dtype) or fp8 (e4m3 codes with a "
                          "float32 scale per slot and head, about half the bytes: longer or more completions per "
                          "chunk, less to read each decode step). Sampling only: the policy's old log-probs are "
                          "recomputed by the policy model, not taken from the engine (see docs/rollout.md)."},
    )
    max_rollout_batch_size: int | None = field(
        default=None,
        metadata={"help": "Most completions the built-in rollout engine decodes at once (None: a whole generation)."},
    )
    max_prefill_tokens: int | str | None = field(
        default="auto",
        metadata={"help": "Vision-language policies (Qwen3-VL image prompts): most tokens (text and image) one rollout "
                          "prefill holds; a generation's prompts are prefilled in chunks under it, a longer prompt "
                          "alone. auto: from free CUDA memory (no cap on CPU); none: no cap. Text models: no effect "
                          "(another value than auto warns)."},
    )
    stop_token_ids: list[int] | None = field(
        default=None,
        metadata={"help": "Extra token ids that end a completion, besides the tokenizer's / generation config's "
                          "eos (and <|im_end|> for chat prompts)."},
    )
    # ----------------------------------------------------------------------- objective
    beta: float = field(
        default=0.0,
        metadata={"help": "Weight of the k3 KL estimator to the reference policy; 0 skips the reference pass. "
                          "LoRA: the reference is the same model with adapters disabled; full fine-tuning: a "
                          "frozen copy, made only when beta > 0."},
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range: the ratio is clipped at 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clipping range, 1 + epsilon_high (None: epsilon; DAPO uses 0.28). For cispo it "
                          "is the cap of the importance weight itself (None: 5.0, the value TRL recommends)."},
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "Two-sided clipping: cap the ratio of the unclipped term at delta (> 1 + epsilon), "
                          "INTELLECT-2 / TRL; None: off."},
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = field(
        default="dapo",
        metadata={"help": "Normalisation / objective: grpo (per-sequence mean, then batch mean), bnpo (tokens of "
                          "the micro-batch), dr_grpo (batch x max_completion_length), dapo (tokens of the whole "
                          "accumulated global batch), cispo (clipped IS weight x log-prob, dapo normalisation), sapo (soft "
                          "sigmoid gate, grpo normalisation), luspo (per-sequence sums), vespo (gamma-weighted "
                          "log-prob, dapo normalisation); formulas in swiftune.rl.loss."},
    )
    importance_sampling_level: Literal["token", "sequence"] = field(
        default="token",
        metadata={"help": "token: per-token ratios (GRPO); sequence: one length-normalised ratio per "
                          "completion (GSPO)."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "Advantage scaling: group ((r - mean_g) / (std_g + 1e-4)), batch (std over the whole "
                          "batch), none (r - mean_g). true/false are accepted as group/none."},
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Exclude completions that hit max_completion_length without a stop token from the loss "
                          "(they still count in the batch size of grpo / dr_grpo, as TRL)."},
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Optimisation passes over each generation (PPO epochs, mu). 1: the old log-probs are the "
                          "detached current ones."},
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function (None: all 1.0)."}
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={"help": "Seconds each reward function may take per generation; past it training stops with an "
                          "error naming the function (the functions then run in a worker thread). None: no limit."},
    )
    # ----------------------------------------------------------------------- swiftune
    share_prompt: bool | None = field(
        default=None,
        metadata={"help": "Encode each group's prompt once in the policy forward, its completions attending to it "
                          "but not to each other (exactly the unshared result). None: on when num_generations > 1."},
    )
    logit_chunk_tokens: int | None = field(
        default=None,
        metadata={"help": "Tokens per chunk of the fused LM head + selective log-softmax (None: chosen from free "
                          "memory)."},
    )
    offload_logits: bool = field(
        default=False,
        metadata={"help": "Keep the hidden states saved by the log-prob loss in pinned CPU memory (CUDA)."},
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "Packed attention backend: auto, varlen, flash_attn, flex, sdpa or reference. auto on "
                          "CUDA: sdpa (cuDNN's kernel on Hopper) for rows averaging >= 4096 tokens a sequence, else "
                          "flash_attn / varlen, and flex for shared-prompt rows; reference on CPU."},
    )
    kernel_backend: Literal["auto", "triton", "reference"] = field(
        default="auto",
        metadata={"help": "Fused kernels (and the log-prob block math): auto (Triton on CUDA, reference on CPU), "
                          "triton or reference."},
    )
    metrics_file: str | None = field(
        default="metrics.jsonl",
        metadata={"help": "Per-step metrics (JSON lines) written to output_dir; None (none on the command line) "
                          "disables it and the reward.png drawn from it."},
    )
    plot_rewards: bool = field(default=True, metadata={"help": "Write reward.png to output_dir at the end."})
    log_completions: bool = field(
        default=False, metadata={"help": "Print a table of the last generation's prompts, completions, rewards "
                                         "and advantages at every logging step (num_completions_to_print rows)."}
    )

    # TRL-like defaults for TrainingArguments fields
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=1, metadata={"help": "Log (and write metrics) every N steps."})
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Completions per micro-batch per device (TRL's meaning)."}
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: every dataset column is passed to the reward functions."}
    )

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if isinstance(self.scale_rewards, str) and self.scale_rewards.lower() in ("true", "false"):
            self.scale_rewards = "group" if self.scale_rewards.lower() == "true" else "none"
        super().__post_init__()
        check_training_arguments(self)
        check_trl_fields(self)
        self._check_fields()
        if self.generation_batch_size is not None:
            if self.steps_per_generation is not None:
                raise ConfigError("GRPOConfig: generation_batch_size and steps_per_generation are alternatives; "
                                 "set only one of them")
            per_step = self.per_device_train_batch_size * max(1, self.world_size)
            if self.generation_batch_size % per_step:
                raise ConfigError(f"GRPOConfig: generation_batch_size ({self.generation_batch_size}) must be a "
                                 f"multiple of per_device_train_batch_size x processes ({per_step}); set it to "
                                 f"{max(1, round(self.generation_batch_size / per_step)) * per_step}")
            self.steps_per_generation = self.generation_batch_size // per_step
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.epsilon_high is None:
            # cispo's epsilon_high caps the IS weight itself: TRL recommends 5.0, which is our default there
            self.epsilon_high = 5.0 if self.loss_type == "cispo" else self.epsilon
        if self.loss_type == "cispo" and self.epsilon_high == 0:
            fail(self, "epsilon_high", self.epsilon_high, "caps cispo's importance weight at 0 (no gradient at all)",
                 "set epsilon_high to the cap, e.g. 5.0 (or None for 5.0)")
        if self.share_prompt is None:
            self.share_prompt = self.num_generations > 1
        per_generation = self.per_device_train_batch_size * self.steps_per_generation
        if per_generation % self.num_generations:
            raise ConfigError(
                f"GRPOConfig: per_device_train_batch_size * steps_per_generation = {self.per_device_train_batch_size}"
                f" * {self.steps_per_generation} = {per_generation} completions per generation must be a multiple "
                f"of num_generations={self.num_generations} (whole groups on every process); change "
                f"per_device_train_batch_size, gradient_accumulation_steps / steps_per_generation or num_generations"
            )
        if self.delta is not None and self.delta <= 1 + self.epsilon_high and self.loss_type != "cispo":
            raise ConfigError(f"GRPOConfig: delta={self.delta!r} must exceed 1 + epsilon_high "
                             f"({1 + self.epsilon_high}); set delta higher (e.g. {1 + self.epsilon_high + 0.8:g}) "
                             "or None (off)")

    def _check_fields(self) -> None:
        """Each GRPO field on its own (before the derived ones are filled in)."""
        if self.neftune_noise_alpha is not None:
            # the Trainer's hook would add noise to the policy's forward but not to the rollouts' or the old and
            # reference log-probs' (eval mode), so the ratios would measure the noise
            fail(self, "neftune_noise_alpha", self.neftune_noise_alpha, "is an SFT option", "set it to None for GRPO")
        if self.label_smoothing_factor:
            fail(self, "label_smoothing_factor", self.label_smoothing_factor, "has no meaning for GRPO's policy "
                 "loss (no cross entropy)", "set it to 0.0")
        require_choice(self, "loss_type", LOSS_TYPES)
        require_choice(self, "importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS)
        if self.scale_rewards not in SCALE_REWARDS:
            fail(self, "scale_rewards", self.scale_rewards, f"is not one of {', '.join(SCALE_REWARDS)} (or true/false)",
                 "set scale_rewards to one of them")
        require_choice(self, "rollout_engine", ROLLOUT_ENGINES)
        require_choice(self, "rollout_kv_cache_dtype", ROLLOUT_KV_CACHE_DTYPES)
        if self.rollout_kv_cache_dtype != "auto" and self.rollout_engine == "transformers":
            fail(self, "rollout_kv_cache_dtype", self.rollout_kv_cache_dtype, "is the fast rollout engine's cache; "
                 "rollout_engine='transformers' keeps transformers' own cache in the model's dtype",
                 "set rollout_engine to 'fast' (or 'auto'), or rollout_kv_cache_dtype to 'auto'")
        require_choice(self, "kernel_backend", KERNEL_BACKENDS)
        check_attention_backend(self)
        require_int(self, "num_generations", 2, "the completions sampled per prompt, e.g. 8 (GRPO's advantage "
                    "compares the completions of one prompt: a group of 1 learns nothing)")
        require_int(self, "max_prompt_length", 1, "the longest prompt in tokens (e.g. 512), or None for no limit",
                    allow_none=True)
        require_int(self, "max_completion_length", 1, "the most tokens sampled per completion, e.g. 256")
        require_number(self, "temperature", "a sampling temperature > 0, e.g. 1.0 (a group needs different "
                       "completions; greedy decoding makes them identical)", low=0, low_open=True)
        require_number(self, "top_p", "a value in (0, 1], 1.0 for off", low=0, high=1, low_open=True)
        require_int(self, "top_k", 0, "the tokens kept, or 0 / None for off", allow_none=True)
        require_number(self, "min_p", "a value in [0, 1], or None for off", low=0, high=1, allow_none=True)
        require_int(self, "steps_per_generation", 1, "the micro-batches per generation, or None for "
                    "gradient_accumulation_steps", allow_none=True)
        require_int(self, "generation_batch_size", 1, "the completions per generation over all processes, or None",
                    allow_none=True)
        require_int(self, "max_rollout_batch_size", 1, "the most completions decoded at once, or None for a whole "
                    "generation", allow_none=True)
        self._resolve_max_prefill_tokens()
        if self.stop_token_ids is not None and not (
                isinstance(self.stop_token_ids, (list, tuple))
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids)):
            fail(self, "stop_token_ids", self.stop_token_ids, "must be a list of token ids (integers >= 0)",
                 "set stop_token_ids to e.g. [151645], or None")
        require_number(self, "beta", "0.0 (no KL term, no reference pass) or a positive KL weight, e.g. 0.04", low=0)
        require_number(self, "epsilon", "the lower clipping range, e.g. 0.2 (the ratio is clipped at 1 - epsilon)",
                       low=0)
        require_number(self, "epsilon_high", "the upper clipping range, e.g. 0.28, or None for epsilon", low=0,
                       allow_none=True)
        require_number(self, "delta", "the cap of the unclipped ratio (> 1 + epsilon_high), or None for off", low=1,
                       low_open=True, allow_none=True)
        require_int(self, "num_iterations", 1, "the optimisation passes per generation, e.g. 1")
        if self.reward_weights is not None and not (
                isinstance(self.reward_weights, (list, tuple))
                and all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                        for w in self.reward_weights)):
            fail(self, "reward_weights", self.reward_weights, "must be a list of finite numbers",
                 "set one weight per reward function, e.g. [1.0, 0.5], or None for all 1.0")
        require_int(self, "logit_chunk_tokens", 1, "tokens per chunk of the fused LM head, or None to choose it "
                    "from free memory", allow_none=True)
        require_number(self, "reward_timeout", "the seconds a reward function may take, or None for no limit",
                       low=0, low_open=True, allow_none=True)

    def _resolve_max_prefill_tokens(self) -> None:
        """``max_prefill_tokens``: a positive int, ``"auto"`` or ``None``; the command line's strings
        (``"4096"``, ``"none"``) read as those."""
        value = self.max_prefill_tokens
        if isinstance(value, str):
            lowered = value.strip().lower()
            value = None if lowered in ("none", "null") else int(lowered) if lowered.isdigit() else lowered
        if not (value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                                                     and value >= 1)):
            fail(self, "max_prefill_tokens", self.max_prefill_tokens,
                 "is not a positive number of tokens, 'auto' or None",
                 "set it to the most tokens one rollout prefill may hold (e.g. 32768), 'auto' (from free GPU "
                 "memory) or None (no cap)")
        self.max_prefill_tokens = value

    @property
    def completions_per_generation(self) -> int:
        """Completions one process samples per generation."""
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def prompts_per_generation(self) -> int:
        """Distinct prompts one process samples per generation."""
        return self.completions_per_generation // self.num_generations
