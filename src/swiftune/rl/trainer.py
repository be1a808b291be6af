"""``GRPOTrainer``: group-relative policy optimisation on transformers' ``Trainer``.

One *generation* (every ``steps_per_generation`` micro-batches, ``num_iterations`` passes over it):

1. prompts of the next ``per_device_train_batch_size * steps_per_generation / num_generations``
   dataset rows are tokenized (chat template for conversational prompts; longer than
   ``max_prompt_length``: the last tokens are kept);
2. the :class:`~swiftune.rl.rollout.RolloutEngine` samples ``num_generations`` completions of each;
3. the reward functions score them (:mod:`swiftune.rl.rewards`) and group advantages follow
   (:mod:`swiftune.rl.advantages`);
4. the completions are cut, in order, into ``steps_per_generation`` micro-batches of
   ``per_device_train_batch_size``; each becomes one packed row (:mod:`swiftune.rl.policy`; with
   ``share_prompt`` each group's prompt appears once); the old log-probs (only when the rollouts
   are reused: ``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``)
   and the reference log-probs (``beta > 0``) are computed here, without gradient.

Each training micro-step then runs the policy forward on its row and the loss of
:mod:`swiftune.rl.loss` (on a mixture-of-experts policy plus TRL's router load-balancing term,
:class:`swiftune.training.router_aux.RouterAuxLoss` over the row's routed tokens). Checkpoints also hold the unfinished generation's micro-batches
(:mod:`swiftune.rl.checkpoint`), so a resumed run continues exactly. Everything else (optimizer,
schedules, checkpoints, DDP launch, logging integrations) is transformers'. Metrics, under TRL 1.16's
names (:mod:`swiftune.rl.grpo_metrics`), go to every integration, the progress bar, ``metrics.jsonl``
and, at the end, ``reward.png`` in ``output_dir``; TRL's config fields beyond these knobs are in
:mod:`swiftune.rl.trl_fields` (docs/trl_compat_grpo.md).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from ..data import BatchStats
from ..errors import ConfigError
from ..models import causal_lm_of
from ..models.moe import moe_config
from ..models.support import batch_layout_for
from ..training import MetricsCallback, SwiftuneTrainer, TokenMeter
from ..training.lora_casting import lora_input_casting
from ..training.router_aux import RouterAuxLoss
from ..training.safety import COMMON_SETTINGS_KEYS
from .advantages import group_advantages
from .aggregation import normalize_then_sum
from .batching import (GenerationBatchSampler, collate_prompt_rows, EpochLoader, generation_stop_ids,
                       is_conversational, prompt_rows_of, prompt_token_ids, reward_columns)
from .checkpoint import load_rollout_state, save_rollout_state, saved_engine_rng_state, saved_generation_metrics
from .completions_log import RewardLogs, completion_rows, print_completions
from .evaluation import evaluate_rewards
from .config import GRPOConfig
from .grpo_metrics import MetricLog, generation_metrics, reduce_loss_metrics
from .loss import CLIPPED_LOSS_TYPES, grpo_loss, high_entropy_mask
from .trl_runtime import RefModelSync, disable_dropout, model_load_kwargs, trl_trainer_arguments
from .multimodal import VisionGRPO, VisionRolloutEngine, is_vision_language
from .policy import PolicyRow, build_policy_row, completion_logprobs, router_token_weights
from .rewards import RewardFunc, compute_rewards, reward_func_name
from .rollout import FastRolloutEngine, RolloutEngine, SamplingParams, TransformersRolloutEngine
from .rollout.fast import SUPPORTED
from .rollout.vision_fast import VISION_FAST_TYPES, VisionFastRolloutEngine

logger = logging.getLogger(__name__)

@dataclass
class GRPOMicroBatch:
    """What one training micro-step needs (built at generation time)."""

    row: PolicyRow
    advantages: torch.Tensor  # [B]
    token_mask: torch.Tensor  # [N] 1 = the token counts in the loss
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    num_items_in_batch: float


@dataclass
class SampledGroups:
    """Completions of a batch of prompts and their rewards (``num_generations`` per prompt, prompt-major)."""

    prompts: list[Any]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    finished: torch.Tensor  # [N] bool: ended with a stop token
    rewards: torch.Tensor  # [N] weighted sum of the reward functions
    per_func: torch.Tensor  # [N, F] each function's reward (NaN: None)
    generation_s: float
    vision_prompts: list | None = None  # image prompts of a vision-language policy (swiftune.rl.multimodal)


class GRPOTrainer(SwiftuneTrainer):
    """GRPO (and DAPO, Dr. GRPO, GSPO, CISPO) with packed rollouts and a chunked log-prob loss.

    Runs are guarded as SFT's are (:class:`swiftune.training.RunSafetyMixin`: NaN/inf stops, complete
    checkpoints, resume from the newest complete one, one run per output_dir, Ctrl-C saves) and
    start as SFT's do (:class:`swiftune.training.SwiftuneTrainer`: loading, adapters, patching).

    Args:
        model: a transformers causal LM, a PEFT model, or a path (loaded with
            :meth:`swiftune.FastModel.from_pretrained`). It is patched with swiftune's kernels and
            packed attention if it is not already.
        reward_funcs: one reward function or a list (TRL's signature; see :mod:`swiftune.rl.rewards`).
        args: a :class:`GRPOConfig`.
        train_dataset: rows with a ``"prompt"`` (a string or a list of messages) and any other
            columns (passed to the reward functions): an HF ``Dataset``, a list of dicts or a path.
        processing_class: the tokenizer; for a vision-language policy (Qwen3-VL) its processor, and the
            prompts may hold images (:mod:`swiftune.rl.multimodal`).
        peft_config: a ``peft.LoraConfig`` to wrap a plain model with adapters.
        rollout_engine: a :class:`~swiftune.rl.rollout.RolloutEngine` (default: the built-in
            :class:`~swiftune.rl.rollout.TransformersRolloutEngine` on the training model).
    """

    config_class = GRPOConfig
    default_output_dir = "swiftune_output/grpo"

    def __init__(
        self,
        model: nn.Module | str,
        reward_funcs: RewardFunc | Sequence[RewardFunc],
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        rollout_engine: RolloutEngine | None = None,
        **kwargs: Any,
    ):
        args = self.resolve_args(args)
        processing_class = self.processing_class_of(processing_class, kwargs)
        load_kwargs = model_load_kwargs(args, model)
        extra = trl_trainer_arguments(model, reward_funcs, kwargs)  # TRL's own arguments, before any model loads
        if "quantization_config" in extra and "quantization_config" in load_kwargs:
            raise ConfigError("GRPOTrainer: quantization_config is given both as an argument and in "
                              "GRPOConfig.model_init_kwargs; give it once")
        model, processing_class = self.prepare_model(
            model, args, processing_class, train_dataset, peft_config,
            missing_tokenizer="GRPOTrainer needs the tokenizer: pass processing_class=tokenizer",
            missing_dataset="GRPOTrainer needs a train_dataset of rows with a 'prompt'",
            **load_kwargs, **extra,
        )
        if args.disable_dropout:
            disable_dropout(model)
        batch_layout_for(model, "padding_free", trainer="GRPO")  # refuses encoders; warns: padded policy rows

        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("GRPOTrainer needs at least one reward function")
        for f in funcs:
            if not callable(f):
                raise TypeError(f"reward functions must be callables f(prompts, completions, **kwargs); got "
                                f"{type(f).__name__} (reward models by name are not supported: wrap one in a function)")
        self.reward_funcs: list[Callable] = funcs
        self.reward_func_names = [reward_func_name(f) for f in funcs]
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(f"{len(weights)} reward_weights for {len(funcs)} reward functions")
        self.reward_weights = [float(w) for w in weights]

        rows = prompt_rows_of(train_dataset, "train_dataset")
        eval_rows = prompt_rows_of(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        if len(rows) < args.prompts_per_generation:
            raise ValueError(f"train_dataset has {len(rows)} rows, fewer than the {args.prompts_per_generation} "
                             "prompts of one generation")

        limit = getattr(causal_lm_of(model).config, "max_position_embeddings", None)
        longest = (args.max_prompt_length or 0) + args.max_completion_length
        if limit and longest > limit:
            logger.warning("swiftune: max_prompt_length + max_completion_length = %d tokens exceeds the model's "
                           "max_position_embeddings = %d: positions past it were never trained (lower "
                           "max_completion_length, or extend the context with rope_scaling first)", longest, limit)

        self.is_peft = hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")
        self.ref_model = None
        if args.beta != 0.0 and not self.is_peft:  # full fine-tuning: a frozen copy, only when needed
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if args.sync_ref_model and self.is_peft:
            raise ValueError("sync_ref_model needs a reference copy to move, and with LoRA the reference is the base "
                             "model under the adapters: set sync_ref_model=False, or fine-tune fully")

        # TRL 1.16's MoE term: coef * aux of each micro-batch's policy forward (None: the model config's
        # coefficient, 0.0: off); TRL's GRPOTrainer leaves the model config as it is
        self.router_aux = RouterAuxLoss(model, args.router_aux_loss_coef, configure_model=False)
        text_config = causal_lm_of(model).config
        if (moe_config(model) is None and hasattr(text_config, "output_router_logits")
                and getattr(text_config, "router_aux_loss_coef", 0.0) and args.router_aux_loss_coef is None):
            # TRL would add the model config's term; say so rather than train differently in silence
            logger.warning("swiftune: %s is a mixture-of-experts architecture swiftune does not patch, so GRPO adds "
                           "no router load-balancing loss (TRL adds router_aux_loss_coef = %g from the model "
                           "config): the routers train on the policy loss alone", type(causal_lm_of(model)).__name__,
                           text_config.router_aux_loss_coef)
        self.token_meter = TokenMeter()
        super().__init__(
            model=model, args=args, data_collator=collate_prompt_rows, train_dataset=rows, eval_dataset=eval_rows,
            processing_class=processing_class, callbacks=callbacks, optimizers=optimizers, **kwargs,
        )
        # compute_loss returns losses that transformers divides by the accumulation steps (see there)
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False
        metrics_cb = MetricsCallback(self.token_meter, args, plot_key="reward", plot_name="reward.png")
        if not args.plot_rewards:
            metrics_cb.plot = None
        self.use_swiftune_callbacks(metrics_cb)
        if self.ref_model is not None:
            self.ref_model.to(self.args.device)
            if args.sync_ref_model:
                self.add_callback(RefModelSync(model, self.ref_model, args.ref_model_mixup_alpha,
                                               args.ref_model_sync_steps))

        # a vision-language policy: image prompts, their rollouts and policy rows (swiftune.rl.multimodal)
        self.vision = VisionGRPO(self.model, processing_class) if is_vision_language(self.model) else None
        tok = self.vision.tokenizer if self.vision is not None else processing_class
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.rollout_engine = rollout_engine or self._builtin_engine(pad)
        self._engine_step = 0  # global_step the engine's weights correspond to
        self._buffer: list[GRPOMicroBatch] | None = None
        self._micro_step = 0
        self._said_prompt_cut = False  # a prompt longer than max_prompt_length is said once a run
        # TRL's metric names (grpo_metrics): the loss's per mode, a training generation's apart
        self._metrics = {"train": MetricLog(), "eval": MetricLog()}
        self._gen_log = MetricLog()
        self._last_gen_metrics: dict[str, float] = {}
        self.reward_logs = RewardLogs()  # what reward functions log through log_metric / log_extra
        self._table: tuple[list[str], list[list[str]]] | None = None  # log_completions

    # ------------------------------------------------------------------------ data


    def _builtin_engine(self, pad_token_id: int) -> RolloutEngine:
        seed = self.args.seed + self.accelerator.process_index
        choice = self.args.rollout_engine
        if choice not in ("auto", "fast", "transformers"):
            raise ValueError(f"rollout_engine must be 'auto', 'fast' or 'transformers', got {choice!r}")
        sharded = bool(getattr(self, "is_fsdp_enabled", False))
        family = causal_lm_of(self.model).config.model_type
        fast_families = VISION_FAST_TYPES if self.vision is not None else SUPPORTED
        if choice == "auto":
            on_cuda = self.args.device.type == "cuda"
            choice = "fast" if on_cuda and family in fast_families and not sharded else "transformers"
        if choice == "fast" and self.vision is not None and family not in VISION_FAST_TYPES:
            raise ValueError(f"rollout_engine='fast' runs the vision-language families {VISION_FAST_TYPES}, not "
                             f"{family!r}: use 'auto' or 'transformers'")
        if choice == "fast" and sharded:
            # the engine calls the layers outside the root module's forward (FSDP would not gather the
            # embedding / LM head) and captures CUDA graphs (no collectives inside)
            raise ValueError("rollout_engine='fast' does not run on FSDP-sharded models: use 'transformers' "
                             "(or 'auto', which picks it under FSDP)")
        if choice == "transformers" and self.args.rollout_kv_cache_dtype != "auto":
            # only 'auto' gets here (GRPOConfig refuses it beside an explicit 'transformers'): the run goes on,
            # said once, as with max_prefill_tokens below
            logger.warning("swiftune: GRPOConfig.rollout_kv_cache_dtype=%r has no effect: rollout_engine='auto' "
                           "picked transformers' generate here (%s), which keeps its cache in the model's dtype; "
                           "the fast engine runs on CUDA for %s", self.args.rollout_kv_cache_dtype,
                           "FSDP-sharded model" if sharded else f"{self.args.device.type}, {family}",
                           ", ".join(fast_families))
        if self.vision is not None:  # image prompts: the engines that prefill through the vision tower
            if choice == "fast":
                return VisionFastRolloutEngine(self.model, self.vision.rope_index, self.vision.image_token_id,
                                               pad_token_id=pad_token_id, seed=seed, tokenizer=self.vision.tokenizer,
                                               max_batch_size=self.args.max_rollout_batch_size,
                                               attention_backend=self.args.attention_backend,
                                               max_prefill_tokens=self.args.max_prefill_tokens,
                                               kv_cache_dtype=self.args.rollout_kv_cache_dtype)
            return VisionRolloutEngine(self.model, self.vision.rope_index, self.vision.image_token_id,
                                       pad_token_id=pad_token_id, seed=seed,
                                       max_batch_size=self.args.max_rollout_batch_size,
                                       max_prefill_tokens=self.args.max_prefill_tokens)
        if self.args.max_prefill_tokens != "auto":
            # as TRL's engine-specific fields (vllm_*) do when that engine does not run: accepted, said once,
            # so that one config serves text and vision-language runs
            logger.warning("swiftune: GRPOConfig.max_prefill_tokens=%r has no effect on %s, a text model: it caps "
                           "the prefills of the vision-language rollout engines only (image prompts)",
                           self.args.max_prefill_tokens, type(causal_lm_of(self.model)).__name__)
        if choice == "fast":
            return FastRolloutEngine(self.model, pad_token_id=pad_token_id, seed=seed, tokenizer=self.processing_class,
                                     max_batch_size=self.args.max_rollout_batch_size,
                                     attention_backend=self.args.attention_backend,
                                     kv_cache_dtype=self.args.rollout_kv_cache_dtype)
        return TransformersRolloutEngine(self.model, pad_token_id=pad_token_id, seed=seed,
                                         max_batch_size=self.args.max_rollout_batch_size)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        args = self.args
        sampler = GenerationBatchSampler(
            len(self.train_dataset), args.prompts_per_generation, args.steps_per_generation * args.num_iterations,
            seed=args.seed, shuffle=True, rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
        )
        sampler.shuffle = args.shuffle_dataset
        if len(sampler) == 0:
            raise ValueError(f"train_dataset has {len(self.train_dataset)} rows: too few for one global generation "
                             f"({args.prompts_per_generation} prompts x {self.accelerator.num_processes} processes)")
        return EpochLoader(self.train_dataset, batch_sampler=sampler, collate_fn=collate_prompt_rows)

    def stop_token_ids(self, conversational: bool) -> list[int]:
        tok = self.vision.tokenizer if self.vision is not None else self.processing_class
        return generation_stop_ids(tok, self.model, conversational, self.args.stop_token_ids)

    def tokenize_prompt(self, prompt: Any, chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of ``prompt`` (chat template with the config's ``chat_template_kwargs``, updated
        by the row's own, for conversational prompts); longer than ``max_prompt_length``: the end."""
        ids = prompt_token_ids(self.processing_class, prompt,
                               {**(self.args.chat_template_kwargs or {}), **(chat_template_kwargs or {})})
        if self.args.max_prompt_length is not None and len(ids) > self.args.max_prompt_length:
            if not self._said_prompt_cut:  # once a run: the cut changes what the policy sees
                self._said_prompt_cut = True
                logger.warning("swiftune: a prompt of %d tokens is longer than max_prompt_length=%d and is cut to its "
                               "last %d tokens (as TRL does; said once, for every prompt cut): raise "
                               "max_prompt_length, or set it to None to keep prompts whole", len(ids),
                               self.args.max_prompt_length, self.args.max_prompt_length)
            ids = ids[-self.args.max_prompt_length:]
        if not ids:
            raise ValueError(f"prompt {prompt!r:.80} tokenizes to nothing")
        return ids

    # ------------------------------------------------------------------------ generation

    trainer_kind = "grpo"
    settings_keys = COMMON_SETTINGS_KEYS + (
        "num_generations", "max_prompt_length", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
        "steps_per_generation", "beta", "epsilon", "epsilon_high", "delta", "loss_type", "importance_sampling_level",
        "scale_rewards", "mask_truncated_completions", "num_iterations", "reward_weights", "share_prompt",
        "multi_objective_aggregation", "top_entropy_quantile", "use_bias_correction_kl", "sapo_temperature_pos",
        "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
        "repetition_penalty",
    )

    def save_checkpoint_extras(self, checkpoint_dir: str) -> None:
        # the metrics a step that reuses the buffer logs again: the last logged generation's, updated by any
        # generation since that log
        metrics = {**self._last_gen_metrics, **self._gen_log.means(clear=False)}
        # the engine's sampling stream: a resumed run samples what the uninterrupted one samples
        rng_state = getattr(self.rollout_engine, "rng_state", None)
        save_rollout_state(checkpoint_dir, self.accelerator.process_index, self._micro_step, self._buffer,
                           generation_metrics=metrics, engine_rng_state=rng_state() if callable(rng_state) else None)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        state = load_rollout_state(resume_from_checkpoint, self.accelerator.process_index, self.args.device,
                                   types=(GRPOMicroBatch,))
        rng_state = saved_engine_rng_state(resume_from_checkpoint, self.accelerator.process_index)
        if rng_state is not None and callable(getattr(self.rollout_engine, "set_rng_state", None)):
            self.rollout_engine.set_rng_state(rng_state)
        if state is not None:
            self._micro_step, self._buffer = state
            if self._buffer is not None:  # the steps that reuse it log its generation's metrics, as unresumed
                self._last_gen_metrics = saved_generation_metrics(resume_from_checkpoint,
                                                                  self.accelerator.process_index)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> GRPOMicroBatch:  # type: ignore[override]
        args = self.args
        generate_every = args.steps_per_generation * args.num_iterations
        if self._micro_step == 0 and self.state.global_step > 0:
            # resumed from a checkpoint without a saved rollout buffer: realign with the data
            self._micro_step = self.state.global_step * args.gradient_accumulation_steps
        if self._buffer is None or self._micro_step % generate_every == 0:
            # generation runs without autocast
            with lora_input_casting(self.model, enabled=True, index=self.lora_layer_index):
                self._buffer = self._generate_and_score(inputs["prompt_rows"])
        batch = self._buffer[self._micro_step % args.steps_per_generation]
        self._micro_step += 1
        return batch

    def _no_grad_logps(self, model: nn.Module, row: PolicyRow) -> torch.Tensor:
        was_training = model.training
        model.eval()  # no dropout: the same numbers the training forward gives without dropout
        try:
            with torch.no_grad():
                return self._logps(model, row)[0]
        finally:
            model.train(was_training)

    def _logps(self, model: nn.Module, row: PolicyRow, entropy: bool = False):
        a = self.args
        return completion_logprobs(model, row, temperature=a.temperature if a.temperature > 0 else 1.0,
                                   chunk_tokens=a.logit_chunk_tokens, offload=a.offload_logits,
                                   return_entropy=entropy, kernel_backend=a.kernel_backend,
                                   fp32_head=a.cast_lm_head_to_fp32)

    def sample_and_score(self, prompt_rows: Sequence[dict], num_generations: int | None = None) -> SampledGroups:
        """``num_generations`` (default: the config's) completions of each row's prompt from the rollout
        engine, decoded and scored by the reward functions (training generations and :meth:`evaluate`)."""
        args = self.args
        G = num_generations or args.num_generations
        prompts = [row["prompt"] for row in prompt_rows]
        conversational = is_conversational(prompts[0])
        vision_prompts = None
        if self.vision is not None:
            vision_prompts = [self.vision.encode(row, max_prompt_length=args.max_prompt_length, chat_template_kwargs={
                **(args.chat_template_kwargs or {}), **(row.get("chat_template_kwargs") or {})}) for row in prompt_rows]
            prompt_ids = [p.input_ids for p in vision_prompts]
        else:
            prompt_ids = [self.tokenize_prompt(row["prompt"], row.get("chat_template_kwargs")) for row in prompt_rows]
        if self.state.global_step != self._engine_step:
            self.rollout_engine.load_weights(self.model)
            self._engine_step = self.state.global_step
        params = SamplingParams(
            max_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, stop_token_ids=self.stop_token_ids(conversational),
            repetition_penalty=args.repetition_penalty,
        )
        t0 = time.perf_counter()
        rollouts = (self.vision.generate(self.rollout_engine, vision_prompts, G, params) if self.vision is not None
                    else self.rollout_engine.generate(prompt_ids, G, params))
        gen_time = time.perf_counter() - t0
        completion_ids = rollouts.completion_ids
        n = len(prompts) * G
        if len(completion_ids) != n:
            raise RuntimeError(f"the rollout engine returned {len(completion_ids)} completions for {n}")
        decoder = self.vision.tokenizer if self.vision is not None else self.processing_class
        texts = decoder.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = reward_columns(prompt_rows, G)
        rewards, per_func = compute_rewards(
            self.reward_funcs, [p for p in prompts for _ in range(G)], completions, completion_ids, columns,
            self.reward_weights, group_size=G, timeout=args.reward_timeout, trainer_state=self.state,
            log_metric=self.reward_logs.log_metric, log_extra=self.reward_logs.log_extra,
        )
        finished = torch.tensor(rollouts.finished, dtype=torch.bool)
        return SampledGroups(prompts, prompt_ids, completion_ids, texts, finished, rewards, per_func, gen_time,
                             vision_prompts)

    def advantages_of(self, sampled: SampledGroups, group_size: int, local: bool = False) -> tuple[torch.Tensor, bool]:
        """``(advantages [N], whether frac_reward_zero_std is the batch's)`` by ``scale_rewards`` and
        ``multi_objective_aggregation`` (:mod:`swiftune.rl.advantages`, :mod:`swiftune.rl.aggregation`);
        batch statistics over every process unless ``local`` (evaluation: no collectives per batch)."""
        args = self.args
        gather = self.accelerator.gather if self.accelerator.num_processes > 1 and not local else None
        if args.multi_objective_aggregation == "normalize_then_sum":
            to_device = (lambda t: gather(t.to(self.args.device)).cpu()) if gather else None
            return normalize_then_sum(sampled.per_func, self.reward_weights, group_size, to_device)[0], True
        batch_std = None
        if args.scale_rewards == "batch" and gather is not None:
            batch_std = gather(sampled.rewards.to(self.args.device)).std().cpu()
        return group_advantages(sampled.rewards, group_size, args.scale_rewards, batch_std=batch_std)[0], \
            args.scale_rewards == "batch"

    def _generate_and_score(self, prompt_rows: list[dict]) -> list[GRPOMicroBatch]:
        args = self.args
        G = args.num_generations
        device = self.args.device
        sampled = self.sample_and_score(prompt_rows)
        completion_ids = sampled.completion_ids
        exp_prompt_ids = [p for p in sampled.prompt_ids for _ in range(G)]
        advantages, batch_level = self.advantages_of(sampled, G)
        seq_keep = sampled.finished | (not args.mask_truncated_completions)

        B = args.per_device_train_batch_size
        micro: list[GRPOMicroBatch] = []
        for s in range(args.steps_per_generation):
            idx = list(range(s * B, (s + 1) * B))
            if self.vision is not None:
                row = self.vision.policy_row([sampled.vision_prompts[i // G] for i in idx],
                                             [completion_ids[i] for i in idx], share_prompt=bool(args.share_prompt),
                                             group_ids=[i // G for i in idx], attention_backend=args.attention_backend,
                                             device=device, include_last_token=self.router_aux.enabled)
            else:
                row = build_policy_row([exp_prompt_ids[i] for i in idx], [completion_ids[i] for i in idx],
                                       share_prompt=bool(args.share_prompt), group_ids=[i // G for i in idx],
                                       attention_backend=args.attention_backend, device=device,
                                       include_last_token=self.router_aux.enabled)
            keep = seq_keep[idx].to(device=device, dtype=torch.float32)
            micro.append(GRPOMicroBatch(row, advantages[idx].to(device), keep.index_select(0, row.seq_index),
                                        None, None, 0.0))
        need_old = args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
        for mb in micro:
            if need_old:
                mb.old_logps = self._no_grad_logps(self.model, mb.row)
            if args.beta != 0.0:
                mb.ref_logps = self.reference_logprobs(mb.row)
        # dapo / cispo / vespo denominator: completion tokens per optimizer step over all processes
        local_tokens = torch.tensor(float(sum(float(mb.token_mask.sum()) for mb in micro)), device=device)
        global_tokens = float(self.accelerator.gather(local_tokens.reshape(1)).sum())
        per_step = global_tokens * args.gradient_accumulation_steps / args.steps_per_generation
        for mb in micro:
            mb.num_items_in_batch = max(per_step, 1.0)
        self._record_generation(sampled, advantages, G, batch_level)
        return micro

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Mean rewards of fresh completions of held-out prompts (:mod:`swiftune.rl.evaluation`).

        ``eval_dataset`` (rows with a ``prompt``, as for training) overrides the trainer's; with
        ``eval_strategy="steps"`` the Trainer calls this every ``eval_steps``.
        """
        rows = prompt_rows_of(eval_dataset, "eval_dataset") if eval_dataset is not None else self.eval_dataset
        if rows is None:
            raise ValueError("nothing to evaluate: pass eval_dataset= to GRPOTrainer or to evaluate()")
        was_training = self.model.training
        self.model.eval()
        try:
            metrics = evaluate_rewards(self, rows, metric_key_prefix)
        finally:
            self.model.train(was_training)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def eval_batch_loss(self, sampled: SampledGroups, advantages: torch.Tensor, group_size: int) -> float:
        """The GRPO loss of one evaluation batch under the current policy (TRL's ``eval_loss``: the
        rollouts are on-policy, ratio 1); its diagnostics go to the eval metrics."""
        args, device = self.args, self.args.device
        ids = [p for p in sampled.prompt_ids for _ in range(group_size)]
        if self.vision is not None:
            row = self.vision.policy_row([p for p in sampled.vision_prompts for _ in range(group_size)],
                                         sampled.completion_ids, share_prompt=bool(args.share_prompt),
                                         group_ids=[i // group_size for i in range(len(ids))],
                                         attention_backend=args.attention_backend, device=device,
                                         include_last_token=self.router_aux.enabled)
        else:
            row = build_policy_row(ids, sampled.completion_ids, share_prompt=bool(args.share_prompt),
                                   group_ids=[i // group_size for i in range(len(ids))],
                                   attention_backend=args.attention_backend, device=device,
                                   include_last_token=self.router_aux.enabled)
        keep = (sampled.finished | (not args.mask_truncated_completions)).to(device=device, dtype=torch.float32)
        mask = keep.index_select(0, row.seq_index)
        ref = self.reference_logprobs(row) if args.beta != 0.0 else None
        mb = GRPOMicroBatch(row, advantages.to(device), mask, None, ref, max(float(mask.sum()), 1.0))
        with torch.no_grad():
            return float(self.compute_loss(self.model, mb))

    def reference_logprobs(self, row: PolicyRow) -> torch.Tensor:
        """Completion log-probs of ``row`` under the reference policy (no gradient).

        LoRA: the training model itself with its adapters disabled; full fine-tuning: the frozen
        copy made at construction (only when ``beta > 0``).
        """
        if self.ref_model is not None:
            return self._no_grad_logps(self.ref_model, row)
        unwrapped = self.accelerator.unwrap_model(self.model)
        with unwrapped.disable_adapter():  # LoRA: the reference is the base model, no second copy
            return self._no_grad_logps(unwrapped, row)

    def _record_generation(self, sampled: SampledGroups, advantages: torch.Tensor, group_size: int,
                           batch_level: bool) -> None:
        """TRL 1.16's generation metrics over every process's completions (:mod:`swiftune.rl.grpo_metrics`),
        ``num_tokens`` (prompt + completion tokens seen in training), what the reward functions logged,
        and the ``log_completions`` table of this generation."""
        acc, device = self.accelerator, self.args.device

        def gather(t: torch.Tensor) -> torch.Tensor:
            return acc.gather(t.to(device)).cpu() if acc.num_processes > 1 else t

        lengths = torch.tensor([len(c) for c in sampled.completion_ids], dtype=torch.float32)
        per_func = gather(sampled.per_func.float())
        metrics = generation_metrics(per_func, self.reward_weights, self.reward_func_names, gather(lengths),
                                     gather(~sampled.finished), group_size, batch_level)
        metrics["generation_s"] = sampled.generation_s
        metrics.update(self.reward_logs.take_metrics(acc))
        self._gen_log.add(metrics)
        seen = sum(len(p) for p in sampled.prompt_ids) * group_size + float(lengths.sum())
        self.state.num_input_tokens_seen += int(gather(torch.tensor([seen], dtype=torch.float64)).sum())
        self._gen_log.set("num_tokens", self.state.num_input_tokens_seen)
        extra = self.reward_logs.take_extra()
        if self.args.log_completions and acc.is_main_process:
            rewards = {name: sampled.per_func[:, j].tolist() for j, name in enumerate(self.reward_func_names)}
            prompts = [p for p in sampled.prompts for _ in range(group_size)]
            completions = [[{"role": "assistant", "content": t}] for t in sampled.texts] \
                if is_conversational(prompts[0]) else sampled.texts
            self._table = completion_rows(prompts, completions, rewards, advantages.tolist(), extra,
                                          self.args.num_completions_to_print, self.args.log_unique_prompts)

    # ------------------------------------------------------------------------ loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mb: GRPOMicroBatch = inputs
        args = self.args
        with self.router_aux.recording(model) as router_logits:  # left before backward (a recompute)
            logps, entropy = self._logps(model, mb.row, entropy=True)
        entropy_mask = None
        collective = self.accelerator if model.training else None  # evaluation batches differ per process
        if args.top_entropy_quantile < 1.0:  # TRL: the threshold is over every process's tokens
            values = entropy.detach()[mb.token_mask > 0]
            if collective is not None and collective.num_processes > 1:
                padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=-1e9)
                values = self.accelerator.gather(padded)
                values = values[values != -1e9]
            entropy_mask = high_entropy_mask(entropy.detach(), mb.token_mask, args.top_entropy_quantile, values)
        out = grpo_loss(
            logps, mb.old_logps, mb.advantages, mb.row.seq_index, num_sequences=mb.row.num_sequences,
            loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
            epsilon=args.epsilon, epsilon_high=args.epsilon_high, delta=args.delta, beta=args.beta,
            ref_logps=mb.ref_logps, mask=mb.token_mask, max_completion_length=args.max_completion_length,
            num_items_in_batch=mb.num_items_in_batch, entropy_mask=entropy_mask,
            sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg, kl_bias_correction=args.use_bias_correction_kl,
        )
        loss = out.loss
        if args.loss_type in ("dapo", "cispo", "vespo") and model.training:
            # normalised by the tokens of the whole accumulated global batch already: undo the
            # Trainer's division by the accumulation steps and DDP's mean over processes
            ga = getattr(self, "current_gradient_accumulation_steps", None) or args.gradient_accumulation_steps
            loss = loss * ga * self.accelerator.num_processes
        aux = None
        if self.router_aux.enabled:
            # TRL: + coef * aux over this micro-batch's routed tokens (prompt + completion of each sample,
            # without truncated completions it masks), which the Trainer divides by the accumulation steps
            keep = torch.zeros(mb.row.num_sequences, device=mb.token_mask.device, dtype=mb.token_mask.dtype)
            keep.scatter_(0, mb.row.seq_index, mb.token_mask)
            aux = self.router_aux.term(router_logits, router_token_weights(model, mb.row, keep))
            loss = loss + aux.to(loss.dtype)
        with torch.no_grad():
            totals = dict(out.totals)
            if aux is not None:  # TRL's aux_loss: the unweighted term, a mean over micro-batches and processes
                totals["aux_loss"] = (aux.detach() / self.router_aux.coef, torch.ones((), device=aux.device))
            totals["entropy"] = ((entropy.detach() * mb.token_mask).sum(), mb.token_mask.sum())
            local = out.metrics(args.loss_type) if args.loss_type in CLIPPED_LOSS_TYPES else {}
            extremes = {k: local[k] for k in ("clip_ratio/low_min", "clip_ratio/high_max") if k in local}
            self._metrics["train" if model.training else "eval"].add(
                reduce_loss_metrics(totals, extremes, collective))
        if model.training:
            self.token_meter.add(BatchStats(num_trained_tokens=int(mb.token_mask.sum()),
                                            num_tokens=mb.row.num_tokens, num_padding_tokens=0))
        return (loss, {"logps": logps}) if return_outputs else loss

    # ------------------------------------------------------------------------ logging

    def _track_num_input_tokens(self, inputs: Any) -> None:
        # GRPO counts prompt + completion tokens per generation itself (num_tokens, TRL's count); the
        # Trainer's own counter reads inputs["input_ids"], which a GRPO micro-batch does not have
        return

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._gen_log:  # a new generation since the last log: its metrics replace the kept ones
            self._last_gen_metrics = self._gen_log.means()
        if "loss" in logs:  # a training step: this period's rollout and loss diagnostics (TRL's names)
            # with num_iterations > 1 a step may reuse the last generation: its metrics are logged again
            logs = {**logs, **self._last_gen_metrics, **self._metrics["train"].means()}
            if self.args.log_completions and self._table is not None:
                print_completions(self.state.global_step, *self._table)
        super().log(logs, start_time)
