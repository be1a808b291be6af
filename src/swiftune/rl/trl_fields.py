"""TRL 1.16 ``GRPOConfig`` fields beyond swiftune's own knobs, and what swiftune does with each.

:class:`TRLGRPOFields` is mixed into :class:`swiftune.GRPOConfig` so that a TRL script's config
constructs unchanged. Each field is one of (docs/trl_compat_grpo.md has the whole table):

* honoured, with TRL's meaning and default (``chat_template_kwargs``, ``num_generations_eval``,
  ``disable_dropout``, ``model_init_kwargs``, ``cast_lm_head_to_fp32``, ``top_entropy_quantile``,
  ``sync_ref_model``, ``multi_objective_aggregation``, the ``sapo_*`` / ``vespo_*`` shapes, ...);
* refused at construction when set to anything but the value that means "off" (``use_vllm=True``,
  tool calling, the entropy bonus, ...), with the reason and what to do instead;
* accepted but without effect in swiftune (settings of engines swiftune does not run, such as the
  ``vllm_*`` group with ``use_vllm=False``): a value other than TRL's default warns once, naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..training.config_checks import fail, require_int, require_number, warn_once

# generation_kwargs keys the built-in rollout engines honour, and the config field each overrides
GENERATION_KWARGS = {"top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
# generation_kwargs keys refused with the field to set instead (in TRL they would change sampling only, while
# swiftune's temperature and lengths also define the training log-probs and the completion budget)
GENERATION_KWARGS_FIELDS = {"temperature": "temperature", "max_new_tokens": "max_completion_length",
                            "max_tokens": "max_completion_length", "eos_token_id": "stop_token_ids",
                            "stop_token_ids": "stop_token_ids"}
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
ROLLOUT_HELP = "swiftune samples with its own rollout engine (rollout_engine='auto' | 'fast' | 'transformers')"

# field -> (the value that means "off", why swiftune refuses anything else and what to do instead)
REFUSED: dict[str, tuple[Any, str]] = {
    "use_vllm": (False, f"{ROLLOUT_HELP}, not vLLM; set use_vllm=False (see docs/rollout.md)"),
    "use_transformers_continuous_batching": (False, f"{ROLLOUT_HELP}; set it to False"),
    "use_transformers_paged": (False, f"{ROLLOUT_HELP}; set it to False"),
    "max_tool_calling_iterations": (None, "swiftune's GRPO has no tool calling; set it to None"),
    "off_policy_mask_threshold": (None, "off-policy sequence masking is not implemented; set it to None"),
    "entropy_coef": (0.0, "the entropy bonus is not implemented (entropy is logged, not optimised); set it to 0.0"),
    "use_adaptive_entropy": (False, "the adaptive entropy bonus is not implemented; set it to False"),
    "log_completions_hub_repo": (None, "completions are not uploaded to the Hub; set it to None (log_completions "
                                       "prints them and they reach wandb through the logs)"),
}

# accepted, no effect in swiftune: field -> TRL's default (another value warns once)
NO_EFFECT: dict[str, Any] = {
    "vllm_mode": "colocate", "vllm_model_impl": "vllm", "vllm_enable_sleep_mode": False,
    "vllm_structured_outputs_regex": None, "vllm_server_base_url": None, "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000, "vllm_server_timeout": 240.0, "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": None, "vllm_tensor_parallel_size": 1,
    "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_cap": None, "ds3_gather_for_generation": True, "cache_implementation": None,
    "transformers_continuous_batching_config": None, "log_multimodal": True,
}
NO_EFFECT_WHY = {
    "ds3_gather_for_generation": "swiftune shards with FSDP, not DeepSpeed ZeRO-3",
    "cache_implementation": "the rollout engines manage their own KV cache",
    "log_multimodal": "swiftune's GRPO is text-only",
}



def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class TRLGRPOFields:
    """TRL 1.16 ``GRPOConfig`` fields (TRL's names and defaults; see the module doc)."""

    model_init_kwargs: dict | str | None = field(default=None, metadata=_h(
        "Keyword arguments for FastModel.from_pretrained when the model is given as a path (e.g. dtype)."))
    trust_remote_code: bool = field(default=False, metadata=_h("Passed to from_pretrained with model_init_kwargs."))
    disable_dropout: bool = field(default=False, metadata=_h("Set every dropout probability of the model to 0."))
    cast_lm_head_to_fp32: bool = field(default=False, metadata=_h(
        "Compute the LM head of the log-probs in float32 (hidden states and weight upcast)."))
    num_generations_eval: int | None = field(default=None, metadata=_h(
        "Completions per prompt in evaluation (None: num_generations)."))
    shuffle_dataset: bool = field(default=True, metadata=_h("Shuffle the training prompts."))
    pad_to_multiple_of: str | None = field(default="auto", metadata=_h(
        "Accepted as 'auto' / None only: the policy rows are padding-free."))
    generation_kwargs: dict | str | None = field(default=None, metadata=_h(
        "Sampling overrides; swiftune's engines take top_p, top_k, min_p and repetition_penalty (they override "
        "those fields)."))
    chat_template_kwargs: dict | str | None = field(default=None, metadata=_h(
        "Extra arguments of apply_chat_template for conversational prompts (e.g. {'enable_thinking': False}); a "
        "'chat_template_kwargs' column overrides them per row."))
    repetition_penalty: float = field(default=1.0, metadata=_h(
        "transformers' repetition penalty over the prompt and completion tokens so far (> 1 discourages repeats; "
        "1.0: off)."))
    cache_implementation: str | None = field(default=None, metadata=_h("No effect (engines manage their KV cache)."))
    use_vllm: bool = field(default=False, metadata=_h("Only False: swiftune has its own rollout engine."))
    vllm_mode: str = field(default="colocate", metadata=_h("No effect (use_vllm is refused)."))
    vllm_model_impl: str = field(default="vllm", metadata=_h("No effect (use_vllm is refused)."))
    vllm_enable_sleep_mode: bool = field(default=False, metadata=_h("No effect (use_vllm is refused)."))
    vllm_structured_outputs_regex: str | None = field(default=None, metadata=_h("No effect (use_vllm is refused)."))
    vllm_server_base_url: str | None = field(default=None, metadata=_h("No effect (use_vllm is refused)."))
    vllm_server_host: str = field(default="0.0.0.0", metadata=_h("No effect (use_vllm is refused)."))
    vllm_server_port: int = field(default=8000, metadata=_h("No effect (use_vllm is refused)."))
    vllm_server_timeout: float = field(default=240.0, metadata=_h("No effect (use_vllm is refused)."))
    vllm_group_port: int = field(default=51216, metadata=_h("No effect (use_vllm is refused)."))
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_h("No effect (use_vllm is refused)."))
    vllm_max_model_length: int | None = field(default=None, metadata=_h("No effect (use_vllm is refused)."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_h("No effect (use_vllm is refused)."))
    vllm_importance_sampling_correction: bool = field(default=True, metadata=_h("No effect (no vLLM sampler)."))
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata=_h("No effect (no vLLM sampler)."))
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata=_h("No effect (no vLLM)."))
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata=_h("No effect (no vLLM)."))
    vllm_importance_sampling_cap: float | None = field(default=None, metadata=_h("No effect (no vLLM)."))
    ds3_gather_for_generation: bool = field(default=True, metadata=_h("No effect (FSDP, not DeepSpeed)."))
    use_transformers_continuous_batching: bool = field(default=False, metadata=_h("Only False (own engine)."))
    transformers_continuous_batching_config: dict | str | None = field(default=None, metadata=_h("No effect."))
    use_transformers_paged: bool = field(default=False, metadata=_h("Only False (own engine)."))
    sapo_temperature_neg: float = field(default=1.05, metadata=_h("sapo: gate temperature where A <= 0."))
    sapo_temperature_pos: float = field(default=1.0, metadata=_h("sapo: gate temperature where A > 0."))
    vespo_k_pos: float = field(default=2.0, metadata=_h("vespo: gamma shape k where A >= 0."))
    vespo_lambda_pos: float = field(default=3.0, metadata=_h("vespo: gamma rate lambda where A >= 0."))
    vespo_k_neg: float = field(default=3.0, metadata=_h("vespo: gamma shape k where A < 0."))
    vespo_lambda_neg: float = field(default=2.0, metadata=_h("vespo: gamma rate lambda where A < 0."))
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata=_h(
        "sum_then_normalize (weighted sum of the rewards, then group advantages) or normalize_then_sum (each "
        "reward normalised in its group, weighted sum, then normalised over the batch)."))
    sync_ref_model: bool = field(default=False, metadata=_h(
        "Every ref_model_sync_steps steps: ref = alpha * policy + (1 - alpha) * ref (full fine-tuning, beta > 0)."))
    ref_model_mixup_alpha: float = field(default=0.6, metadata=_h("alpha of sync_ref_model."))
    ref_model_sync_steps: int = field(default=512, metadata=_h("Steps between reference syncs."))
    top_entropy_quantile: float = field(default=1.0, metadata=_h(
        "Train only on the tokens of the highest-entropy share rho of each micro-batch (1.0: all tokens)."))
    entropy_coef: float = field(default=0.0, metadata=_h("Only 0.0 (no entropy bonus)."))
    use_adaptive_entropy: bool = field(default=False, metadata=_h("Only False."))
    entropy_coef_min: float = field(default=0.0, metadata=_h("No effect (no entropy bonus)."))
    entropy_coef_max: float = field(default=1.0, metadata=_h("No effect (no entropy bonus)."))
    entropy_coef_delta: float = field(default=0.005, metadata=_h("No effect (no entropy bonus)."))
    entropy_target: float = field(default=0.2, metadata=_h("No effect (no entropy bonus)."))
    max_tool_calling_iterations: int | None = field(default=None, metadata=_h("Only None (no tool calling)."))
    off_policy_mask_threshold: float | None = field(default=None, metadata=_h("Only None."))
    router_aux_loss_coef: float | None = field(default=None, metadata=_h(
        "Weight of the MoE load-balancing loss added to each micro-batch's loss (None: the model config's "
        "router_aux_loss_coef; 0.0: off; an error on a model without a router)."))
    use_bias_correction_kl: bool = field(default=False, metadata=_h(
        "Multiply the k3 KL by the importance ratio (TRL's default is True; see docs/trl_compat_grpo.md)."))
    num_completions_to_print: int | None = field(default=None, metadata=_h(
        "Rows of the log_completions table (None: every completion of the last generation)."))
    log_unique_prompts: bool = field(default=False, metadata=_h("log_completions: one row per distinct prompt."))
    log_multimodal: bool = field(default=True, metadata=_h("No effect (text only)."))
    log_completions_hub_repo: str | None = field(default=None, metadata=_h("Only None (no Hub upload)."))


def check_trl_fields(config: Any) -> None:
    """Refuse what swiftune cannot do, check what it honours, warn once about what has no effect."""
    for name, (off, why) in REFUSED.items():
        value = getattr(config, name)
        if value != off:
            fail(config, name, value, "is not supported", why)
    if isinstance(config.pad_to_multiple_of, str) and config.pad_to_multiple_of.lower() in ("none", "null"):
        config.pad_to_multiple_of = None  # the command line passes strings (as TRL reads them)
    if config.pad_to_multiple_of not in ("auto", None):
        fail(config, "pad_to_multiple_of", config.pad_to_multiple_of, "is not supported (GRPO policy rows are "
             "padding-free: there is no padding to round)", "set pad_to_multiple_of=None")
    config.pad_to_multiple_of = None
    require_number(config, "router_aux_loss_coef", "a weight >= 0 for the MoE load-balancing loss, 0.0 to switch "
                   "it off, or None for the model config's own", low=0, allow_none=True)
    require_int(config, "num_generations_eval", 1, "the completions per eval prompt, or None for num_generations",
                allow_none=True)
    require_number(config, "top_entropy_quantile", "a share of tokens in (0, 1], 1.0 for all", low=0, high=1,
                   low_open=True)
    require_number(config, "ref_model_mixup_alpha", "a weight in [0, 1], e.g. 0.6", low=0, high=1)
    require_int(config, "ref_model_sync_steps", 1, "the steps between reference syncs, e.g. 512")
    for name in ("sapo_temperature_neg", "sapo_temperature_pos"):
        require_number(config, name, "a temperature > 0 (TRL's defaults: 1.05 / 1.0)", low=0, low_open=True)
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        require_number(config, name, "a finite number >= 0 (TRL's defaults: k 2/3, lambda 3/2)", low=0)
    if config.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        fail(config, "multi_objective_aggregation", config.multi_objective_aggregation,
             f"is not one of {', '.join(MULTI_OBJECTIVE_AGGREGATIONS)}", "set it to one of them")
    for name in ("model_init_kwargs", "chat_template_kwargs", "generation_kwargs"):
        value = getattr(config, name)
        if isinstance(value, str):  # from the command line or a YAML file: JSON, as TrainingArguments' dicts
            try:
                value = json.loads(value)
            except ValueError:
                fail(config, name, value, "is not JSON", f"set {name} to a JSON object, e.g. '{{}}'")
            setattr(config, name, value)
        if value is not None and not isinstance(value, dict):
            fail(config, name, value, "must be a dict or None", f"set {name} to e.g. {{}} or None")
    for key, value in (config.generation_kwargs or {}).items():
        if key == "do_sample" and value:
            continue  # the engines always sample
        if key in GENERATION_KWARGS_FIELDS:
            fail(config, "generation_kwargs", config.generation_kwargs, f"has {key!r}, which swiftune reads from "
                 f"the config field {GENERATION_KWARGS_FIELDS[key]} (it is also used outside sampling)",
                 f"remove {key!r} and set {GENERATION_KWARGS_FIELDS[key]}=...")
        if key not in GENERATION_KWARGS:
            fail(config, "generation_kwargs", config.generation_kwargs, f"has {key!r}, which swiftune's rollout "
                 f"engines do not take (they take {', '.join(GENERATION_KWARGS)})", f"remove {key!r} (use the "
                 "config's own fields: temperature, max_completion_length, stop_token_ids)")
        setattr(config, GENERATION_KWARGS[key], value)  # TRL: generation_kwargs override the fields
    require_number(config, "repetition_penalty", "a penalty > 0: 1.0 for off, e.g. 1.1 to discourage repeats",
                   low=0, low_open=True)
    if config.sync_ref_model and config.beta == 0.0:
        fail(config, "sync_ref_model", True, "needs a reference model, and beta=0.0 has none",
             "set beta > 0 (e.g. 0.04) or sync_ref_model=False")
    for name, default in NO_EFFECT.items():
        value = getattr(config, name)
        if value != default:
            why = NO_EFFECT_WHY.get(name, "swiftune does not run vLLM (use_vllm is refused)")
            warn_once(f"GRPOConfig.{name}", f"{type(config).__name__}: {name}={value!r} has no effect in swiftune: "
                      f"{why}", stacklevel=4)
    if config.use_adaptive_entropy is False and config.entropy_coef == 0.0:
        for name, default in (("entropy_coef_min", 0.0), ("entropy_coef_max", 1.0), ("entropy_coef_delta", 0.005),
                              ("entropy_target", 0.2)):
            if getattr(config, name) != default:
                warn_once(f"GRPOConfig.{name}", f"{type(config).__name__}: {name}={getattr(config, name)!r} has no "
                          "effect: swiftune has no entropy bonus", stacklevel=4)
