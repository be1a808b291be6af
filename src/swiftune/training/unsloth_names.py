"""Unsloth's ``FastLanguageModel`` names over :class:`~swiftune.training.loading.FastModel`.

An Unsloth script runs after ``from swiftune import FastLanguageModel``: each Unsloth argument keeps
Unsloth's meaning, is ignored with a warning where it configures vLLM (which swiftune does not
have), or is refused with what to use instead (docs/unsloth_compat.md has the table).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..models.patching import causal_lm_of
from .checkpointing import disable_offloaded_checkpointing, is_offloaded_checkpointing
from .loading import (LORA_PROJECTIONS, FastModel, check_checkpointing_mode, enable_gradient_checkpointing,
                      expert_stack_names)

logger = logging.getLogger(__name__)

#: an MLP projection name of a target_modules list -> the expert stacks it stands for on a model whose experts
#: are 3-D parameters, first choice first: gate and up live in one fused gate_up_proj stack where the model has it
_EXPERT_STACKS_OF_MLP_NAME = {"gate_proj": ("gate_up_proj", "gate_proj"), "up_proj": ("gate_up_proj", "up_proj"),
                              "gate_up_proj": ("gate_up_proj",), "down_proj": ("down_proj",)}

__all__ = ["FastLanguageModel"]

# Unsloth's from_pretrained options, besides gpu_memory_utilization and max_lora_rank, that only
# configure its vLLM engine (fast_inference=True; random_state seeds it), which swiftune does not
# have: accepted so that a script runs, and announced as ignored.
_MORE_VLLM_ONLY_KWARGS = ("float8_kv_cache", "disable_log_stats", "random_state")


def _layer_checkpointing_on(hf_model: nn.Module) -> bool:
    """Whether transformers' own per-layer checkpointing is on (its name changed in transformers 5.2x)."""
    if hasattr(type(hf_model), "is_activation_checkpointing"):
        return bool(hf_model.is_activation_checkpointing)
    return bool(getattr(hf_model, "is_gradient_checkpointing", False))


def _disable_gradient_checkpointing(model: nn.Module) -> None:
    """Undo :func:`enable_gradient_checkpointing`, whichever mode it set."""
    hf_model = causal_lm_of(model)
    if is_offloaded_checkpointing(hf_model):
        disable_offloaded_checkpointing(hf_model)  # brings back transformers' per-layer flags, then:
    if _layer_checkpointing_on(hf_model):
        disable = getattr(hf_model, "activation_checkpointing_disable", None) or hf_model.gradient_checkpointing_disable
        disable()


class FastLanguageModel:
    """Unsloth's ``FastLanguageModel`` names over :class:`FastModel`, so that an Unsloth script runs
    after ``from swiftune import FastLanguageModel``.

    Each Unsloth argument either keeps Unsloth's meaning, is accepted and ignored with a warning
    where it configures something swiftune does not have (vLLM's engine), or is refused with a
    :class:`~swiftune.errors.ConfigError` that says what to use instead (docs/unsloth_compat.md
    has the table). Note :meth:`for_training`: Unsloth's meaning (back to training mode after
    :meth:`for_inference`), not :meth:`FastModel.for_training` (the full fine-tuning set-up,
    which ``from_pretrained(..., full_finetuning=True)`` applies).
    """

    @staticmethod
    def from_pretrained(
        model_name: str,
        max_seq_length: int | None = None,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = False,
        load_in_8bit: bool = False,
        full_finetuning: bool = False,
        load_in_fp8: bool = False,
        token: str | bool | None = None,
        device_map: Any = None,
        rope_scaling: dict[str, Any] | None = None,
        fix_tokenizer: bool = True,
        trust_remote_code: bool = False,
        use_gradient_checkpointing: bool | str = "unsloth",
        fast_inference: bool = False,
        gpu_memory_utilization: float | None = None,
        max_lora_rank: int | None = None,
        **kwargs: Any,
    ) -> tuple[nn.Module, Any]:
        """Load ``(model, tokenizer)`` as Unsloth's ``FastLanguageModel.from_pretrained`` does, through
        :meth:`FastModel.from_pretrained` (patched, on this process's GPU, pad token set).

        Args:
            model_name: local directory or hub name.
            max_seq_length: longest sequence you will train on (default: the model's
                ``max_position_embeddings``; Unsloth's is 2048).
            dtype: ``None`` = bf16 on a CUDA device that supports it, else float32.
            load_in_4bit: QLoRA (NF4 base weights). Off by default here (Unsloth: on), because it
                needs ``pip install 'swiftune[qlora]'``: pass it as Unsloth scripts do.
            load_in_8bit: refused (swiftune trains on 4-bit or unquantised bases).
            full_finetuning: every weight trainable, with ``use_gradient_checkpointing``
                (:meth:`FastModel.for_training`); refused together with 4-bit or FP8 weights.
            load_in_fp8: the decoder's linear weights frozen in FP8 (e4m3, per-row scales; docs/fp8.md).
            token: hub token, passed to transformers (model and tokenizer).
            device_map: passed to transformers; ``None``: this process's GPU, else the CPU.
            rope_scaling: set on the config before loading (see :meth:`FastModel.from_pretrained`).
            fix_tokenizer: give a tokenizer without a pad token one (:func:`ensure_pad_token`).
            trust_remote_code: passed to transformers (the model must still be a causal LM that
                transformers knows).
            use_gradient_checkpointing: the checkpointing of ``full_finetuning=True``; with LoRA,
                :meth:`get_peft_model`'s own argument decides, as in Unsloth.
            fast_inference: refused when ``True`` (Unsloth's vLLM engine; swiftune's GRPO uses its
                own rollout engine).
            gpu_memory_utilization, max_lora_rank: vLLM settings; ignored with a warning, as are
                ``float8_kv_cache``, ``disable_log_stats`` and ``random_state``.
            **kwargs: passed to :meth:`FastModel.from_pretrained` (``attn_implementation``,
                ``kernel_backend``, ``quantization_config``, ``revision``, ...).
        """
        if fast_inference:
            raise ConfigError(
                "fast_inference=True starts Unsloth's vLLM engine, which swiftune does not have: leave "
                "fast_inference=False. swiftune's GRPOTrainer generates with its own rollout engine, "
                "swiftune.rl.rollout.FastRolloutEngine (GRPOConfig(rollout_engine='fast'), static KV cache and "
                "CUDA-graph decode; docs/rollout.md)")
        if full_finetuning and load_in_fp8:
            raise ConfigError(
                "full_finetuning=True with load_in_fp8=True: the e4m3 base weights are frozen. Load without "
                "load_in_fp8 to train every weight, or keep FP8 and add LoRA adapters with "
                "FastLanguageModel.get_peft_model (full_finetuning=False)")
        if full_finetuning and (load_in_4bit or kwargs.get("quantization_config") is not None):
            raise ConfigError(
                "full_finetuning=True with 4-bit weights: NF4 weights take no gradient steps. Load without "
                "load_in_4bit / quantization_config to train every weight, or keep 4-bit and add LoRA adapters "
                "with FastLanguageModel.get_peft_model (full_finetuning=False)")
        check_checkpointing_mode(use_gradient_checkpointing)
        ignored = {"gpu_memory_utilization": gpu_memory_utilization, "max_lora_rank": max_lora_rank}
        ignored.update((name, kwargs.pop(name)) for name in _MORE_VLLM_ONLY_KWARGS if name in kwargs)
        ignored = {name: value for name, value in ignored.items() if value is not None}
        if ignored:
            settings = ", ".join(f"{name}={value!r}" for name, value in ignored.items())
            warnings.warn(
                f"swiftune: FastLanguageModel.from_pretrained ignores {settings}: they configure vLLM's engine for "
                "Unsloth's fast_inference=True, which swiftune does not have (its rollout engine, "
                "swiftune.rl.rollout.FastRolloutEngine, sizes its KV cache from free memory itself)",
                stacklevel=2,
            )
        if token is not None:
            kwargs["token"] = token
        if device_map is not None:
            kwargs["device_map"] = device_map
        if trust_remote_code:
            kwargs["trust_remote_code"] = True
        model, tokenizer = FastModel.from_pretrained(
            model_name=model_name, max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit,
            load_in_8bit=load_in_8bit, load_in_fp8=load_in_fp8, rope_scaling=rope_scaling, fix_tokenizer=fix_tokenizer, **kwargs)
        if full_finetuning:
            FastModel.for_training(model, use_gradient_checkpointing=use_gradient_checkpointing)
        return model, tokenizer

    @staticmethod
    def get_peft_model(
        model: nn.Module,
        r: int = 16,
        target_modules: str | Sequence[str] = LORA_PROJECTIONS,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing: bool | str = "unsloth",
        random_state: int = 3407,
        use_rslora: bool = False,
        loftq_config: Any = None,
        max_seq_length: int | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        """Add LoRA adapters with Unsloth's defaults (r=16 on the seven attention and MLP
        projections, offloaded checkpointing) through :meth:`FastModel.get_peft_model`.

        Args:
            loftq_config: refused unless ``None`` or empty (LoftQ initialisation is not supported).
            max_seq_length: recorded as ``model.max_seq_length``, as ``from_pretrained`` does (the
                trainers' ``max_length`` decides truncation).
            **kwargs: passed to :meth:`FastModel.get_peft_model` (``modules_to_save``, the offload
                budgets, other ``peft.LoraConfig`` fields).
            The others: as in :meth:`FastModel.get_peft_model`.
        """
        if loftq_config:  # Unsloth's own default is {}: empty means none
            raise ConfigError(
                "loftq_config is not supported (no LoftQ initialisation): leave loftq_config=None; the adapters "
                "start as PEFT's defaults (B = 0, so training starts from the base model), seeded by random_state")
        if not isinstance(target_modules, str):
            target_modules = list(target_modules)
        if "target_parameters" not in kwargs:
            experts = expert_parameter_targets(model, target_modules)
            if experts:
                if lora_dropout:
                    raise ConfigError(
                        f"lora_dropout={lora_dropout} with the MLP projections on a model whose experts are "
                        f"parameters ({', '.join(experts)}, adapted as Unsloth adapts them): PEFT's adapters on "
                        "parameters take no dropout; give lora_dropout=0, or leave gate_proj / up_proj / down_proj "
                        "out of target_modules to train the attention only")
                logger.info("swiftune: the experts are parameters here; target_modules' MLP names adapt them as "
                            "Unsloth does: target_parameters=%s", experts)
                kwargs["target_parameters"] = experts
        peft_model = FastModel.get_peft_model(
            model, r=r, lora_alpha=lora_alpha, target_modules=target_modules, lora_dropout=lora_dropout, bias=bias,
            use_gradient_checkpointing=use_gradient_checkpointing, random_state=random_state, use_rslora=use_rslora,
            **kwargs)
        if max_seq_length is not None:
            causal_lm_of(peft_model).max_seq_length = max_seq_length
        return peft_model

    @staticmethod
    def for_inference(model: nn.Module) -> nn.Module:
        """Eval mode with the KV cache on, for ``model.generate`` (Unsloth's meaning); undo with
        :meth:`for_training`. Checkpointing stays set up: it only runs in training mode."""
        causal_lm_of(model).config.use_cache = True
        return model.eval()

    @staticmethod
    def for_training(model: nn.Module, use_gradient_checkpointing: bool | str = True) -> nn.Module:
        """Back to training mode after :meth:`for_inference` (Unsloth's meaning: the trainable
        parameters stay as they are; for full fine-tuning see :meth:`FastModel.for_training`).

        ``use_gradient_checkpointing``: ``True`` keeps the checkpointing the model has (turning
        plain checkpointing on if it has none), ``"offload"`` / ``"unsloth"`` switch to offloaded
        checkpointing, ``False`` turns checkpointing off.
        """
        check_checkpointing_mode(use_gradient_checkpointing)
        hf_model = causal_lm_of(model)
        if not use_gradient_checkpointing:
            _disable_gradient_checkpointing(model)
        elif use_gradient_checkpointing in ("offload", "unsloth"):
            if not is_offloaded_checkpointing(hf_model):
                enable_gradient_checkpointing(model, use_gradient_checkpointing)
        elif not (is_offloaded_checkpointing(hf_model) or _layer_checkpointing_on(hf_model)):
            enable_gradient_checkpointing(model, True)
        hf_model.config.use_cache = False  # a KV cache is useless in training and conflicts with checkpointing
        return model.train()


def expert_parameter_targets(model: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
    """The PEFT ``target_parameters`` that Unsloth's ``get_peft_model`` (2026.10) adds for a list of
    ``target_modules`` on a mixture-of-experts model whose experts are stacked 3-D parameters (gpt-oss, and
    Qwen3-MoE / Mixtral in transformers 5): ``gate_proj`` / ``up_proj`` stand for the fused
    ``experts.gate_up_proj`` stack (or the unfused ``gate_proj`` / ``up_proj`` stacks), ``down_proj`` for
    ``experts.down_proj``; only stacks the model has. Empty for a string target (``"all-linear"`` or a regular
    expression), a dense model, or a list without MLP names. PEFT alone adapts none of them on gpt-oss (the
    names match no module there), so Unsloth's default target list would train its attention only."""
    if isinstance(target_modules, str):
        return []
    stacks: dict[str, str] = {}  # leaf name -> its path below the layer ("mlp.experts.gate_up_proj")
    for name in expert_stack_names(model):
        *path, leaf = name.split(".")
        if "experts" in path:
            stacks.setdefault(leaf, name)
    out: list[str] = []
    for target in target_modules:
        for leaf in _EXPERT_STACKS_OF_MLP_NAME.get(target, ()):
            if leaf in stacks:
                if stacks[leaf] not in out:
                    out.append(stacks[leaf])
                break
    return out
