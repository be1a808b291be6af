"""What swiftune can train a model with: causal decoders only, and packed rows only where its
own attention runs.

Padding-free and packed rows put several examples in one row and rely on the attention layers to
keep them apart (documents found from ``position_ids``). Only swiftune's packed attention does
that for every architecture it patches (:data:`swiftune.models.families.FAMILIES`); an
architecture it does not patch (GPT-2, say) runs transformers' own attention, which may let every
token attend to the previous examples of the row: the loss is then silently wrong. So:

* :func:`controls_attention` says whether the model's attention is swiftune's;
* :func:`batch_layout_for` is the one decision the trainers take: the requested layout where
  swiftune controls the attention; elsewhere padded rows with a warning naming the architecture
  (for the padding-free default), or an error (``packing=True`` asked for explicitly);
* :func:`require_causal_decoder` refuses encoders (BERT and its relatives, bidirectional
  Gemma), which would train as if they were causal LMs.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..attention import PACKED_ATTENTION_IMPLEMENTATIONS, has_packed_context
from .families import family_of, supported_model_types
from .patching import causal_lm_of
from .qwen3_vl import text_config_of

BATCH_LAYOUTS = ("padding_free", "packed", "padded")


def _describe(hf_model: nn.Module) -> str:
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    return f"{type(hf_model).__name__} (model_type {model_type!r})"


def attention_problem(model: nn.Module) -> str | None:
    """Why swiftune's packed attention does not run in ``model`` (``None`` when it does)."""
    hf_model = causal_lm_of(model)
    config = getattr(hf_model, "config", None)
    if family_of(config) is None:
        return f"swiftune does not patch this architecture (supported families: {supported_model_types()})"
    # a vision-language model's text decoder has its own (sub-)config and implementation
    impl = getattr(text_config_of(config), "_attn_implementation", None)
    base = getattr(hf_model, "base_model", hf_model)
    if impl not in PACKED_ATTENTION_IMPLEMENTATIONS or not has_packed_context(base):
        return (f"its attention implementation is {impl!r}, not swiftune's packed attention (call "
                "swiftune.patch_model(model), or load with FastModel.from_pretrained(attn_implementation='auto'))")
    return None


def controls_attention(model: nn.Module) -> bool:
    """Whether every attention layer of ``model`` runs swiftune's packed (document-aware) attention."""
    return attention_problem(model) is None


def encoder_problem(config: Any) -> str | None:
    """Why ``config`` describes a bidirectional (non-causal) model, or ``None`` for a causal decoder."""
    if config is None:
        return None
    if getattr(config, "use_bidirectional_attention", False):
        return "it uses bidirectional attention (use_bidirectional_attention=True)"
    if getattr(config, "is_encoder_decoder", False) and not getattr(config, "is_decoder", False):
        return "it is an encoder-decoder (sequence-to-sequence) model"
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    causal = getattr(config, "is_decoder", False) or getattr(config, "causal", False)
    if getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not causal:
        return "it is a bidirectional encoder (masked LM; is_decoder is not set)"
    return None


def require_causal_decoder(model_or_config: Any, name: str | None = None) -> None:
    """Raise ``ValueError`` when ``model_or_config`` (a model, PEFT model or config) is not a causal decoder.

    An encoder-decoder pair counts as non-causal only when loaded as a whole: transformers'
    ``*ForCausalLM`` classes of encoder-decoder families (``BartForCausalLM``) are decoders.
    """
    if isinstance(model_or_config, nn.Module):
        hf_model = causal_lm_of(model_or_config)
        config = getattr(hf_model, "config", None)
        what = name or _describe(hf_model)
    else:
        config = model_or_config
        what = name or f"{type(config).__name__} (model_type {getattr(config, 'model_type', None)!r})"
    problem = encoder_problem(config)
    if problem is not None:
        raise ValueError(
            f"{what} is not a causal language model: {problem}. swiftune trains causal decoders "
            f"(decoder-only LMs such as {supported_model_types()}); use a decoder-only checkpoint"
        )


def batch_layout_for(model: nn.Module, requested: str, *, trainer: str = "SFT") -> str:
    """The batch layout to train ``model`` with, given the ``requested`` one (``SFTConfig.batch_mode``;
    GRPO's policy rows ask for ``"padding_free"``; ``trainer`` only words the warning).

    * a non-causal model: ``ValueError`` (:func:`require_causal_decoder`);
    * ``"padded"``, or swiftune's packed attention runs in the model: ``requested`` itself;
    * ``"packed"`` (``packing=True``) without it: ``ValueError`` naming the architecture and the
      supported families (packed rows cannot be made safe there);
    * ``"padding_free"`` (the default) without it: ``"padded"``, with a warning naming the
      architecture (padding-free rows would let examples attend across their boundaries).
    """
    if requested not in BATCH_LAYOUTS:
        raise ValueError(f"unknown batch layout {requested!r}; choose one of {BATCH_LAYOUTS}")
    require_causal_decoder(model)
    if requested == "padded":
        return requested
    problem = attention_problem(model)
    if problem is None:
        return requested
    what = _describe(causal_lm_of(model))
    if requested == "packed":
        raise ValueError(
            f"packing=True needs swiftune's packed attention to keep the packed examples apart, and "
            f"{what} does not run it: {problem}. Set packing=False (padded batches) or use a supported "
            "family"
        )
    if trainer == "GRPO":
        instead = "so the policy forward runs the rollouts as padded rows instead (slower, same log-probs)"
    else:
        instead = ("so batches are padded instead (as with padding_free=False); set padding_free=False to "
                   "silence this warning")
    warnings.warn(
        f"swiftune: {what} does not run swiftune's packed attention: {problem}. Padding-free rows would "
        f"let examples attend across their boundaries, {instead}",
        UserWarning,
        stacklevel=2,
    )
    return "padded"
