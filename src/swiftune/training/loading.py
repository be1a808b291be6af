"""``FastModel``: load a causal LM and its tokenizer, patch it, add LoRA adapters (the same
under Unsloth's names: :mod:`swiftune.training.unsloth_names`).

Everything goes through transformers' and PEFT's real entry points
(``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained``,
``peft.get_peft_model``), so what comes out is a normal transformers model / ``PeftModel`` whose
checkpoints and adapters load anywhere.
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention import BACKENDS
from ..errors import ConfigError
from ..local_paths import resolve_local_path
from ..data.multimodal import load_vision_processor
from ..models.families import family_of
from ..models.fp8_linear import quantize_model_fp8
from ..models.patching import fuse_lora_if_patched, patch_model
from ..models.qwen3_vl import (VISION_SKIP_MODULES, VISION_TOWER_MODULES, check_vision_tower_unquantized,
                               log_unquantized_expert_stacks)
from ..models.support import require_causal_decoder
from ..models.tiled_mlp import enable_tiled_mlp
from .checkpointing import enable_offloaded_checkpointing
from .merged_save import add_merged_save_methods
from .quantization import (check_fp8_request, fp8_checkpoint_kwargs, keep_4bit_layout_on_cpu,
                           refuse_full_finetuning_of_4bit, resolve_quantization, skip_modules_in_4bit)

# Tokens that real tokenizers ship unused and that make a safe pad token, best first
# (Llama 3's reserved pad, then the usual spellings). Checked only against the existing
# vocabulary: swiftune never adds tokens (that would need resizing the embeddings).
_PAD_CANDIDATES = (
    "<|finetune_right_pad_id|>",
    "<|pad|>",
    "<pad>",
    "[PAD]",
    "<|padding|>",
    "<|endoftext|>",
    "<unk>",
)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

# Keyword arguments that matter to both the model and the tokenizer loaders.
_SHARED_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code", "subfolder")

# Every value use_gradient_checkpointing takes; "unsloth" is Unsloth's name for "offload".
CHECKPOINTING_MODES = (True, False, "offload", "unsloth")

# Unsloth's default LoRA targets: every attention and MLP projection of a decoder layer.
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def default_dtype() -> torch.dtype:
    """bf16 on a CUDA device that supports it, else float32."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _local_cuda_device() -> int:
    """This process's GPU: ``LOCAL_RANK`` under torchrun/accelerate launch (each rank loads onto
    its own GPU before the Trainer sets the device), else the current device."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and local_rank.isdigit() and int(local_rank) < torch.cuda.device_count():
        return int(local_rank)
    return torch.cuda.current_device()


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be a torch.dtype, None or one of {sorted(_DTYPES)}, got {dtype!r}")


ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder a PEFT adapter folder


def read_adapter_config(folder: str) -> dict[str, Any]:
    """``folder``'s ``adapter_config.json`` (PEFT's), as a dict; a :class:`ConfigError` when the file is not a
    readable JSON object (a copy cut short)."""
    import json

    try:
        with open(os.path.join(folder, ADAPTER_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"adapter folder {folder}: its {ADAPTER_CONFIG} is not readable JSON ({e}); copy the "
                          "folder the training run wrote again") from e
    if not isinstance(config, dict):
        raise ConfigError(f"adapter folder {folder}: its {ADAPTER_CONFIG} holds no JSON object; copy the folder the "
                          "training run wrote again")
    return config


def adapter_folder_base(path: str) -> str | None:
    """The base model a PEFT adapter folder records (``adapter_config.json`` and no ``config.json``: what a
    LoRA run saves), or None when ``path`` is not such a folder. An adapter folder that records no base
    raises a :class:`ConfigError` saying what to load instead of transformers' "Unrecognized model"."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")) \
            or not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return None
    base = read_adapter_config(path).get("base_model_name_or_path") or None
    if base is None:
        raise ConfigError(
            f"{path} is a LoRA adapter folder that records no base model (base_model_name_or_path is empty): load "
            "the model it was trained on with FastModel.from_pretrained, then the adapter with "
            f"peft.PeftModel.from_pretrained(model, {path!r}, is_trainable=True)")
    return base


def load_adapter_folder(model: nn.Module, path: str, base: str) -> nn.Module:
    """The adapter of ``path`` on ``model`` (its base, loaded and patched) through PEFT, trainable (to
    train further, or to sample with ``for_inference``), with swiftune's LoRA forward where the model
    is patched. An adapter whose shapes do not fit the base raises a :class:`ConfigError`."""
    from peft import PeftModel

    try:
        peft_model = PeftModel.from_pretrained(model, path, is_trainable=True)
    except RuntimeError as e:  # load_state_dict's "size mismatch": the adapter of another model
        if "size mismatch" not in str(e):
            raise
        detail = " ".join(str(e).split())[:300]
        raise ConfigError(f"the adapter in {path} does not fit its recorded base {base!r} ({detail}); load the "
                          "model it was trained on and apply the adapter with peft.PeftModel") from e
    fuse_lora_if_patched(peft_model)
    return peft_model


def adapter_tokenizer(path: str, base_tokenizer: Any, fix_tokenizer: bool, model: nn.Module) -> Any:
    """The tokenizer a LoRA run saved beside its adapter (its chat template, pad token, added EOS), else
    the base's; ``model`` is the loaded base (its ``max_seq_length`` is the tokenizer's limit)."""
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")) or hasattr(base_tokenizer, "image_processor"):
        return base_tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(model, "max_seq_length", None) is not None:
        tokenizer.model_max_length = model.max_seq_length
    if fix_tokenizer:
        ensure_pad_token(tokenizer, model)
    return tokenizer


def ensure_pad_token(tokenizer: Any, model: nn.Module | None = None) -> None:
    """Give ``tokenizer`` a pad token when it has none, and say which one (a warning).

    Prefers an existing unused special token (e.g. Llama 3's ``<|finetune_right_pad_id|>``),
    else the eos token. Also sets ``pad_token_id`` on the model's config and generation config.
    """
    if tokenizer.pad_token is None:
        vocab = tokenizer.get_vocab()
        choice = next((t for t in _PAD_CANDIDATES if t in vocab and t != tokenizer.eos_token), None)
        if choice is None:
            choice = tokenizer.eos_token
        if choice is None:
            raise ValueError("the tokenizer has neither a pad token nor an eos token; set tokenizer.pad_token first")
        tokenizer.pad_token = choice
        note = (
            " (the eos token: mask padding out of the labels by position, not by token id)"
            if choice == tokenizer.eos_token
            else ""
        )
        warnings.warn(
            f"swiftune: the tokenizer has no pad token; using {choice!r} (id {tokenizer.pad_token_id}){note}",
            stacklevel=3,
        )
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.pad_token_id = tokenizer.pad_token_id


def first_nonfinite_tensor(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
    """``(name, what)`` of the first floating-point tensor holding NaN or inf, else ``None``;
    ``what`` counts them (``"3 NaN, 1 inf of 4096 values"``).

    Each tensor is screened with one float32 sum (no temporary of its size: NaN or inf anywhere
    makes the sum non-finite), all screens in one device sync; only a tensor that fails the screen
    is checked element-wise (a finite tensor whose sum overflows passes that check).
    Integer and quantised (packed ``uint8``) tensors, tensors on the ``meta`` device and dtypes
    without a sum kernel on their device are skipped.
    """
    candidates: list[tuple[str, torch.Tensor]] = []
    screens: list[torch.Tensor] = []
    for name, tensor in named_tensors:
        t = tensor.detach()
        if hasattr(t, "to_local"):  # a DTensor shard (FSDP2): this process's part
            t = t.to_local()
        if not t.is_floating_point() or t.is_meta or t.numel() == 0:
            continue
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        try:
            screen = torch.sum(t, dtype=acc).reshape(1)
        except (RuntimeError, TypeError, NotImplementedError):  # a dtype without a sum kernel here
            continue
        candidates.append((name, t))
        screens.append(screen)
    if not candidates:
        return None
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(screens):
        by_device.setdefault(s.device, []).append(i)
    suspects: list[int] = []
    for idx in by_device.values():
        finite = torch.isfinite(torch.cat([screens[i] for i in idx])).tolist()
        suspects += [i for i, ok in zip(idx, finite) if not ok]
    for i in sorted(suspects):
        name, t = candidates[i]
        t = t.float() if t.element_size() == 1 else t  # FP8: no isinf kernel for e4m3 / e5m2
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            parts = [f"{nan} NaN" if nan else "", f"{inf} inf" if inf else ""]
            return name, f"{', '.join(p for p in parts if p)} of {t.numel()} values"
    return None


def _refuse_nonfinite_weights(model: nn.Module, source: str, dtype: torch.dtype) -> None:
    """A ValueError naming the first parameter or buffer of ``model`` that holds NaN or inf."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    bad = first_nonfinite_tensor(tensors)
    if bad is None:
        return
    name, what = bad
    raise ValueError(
        f"{source!r}: the weight {name} holds non-finite values ({what}) after loading in {dtype}; swiftune "
        "does not train from NaN/inf weights (every loss and gradient would be NaN). Load an earlier, finite "
        "checkpoint; if the file is fine in its own dtype, the conversion overflowed: load with "
        "dtype=torch.bfloat16 or torch.float32 instead of float16."
    )


def _with_rope_scaling(config: Any, rope_scaling: dict[str, Any], name: str) -> Any:
    """A copy of ``config`` whose RoPE parameters carry ``rope_scaling`` (transformers' keys:
    ``{"rope_type": "linear", "factor": 2.0}``; the older ``"type"`` key is accepted).

    Merged into the config's ``rope_parameters`` rather than assigned to the deprecated
    ``rope_scaling`` attribute, which in transformers 5 replaces the whole dict and so drops
    ``rope_theta``. A copy, so that a ``config`` the caller passed is left as it was.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_scaling)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    kind = scaling.get("rope_type")
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"rope_scaling={rope_scaling!r}: rope_type must be one of {sorted(ROPE_INIT_FUNCTIONS)}, "
                          f"e.g. {{'rope_type': 'linear', 'factor': 2.0}}")
    current = getattr(config, "rope_parameters", None)
    if not isinstance(current, dict) or not current:
        raise ConfigError(f"rope_scaling: {name!r} ({config.model_type}) has no RoPE parameters to scale; leave "
                          "rope_scaling=None")
    if any(isinstance(v, dict) for v in current.values()):
        raise ConfigError(f"rope_scaling: {name!r} ({config.model_type}) has RoPE parameters per layer type "
                          f"({sorted(current)}); leave rope_scaling=None and pass config= with config.rope_parameters "
                          "set for each layer type")
    config = copy.deepcopy(config)
    config.rope_parameters = {**current, **scaling}
    if callable(getattr(config, "standardize_rope_params", None)):
        config.standardize_rope_params()  # e.g. original_max_position_embeddings for yarn / llama3
    if callable(getattr(config, "validate_rope", None)):
        try:
            config.validate_rope()
        except (KeyError, ValueError) as e:
            raise ConfigError(f"rope_scaling={rope_scaling!r} is not valid for {name!r}: {e}") from e
    return config


def _check_causal_lm(config: Any, name: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        archs = getattr(config, "architectures", None) or []
        raise ValueError(
            f"{name!r} is not a causal language model (model_type {config.model_type!r}, architectures {archs}); "
            "swiftune fine-tunes decoder-only causal LMs (AutoModelForCausalLM)"
        )
    require_causal_decoder(config, repr(name))  # BERT & co. map to a causal LM class but attend both ways


def check_checkpointing_mode(mode: Any) -> None:
    """A :class:`ConfigError` listing every accepted ``use_gradient_checkpointing`` value when
    ``mode`` is none of them (checked before a model is loaded or changed)."""
    if mode not in CHECKPOINTING_MODES:
        raise ConfigError(
            f"use_gradient_checkpointing must be True, False, 'offload' or 'unsloth', got {mode!r}: True checkpoints "
            "every decoder layer, 'offload' also keeps the layer inputs that do not fit on the GPU in pinned CPU "
            "memory ('unsloth' is Unsloth's name for 'offload'), False turns checkpointing off")


def drop_input_require_grads(hf_model: nn.Module) -> None:
    """Remove the forward hook that makes the input embeddings' output require grad.

    transformers' ``activation_checkpointing_enable`` and PEFT's model set-up both add it
    (``enable_input_require_grads``): *reentrant* checkpointing needs an input that requires grad
    or no gradient reaches the adapters. swiftune checkpoints without reentrance, where the LoRA
    weights inside each layer carry the graph, so the hook only costs: the output becomes a leaf
    that requires grad, autograd's accumulator node holds it for the whole step (one layer input
    on the GPU that offloaded checkpointing was meant to move to the host, ``tokens x hidden``
    elements), and backward computes its gradient through the first layer for nobody. Each call
    of ``enable_input_require_grads`` replaces the list ``disable_input_require_grads`` reads, so
    this runs after each of them."""
    if hasattr(hf_model, "disable_input_require_grads"):
        hf_model.disable_input_require_grads()


def checkpoints_reentrantly(hf_model: nn.Module) -> bool:
    """Whether a module of ``hf_model`` runs transformers' checkpointing with reentrance (``use_reentrant`` true or
    left to torch's default): that checkpointing needs the input embeddings' output to require grad."""
    for module in hf_model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and func is not None:
            if getattr(func, "keywords", {}).get("use_reentrant", True):
                return True
    return False


def enable_gradient_checkpointing(
    model: nn.Module, mode: bool | str = True, *, offload_gpu_budget_bytes: int | None = None,
    offload_host_budget_bytes: int | None = None, offload_attention_output_layers: int = 0,
    offload_attention_outputs_on_host: bool = False,
) -> nn.Module:
    """Turn on non-reentrant gradient checkpointing of every decoder layer.

    ``mode="offload"`` checkpoints each layer with its saved input in pinned CPU memory, copied
    asynchronously and brought back just in time in backward, keeping as many layers on the GPU
    as its budget allows (:func:`swiftune.training.checkpointing.enable_offloaded_checkpointing`):
    ``offload_gpu_budget_bytes`` (``None``: what is free at each forward, less the rest of the step;
    ``0``: every layer input on the host, the least GPU memory) and ``offload_host_budget_bytes``
    (a cap on the pinned host memory it may take, e.g. on a host shared with other jobs; ``None``:
    what the machine has available less a margin). ``offload_attention_output_layers``: the last this many
    layers keep their sdpa attention outputs on the GPU through the recompute instead of running the kernel
    again (long sequences: most of a recompute's time; :mod:`swiftune.attention.kept_outputs`);
    ``offload_attention_outputs_on_host``: in pinned host memory instead, copied like the layer inputs (the
    GPU holds two layers' at a time; :mod:`swiftune.training.host_attention_outputs`).
    """
    check_checkpointing_mode(mode)
    if offload_attention_output_layers and mode not in ("offload", "unsloth"):
        raise ValueError("offload_attention_output_layers needs use_gradient_checkpointing='offload'")
    if offload_attention_outputs_on_host and not offload_attention_output_layers:
        raise ValueError("offload_attention_outputs_on_host=True needs offload_attention_output_layers=n (the last n "
                         "decoder layers keep their attention outputs) and use_gradient_checkpointing='offload'")
    for name, value in (("offload_gpu_budget_bytes", offload_gpu_budget_bytes),
                        ("offload_host_budget_bytes", offload_host_budget_bytes)):
        if value is not None and mode not in ("offload", "unsloth"):
            raise ValueError(f"{name} needs use_gradient_checkpointing='offload'")
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if not mode:
        return model
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    drop_input_require_grads(hf_model)  # one PEFT put there when it loaded an adapter folder
    kwargs = {"use_reentrant": False}
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.2x (old name deprecated)
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    drop_input_require_grads(hf_model)  # non-reentrant: the input need not require grad
    hf_model.config.use_cache = False  # a KV cache is useless in training and conflicts with checkpointing
    if mode in ("offload", "unsloth"):
        # takes over from transformers' per-layer flag
        enable_offloaded_checkpointing(hf_model, gpu_budget_bytes=offload_gpu_budget_bytes,
                                       host_budget_bytes=offload_host_budget_bytes,
                                       attention_output_layers=offload_attention_output_layers,
                                       attention_outputs_on_host=offload_attention_outputs_on_host)
    else:
        hf_model._swiftune_offload_checkpointing = False
    return model


class FastModel:
    """Entry points: :meth:`from_pretrained` and :meth:`get_peft_model`."""

    @staticmethod
    def from_pretrained(
        model_name_or_path: str | None = None,
        max_seq_length: int | None = None,
        dtype: torch.dtype | str | None = None,
        attn_implementation: str = "auto",
        patch: bool = True,
        kernel_backend: str = "auto",
        load_in_4bit: bool = False,
        load_in_8bit: bool = False,
        quantization_config: Any = None,
        *,
        load_in_fp8: bool = False,
        model_name: str | None = None,
        rope_scaling: dict[str, Any] | None = None,
        fix_tokenizer: bool = True,
        **hf_kwargs: Any,
    ) -> tuple[nn.Module, Any]:
        """Load a causal LM and its tokenizer through transformers, then patch the model.

        Args:
            model_name_or_path: local directory or hub name.
            model_name: the same, under Unsloth's name (give one of the two).
            max_seq_length: longest sequence you will train on; recorded as
                ``model.max_seq_length`` and ``tokenizer.model_max_length`` (default: the
                config's ``max_position_embeddings``).
            dtype: ``None`` = bf16 on a CUDA device that supports it, else float32.
            attn_implementation: ``"auto"`` (swiftune's packed attention, backend chosen per
                layer), a packed backend name (``varlen``, ``flash_attn``, ``flex``,
                ``reference``), or a transformers implementation (``"sdpa"``, ``"eager"``, ...)
                to keep it.
            patch: apply :func:`swiftune.patch_model` (fused kernels + packed attention).
            kernel_backend: ``"auto"``, ``"triton"`` or ``"reference"`` for the fused kernels.
            load_in_4bit: QLoRA: the decoder's linear weights in bitsandbytes NF4 (double
                quantisation, matmuls in ``dtype``); needs ``pip install 'swiftune[qlora]'``. A
                vision-language model: its text decoder's projections only (the vision tower, its
                mergers and the LM head stay in ``dtype``).
            load_in_8bit: refused (swiftune trains on 4-bit or unquantised bases).
            quantization_config: a transformers ``BitsAndBytesConfig`` with ``load_in_4bit=True``
                (or its dict), for settings other than :func:`~swiftune.training.quantization.nf4_config`.
            load_in_fp8: the decoder's linear weights in ``float8_e4m3fn`` with per-row scales, frozen
                (``torch._scaled_mm`` on GPUs with FP8 tensor cores, else dequantised; docs/fp8.md); on
                a vision-language model the text decoder's only, as with ``load_in_4bit``.
            rope_scaling: RoPE scaling set on the config before the weights load, in transformers'
                keys (``{"rope_type": "linear", "factor": 2.0}``, ``"yarn"``, ``"llama3"``, ...), e.g. to
                train past ``max_position_embeddings``.
            fix_tokenizer: give a tokenizer without a pad token one (:func:`ensure_pad_token`);
                ``False`` keeps the tokenizer as loaded (padded batches then need a pad token set).
            **hf_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (``device_map``,
                ``revision``, ``token``, ...; the shared ones also to the tokenizer).

        Returns:
            ``(model, tokenizer)``; with ``fix_tokenizer`` the tokenizer always has a pad token.
        """
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        if (model_name_or_path is None) == (model_name is None):
            given = "both" if model_name is not None else "neither"
            raise ConfigError(f"FastModel.from_pretrained: {given} of model_name_or_path and model_name given; pass "
                              "the model's local directory or hub name as one of them (model_name is Unsloth's name)")
        if model_name_or_path is None:
            model_name_or_path = model_name
        model_name_or_path = resolve_local_path(model_name_or_path, "model")  # a missing local path: no Hub lookup
        base = adapter_folder_base(model_name_or_path)
        if base is not None:  # a LoRA run's output folder: its base, then the adapter on it (as Unsloth loads it)
            model, tokenizer = FastModel.from_pretrained(
                base, max_seq_length, dtype, attn_implementation, patch, kernel_backend, load_in_4bit, load_in_8bit,
                quantization_config, load_in_fp8=load_in_fp8, rope_scaling=rope_scaling, fix_tokenizer=fix_tokenizer,
                **hf_kwargs)
            tokenizer = adapter_tokenizer(model_name_or_path, tokenizer, fix_tokenizer, model)
            # Unsloth's save_pretrained_merged / push_to_hub_merged (docs/unsloth_compat.md, "Saving")
            return add_merged_save_methods(load_adapter_folder(model, model_name_or_path, base)), tokenizer
        # checked before any file is read: a bad combination or a missing bitsandbytes says so first
        check_fp8_request(load_in_fp8, load_in_4bit, load_in_8bit, quantization_config)
        quantization = resolve_quantization(load_in_4bit, load_in_8bit, quantization_config, _resolve_dtype(dtype))
        if quantization is not None:
            hf_kwargs["quantization_config"] = quantization
        shared = {k: hf_kwargs[k] for k in _SHARED_KWARGS if k in hf_kwargs}
        config = hf_kwargs.pop("config", None) or AutoConfig.from_pretrained(model_name_or_path, **shared)
        vision = getattr(family_of(config), "vision_language", False)  # Qwen3-VL: docs/vision.md
        if not vision:
            _check_causal_lm(config, model_name_or_path)
        elif quantization is not None:  # only the text decoder's projections: the vision tower stays as loaded
            hf_kwargs["quantization_config"] = quantization = skip_modules_in_4bit(quantization, VISION_SKIP_MODULES)
        if quantization is None:  # an FP8 checkpoint loads dequantised (then re-quantised with load_in_fp8)
            hf_kwargs.update(fp8_checkpoint_kwargs(config))
        if rope_scaling is not None:
            config = _with_rope_scaling(config, rope_scaling, model_name_or_path)

        packed = attn_implementation == "auto" or attn_implementation in BACKENDS
        # Packed attention replaces the implementation right after loading, so load with "eager",
        # which every model supports (Gemma 2 has no sdpa); unpatched, transformers' default.
        load_attn = ("eager" if patch else None) if packed else attn_implementation
        if "device_map" not in hf_kwargs and torch.cuda.is_available():
            hf_kwargs["device_map"] = {"": _local_cuda_device()}
        auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto_class.from_pretrained(
            model_name_or_path, config=config, dtype=_resolve_dtype(dtype), attn_implementation=load_attn, **hf_kwargs
        )
        _refuse_nonfinite_weights(model, model_name_or_path, model.dtype)
        if quantization is not None:
            # a CPU evaluation or rollout must not switch the rest of the run to bf16 (see the function)
            keep_4bit_layout_on_cpu(model)
        if load_in_fp8:
            quantize_model_fp8(model, skip=VISION_TOWER_MODULES if vision else ())
        if vision and (quantization is not None or load_in_fp8):
            check_vision_tower_unquantized(model)
        if vision and quantization is not None:  # Qwen3-VL-MoE: the expert stacks stay in the load dtype
            log_unquantized_expert_stacks(model)
        if vision:  # the processor (tokenizer + image processor) takes the tokenizer's place
            tokenizer = load_vision_processor(model_name_or_path, **shared)
        else:
            tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **shared)
        if fix_tokenizer:
            ensure_pad_token(getattr(tokenizer, "tokenizer", tokenizer), model)

        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if max_seq_length is None:
            max_seq_length = limit
        elif limit is not None and max_seq_length > limit:
            warnings.warn(
                f"swiftune: max_seq_length={max_seq_length} exceeds the model's max_position_embeddings={limit}; "
                "quality past it depends on the model's RoPE scaling",
                stacklevel=2,
            )
        model.max_seq_length = max_seq_length
        if max_seq_length is not None:
            getattr(tokenizer, "tokenizer", tokenizer).model_max_length = max_seq_length

        if patch:
            patch_model(model, attention=attn_implementation if packed else None, kernel_backend=kernel_backend)
        # Unsloth's save methods, here already so that calling them before get_peft_model says what to do
        return add_merged_save_methods(model), tokenizer

    @staticmethod
    def get_peft_model(
        model: nn.Module,
        r: int = 16,
        lora_alpha: int = 16,
        target_modules: str | list[str] = "all-linear",
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing: bool | str = True,
        random_state: int = 3407,
        use_rslora: bool = False,
        modules_to_save: list[str] | None = None,
        offload_gpu_budget_bytes: int | None = None,
        offload_host_budget_bytes: int | None = None,
        offload_attention_output_layers: int = 0,
        offload_attention_outputs_on_host: bool = False,
        tiled_mlp: bool | None = None,
        **lora_kwargs: Any,
    ) -> nn.Module:
        """Add LoRA adapters through PEFT; the result is a normal ``peft.PeftModel``.

        Args:
            model: a (patched) transformers causal LM.
            r, lora_alpha, target_modules, lora_dropout, bias, use_rslora, modules_to_save,
                **lora_kwargs: ``peft.LoraConfig`` fields (``"all-linear"`` = every linear layer
                but the output head).
            use_gradient_checkpointing: ``True`` (non-reentrant checkpointing of every layer),
                ``False``, or ``"offload"`` / ``"unsloth"`` (see :func:`enable_gradient_checkpointing`).
            offload_gpu_budget_bytes: with ``"offload"``, GPU bytes the kept layer inputs may take
                (``None``: as many as fit; ``0``: all on the host).
            offload_host_budget_bytes: with ``"offload"``, a cap on the pinned host memory the
                offloaded inputs may take (``None``: what the machine has available).
            offload_attention_output_layers: with ``"offload"``, the last this many layers keep their sdpa
                attention outputs on the GPU through the recompute (``0``: none; see
                :func:`enable_gradient_checkpointing`).
            offload_attention_outputs_on_host: keep those outputs in pinned host memory instead of on the GPU.
            tiled_mlp: run the MLP and the LoRA projections in sequence tiles
                (:func:`swiftune.models.enable_tiled_mlp`: a long row's MLP temporaries stay about 1 GiB, for one
                more MLP forward in the backward and more kernel launches). ``None`` (default): with ``"offload"`` /
                ``"unsloth"``, whose use is long rows; ``False``: never, the faster choice for batches of short rows
                or token budgets of a few thousand tokens (docs/benchmarks.md, "QLoRA SFT"); ``True``: always.
            random_state: seed of the adapter initialisation (the global RNG is left untouched).
        """
        from peft import LoraConfig, PeftModel, get_peft_model

        if isinstance(model, PeftModel):
            # adapters already there (a LoRA folder loaded by from_pretrained): kept, as Unsloth keeps them; only
            # the checkpointing is set up
            warnings.warn("swiftune: the model already has LoRA adapters (loaded from an adapter folder); they are "
                          "trained as they are, and get_peft_model's r, lora_alpha, target_modules and other adapter "
                          "settings are not applied", stacklevel=2)
            enable_gradient_checkpointing(model, use_gradient_checkpointing,
                                          offload_gpu_budget_bytes=offload_gpu_budget_bytes,
                                          offload_host_budget_bytes=offload_host_budget_bytes,
                                          offload_attention_output_layers=offload_attention_output_layers,
                                          offload_attention_outputs_on_host=offload_attention_outputs_on_host)
            return add_merged_save_methods(model)
        if tiled_mlp is not None and not isinstance(tiled_mlp, bool):
            raise ValueError(f"tiled_mlp must be True, False or None (with offloaded checkpointing), got {tiled_mlp!r}")
        config = LoraConfig(
            r=r,
            lora_alpha=lora_alpha,
            target_modules=target_modules,
            lora_dropout=lora_dropout,
            bias=bias,
            use_rslora=use_rslora,
            modules_to_save=modules_to_save,
            task_type="CAUSAL_LM",
            **lora_kwargs,
        )
        warn_about_vision_tower_targets(model, target_modules)
        enable_gradient_checkpointing(model, use_gradient_checkpointing, offload_gpu_budget_bytes=offload_gpu_budget_bytes,
                                      offload_host_budget_bytes=offload_host_budget_bytes,
                                      offload_attention_output_layers=offload_attention_output_layers,
                                      offload_attention_outputs_on_host=offload_attention_outputs_on_host)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(random_state)
            peft_model = get_peft_model(model, config)
        drop_input_require_grads(peft_model.get_base_model())  # PEFT's (see the helper)
        adapted = _adapted_parameter_paths(peft_model)  # one walk for both checks
        check_target_parameters_adapted(peft_model, lora_kwargs.get("target_parameters"), adapted)
        warn_about_unmatched_target_modules(peft_model, target_modules, adapted)
        if tiled_mlp or (tiled_mlp is None and use_gradient_checkpointing in ("offload", "unsloth")):
            # Long contexts: the MLP (LoRA projections included, hence after PEFT wrapped them)
            # runs in tiles along the sequence so one layer's temporaries stay a few GB.
            enable_tiled_mlp(peft_model, projections=True)
        fuse_lora_if_patched(peft_model)  # one autograd node per LoRA linear (after the tiling: underneath it)
        # model.save_pretrained_merged(dir, tokenizer, save_method="merged_16bit" | "lora"), as in Unsloth
        return add_merged_save_methods(peft_model)

    @staticmethod
    def for_training(model: nn.Module, use_gradient_checkpointing: bool | str = True,
                     offload_gpu_budget_bytes: int | None = None,
                     offload_host_budget_bytes: int | None = None,
                     offload_attention_output_layers: int = 0,
                     offload_attention_outputs_on_host: bool = False) -> nn.Module:
        """Full fine-tuning: every parameter trainable, gradient checkpointing (budgets as in
        :meth:`get_peft_model`), train mode. A 4-bit or FP8 model is refused (add LoRA adapters instead)."""
        refuse_full_finetuning_of_4bit(model, "FastModel.for_training")
        for p in model.parameters():
            p.requires_grad_(True)
        enable_gradient_checkpointing(model, use_gradient_checkpointing, offload_gpu_budget_bytes=offload_gpu_budget_bytes,
                                      offload_host_budget_bytes=offload_host_budget_bytes,
                                      offload_attention_output_layers=offload_attention_output_layers,
                                      offload_attention_outputs_on_host=offload_attention_outputs_on_host)
        return model.train()


def _adapted_parameter_paths(peft_model: nn.Module) -> set[str]:
    """The full names of the parameters PEFT's ``ParamWrapper`` layers adapt (nested wrappers: ``base_layer``)."""
    adapted = set()
    for name, module in peft_model.named_modules():
        parameter = getattr(module, "parameter_name", None)
        if parameter is not None and hasattr(module, "lora_A"):
            adapted.add(f"{name.replace('.base_layer', '')}.{parameter}")
    return adapted


def _names_end_with(name: str, target: str) -> bool:
    """Whether the dotted ``name`` is ``target`` or ends with it as whole components (PEFT's suffix match)."""
    return name == target or name.endswith("." + target)


def expert_stack_names(model: nn.Module) -> list[str]:
    """The model's stacked (3-D) weights, named below their layer (``mlp.experts.gate_up_proj``), with or without
    PEFT's wrappers around them."""
    return sorted({re.sub(r"^.*\blayers\.\d+\.", "", n.replace(".base_layer", ""))
                   for n, p in model.named_parameters() if p.dim() == 3})


#: target_modules names of MLP projections that stand for expert stacks on MoE models (PEFT maps them there on
#: the families in its conversion table, as Unsloth does everywhere)
_MLP_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3"})


def warn_about_unmatched_target_modules(peft_model: nn.Module, target_modules: Any,
                                        adapted: set[str] | None = None) -> list[str]:
    """Warn about names of a ``target_modules`` list that adapted nothing (PEFT skips them once another name
    matched): the gate/up/down names of a dense-model recipe on gpt-oss, whose experts are parameters, left its
    experts untrained without a word. Names of MLP projections count as adapted where PEFT mapped them onto
    expert stacks. Returns the names warned about (a regular expression or ``"all-linear"``: none).
    ``adapted``: :func:`_adapted_parameter_paths` of ``peft_model`` where the caller has it already."""
    if isinstance(target_modules, str) or not target_modules:
        return []
    wrapped = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    if adapted is None:
        adapted = _adapted_parameter_paths(peft_model)
    experts_adapted = any(".experts." in p for p in adapted)
    missed = [t for t in target_modules
              if not any(_names_end_with(n, t) for n in wrapped) and not (t in _MLP_NAMES and experts_adapted)]
    if missed:
        stacks = expert_stack_names(peft_model)
        hint = (f"; this model's experts are parameters, which target_parameters adapts: {stacks}" if stacks
                and any(t in _MLP_NAMES for t in missed) else "")
        warnings.warn(f"swiftune: target_modules {', '.join(missed)} matched no module of this model and train no "
                      f"adapter (PEFT skips them without a word){hint}", stacklevel=3)
    return missed


def check_target_parameters_adapted(peft_model: nn.Module, target_parameters: Iterable[str] | None,
                                    adapted: set[str] | None = None) -> None:
    """Refuse ``target_parameters`` names that adapted nothing. PEFT skips such a name without a word when the
    module targets matched (``gate_proj`` for gpt-oss's ``gate_up_proj``: the experts would train no adapter);
    a name counts as adapted when a ``ParamWrapper`` adapts a parameter whose full name ends with it.
    ``adapted``: :func:`_adapted_parameter_paths` of ``peft_model`` where the caller has it already."""
    if not target_parameters:
        return
    if isinstance(target_parameters, str):
        target_parameters = [target_parameters]
    if adapted is None:
        adapted = _adapted_parameter_paths(peft_model)
    missed = [t for t in target_parameters if not any(_names_end_with(a, t) for a in adapted)]
    if not missed:
        return
    stacked = expert_stack_names(peft_model)  # what could be meant
    hint = (f"the model's expert weights stored as parameters: {', '.join(stacked)}" if stacked else
            "this model has no expert weights stored as parameters (its linear layers take target_modules)")
    raise ConfigError(f"target_parameters (--lora_target_parameters) {', '.join(missed)}: adapted no parameter of "
                      f"the model (PEFT skips such a name silently); {hint}")


# ------------------------------------------------------------------ LoRA targets in the vision tower

#: Module types PEFT's LoRA wraps, i.e. what a target string can adapt.
_ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def _target_matches(target: str, name: str, regex: bool) -> bool:
    """PEFT's rule for one target: a string ``target_modules`` is a regular expression on the whole
    module name; an entry of a list matches the name itself or a dotted suffix of it."""
    return re.fullmatch(target, name) is not None if regex else name == target or name.endswith("." + target)


def _in_vision_tower(name: str) -> bool:
    return any(f".{prefix}." in f".{name}." for prefix in VISION_TOWER_MODULES)


def _names_vision_tower(target: str) -> bool:
    """A target that spells the vision tower's attribute (``visual``) asks for its modules on purpose."""
    return any(prefix.rsplit(".", 1)[-1] in target for prefix in VISION_TOWER_MODULES)


def _distinguishing_suffix(name: str, target: str, regex: bool, avoid: set[str]) -> str:
    """The shortest dotted suffix of ``name`` (no shorter than a list entry ``target``) that no name
    of ``avoid`` matches as a list entry of ``target_modules``."""
    parts = name.split(".")
    for k in range(1 if regex else len(target.split(".")), len(parts) + 1):
        suffix = ".".join(parts[-k:])
        if not any(_target_matches(suffix, other, regex=False) for other in avoid):
            return suffix
    return name


def warn_about_vision_tower_targets(model: nn.Module, target_modules: Any) -> None:
    """Warn once when LoRA targets reach vision-tower modules the user most likely did not mean.

    A target (an entry of ``target_modules``, or its one regular expression) that spells the
    vision tower (``visual``) is taken as meant. Any other target that matches vision-tower modules
    is flagged when it also matches modules outside the tower (the vision matches ride along with
    the text decoder's), or when its vision matches mix ``nn.Linear`` modules with other types:
    the others are flagged (Qwen3-VL's ``"proj"``, a suffix, reaches the vision blocks' attention
    output projection and also the patch embedding's ``Conv3d`` ``model.visual.patch_embed.proj``).
    The warning names the flagged modules and the ``target_modules`` that adapts the rest only.
    ``None`` and ``"all-linear"`` (PEFT's own choices) are not checked."""
    if target_modules is None or target_modules == "all-linear":
        return
    regex = isinstance(target_modules, str)
    targets = [target_modules] if regex else [str(t) for t in target_modules]
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, _ADAPTABLE)]
    if not any(_in_vision_tower(n) for n, _ in modules):
        return
    notes: list[str] = []
    replacement: list[str] = []
    example = ""  # a list entry that names the first flagged module alone, for the message
    for target in targets:
        matched = [] if _names_vision_tower(target) else [(n, m) for n, m in modules
                                                           if _target_matches(target, n, regex)]
        vision = [(n, m) for n, m in matched if _in_vision_tower(n)]
        if len(vision) < len(matched):
            unmeant = vision
        elif any(isinstance(m, nn.Linear) for _, m in vision):
            unmeant = [(n, m) for n, m in vision if not isinstance(m, nn.Linear)]
        else:
            unmeant = []
        if not unmeant:
            replacement.append(target)
            continue
        avoid = {n for n, _ in unmeant}
        example = example or ".".join(unmeant[0][0].split(".")[-2:])
        replacement.extend(sorted({_distinguishing_suffix(n, target, regex, avoid) for n, _ in matched if n not in avoid}))
        listed = ", ".join(f"{n} ({type(m).__name__})" for n, m in unmeant[:4])
        more = f" and {len(unmeant) - 4} more" if len(unmeant) > 4 else ""
        notes.append(f"{target!r} also matches {listed}{more}")
    if notes:
        warnings.warn(
            f"swiftune: LoRA target_modules={target_modules!r}: {'; '.join(notes)} (vision-tower modules the "
            f"target most likely was not meant for; PEFT adapts them as well). To adapt only the others, use "
            f"target_modules={replacement!r}; to adapt these on purpose, name them (e.g. {example!r}) or a "
            "path through 'visual'.", UserWarning, stacklevel=3)
