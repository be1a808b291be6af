"""Unsloth's ``model.save_pretrained_merged`` / ``model.push_to_hub_merged`` for swiftune's models.

``save_method="merged_16bit"`` writes an ordinary transformers checkpoint (``config.json``, safetensors
shards, the tokenizer when given) of the base with the active LoRA adapters added to it, which plain
``transformers.AutoModelForCausalLM.from_pretrained`` loads. The base may be unquantised, NF4 (bitsandbytes:
dequantised by ``bitsandbytes.functional.dequantize_4bit``, the function PEFT's own 4-bit merge calls) or FP8
(:class:`~swiftune.models.fp8_linear.FP8Linear`: ``Q * s``). ``save_method="lora"`` writes the adapter folder
(PEFT's ``save_pretrained``).

The training model is never changed: nothing is merged into it (PEFT's ``merge_and_unload`` adds the
update into the live weights, and cannot at all into e4m3 codes). Each merged weight is computed when its
shard is written and dropped after it, so the extra memory is about one shard (``max_shard_size``), not a
second copy of the model. A decoder layer never straddles two shards, so that transformers' reverse weight
conversions (which can join several tensors of a layer into one) see a whole layer.

The merge does PEFT's arithmetic (``weight += lora.get_delta_weight(adapter)`` in the base weight's dtype,
each active adapter in turn), then casts to the output dtype, so on an unquantised base the file holds
exactly what ``merge_and_unload()`` holds.

Merged: LoRA on linear and embedding layers (any base above), PEFT's ``target_parameters`` (MoE expert
stacks, ``ParamWrapper``), ``modules_to_save`` (the trained copy is written). Refused with a
:class:`~swiftune.errors.ConfigError`: LoRA variants whose merge is not a weight update (DoRA), other PEFT
methods, models without adapters and models that did not come through ``FastModel``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..models.fp8_linear import FP8Linear
from ..models.patching import causal_lm_of

__all__ = ["SAVE_METHODS", "add_merged_save_methods", "mark_fast_model", "push_to_hub_merged",
           "save_pretrained_merged"]

#: The ``save_method`` values Unsloth users pass; the 4-bit ones are refused (see :func:`save_pretrained_merged`).
SAVE_METHODS = ("merged_16bit", "lora", "merged_4bit", "merged_4bit_forced")

# Set on the transformers causal LM by FastModel (from_pretrained, get_peft_model): a plain instance attribute,
# never a parameter or buffer, so it is not saved.
_FAST_MODEL_ATTR = "swiftune_fast_model"

_WEIGHTS_NAME = "model.safetensors"
_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_OUT_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float32": torch.float32, "fp32": torch.float32}

_QUANTIZED_4BIT_ADVICE = (
    "merged_4bit re-quantises the merged weights to NF4, and a LoRA update is mostly smaller than an NF4 step, "
    "so much of what training learnt would be rounded away (Unsloth warns of the same loss, and asks for "
    "'merged_4bit_forced'). Save save_method='merged_16bit' and load that folder with load_in_4bit=True where 4-bit "
    "weights are wanted (the quantisation then happens once, on the merged weights), or save_method='lora' and load "
    "the adapter on the 4-bit base, which is exactly what was trained")


def mark_fast_model(model: nn.Module) -> None:
    """Record that ``model`` (a transformers causal LM, or a PEFT model around one) came through
    :class:`~swiftune.training.loading.FastModel`."""
    causal_lm_of(model).__dict__[_FAST_MODEL_ATTR] = True


class _ModelMethod:
    """``function`` bound to a model through a weak reference. A bound method kept in the model's own
    ``__dict__`` would make a reference cycle, and ``del model`` would then leave the whole model (GPU memory
    included) to the garbage collector instead of freeing it at once. A deep copy binds to the copy; a pickle
    stores the model itself (pickle handles the cycle)."""

    __slots__ = ("_model", "_function", "__weakref__")

    def __init__(self, model: nn.Module, function: Callable[..., Any]) -> None:
        self._model = weakref.ref(model)
        self._function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        if model is None:
            raise ReferenceError(f"{self._function.__name__}: the model it belonged to no longer exists")
        return self._function(model, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _ModelMethod:
        model = self._model()
        return _ModelMethod(memo.get(id(model), model), self._function)

    def __reduce__(self) -> tuple:
        return _ModelMethod, (self._model(), self._function)

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self._function.__doc__

    def __repr__(self) -> str:
        return f"<swiftune {self._function.__name__} of {type(self._model()).__name__}>"


def add_merged_save_methods(model: nn.Module) -> nn.Module:
    """Give ``model`` ``save_pretrained_merged`` and ``push_to_hub_merged`` (instance attributes, as Unsloth
    adds them) and mark it as FastModel's; returns ``model``."""
    mark_fast_model(model)
    # nn.Module.__setattr__ keeps plain callables in the instance __dict__, which wins over PeftModel's
    # __getattr__ forwarding to the base model
    model.save_pretrained_merged = _ModelMethod(model, save_pretrained_merged)
    model.push_to_hub_merged = _ModelMethod(model, push_to_hub_merged)
    return model


# ------------------------------------------------------------------ argument checks


def _resolve_out_dtype(dtype: torch.dtype | str | None, compute: torch.dtype) -> torch.dtype:
    if dtype is None:
        return compute
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.").lower()
        if key not in _OUT_DTYPES:
            raise ConfigError(f"save_pretrained_merged: dtype={dtype!r} is not one of 'bfloat16', 'float16', 'float32'")
        return _OUT_DTYPES[key]
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"save_pretrained_merged: dtype={dtype} is not torch.bfloat16, torch.float16 or "
                          "torch.float32")
    return dtype


def _shard_bytes(max_shard_size: int | str) -> int:
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
        size = max_shard_size
    else:
        match = _SIZE.match(str(max_shard_size))
        if match is None:
            raise ConfigError(f"save_pretrained_merged: max_shard_size={max_shard_size!r} is not a size such as '5GB', "
                              "'500MB' or a number of bytes")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if size <= 0:
        raise ConfigError(f"save_pretrained_merged: max_shard_size={max_shard_size!r} must be positive")
    return size


def _lora_layers(hf_model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in hf_model.modules() if isinstance(m, LoraLayer)]


def _check_model(model: nn.Module, what: str) -> nn.Module:
    """The transformers causal LM under ``model``, after the checks every save method shares."""
    hf_model = causal_lm_of(model)
    if not _lora_layers(hf_model):
        raise ConfigError(
            f"{what}: the model has no LoRA adapters, so there is nothing to merge. Add them with "
            "FastModel.get_peft_model (FastLanguageModel.get_peft_model) and train; a model trained in full (or not "
            "at all) saves as it is with model.save_pretrained(dir) and tokenizer.save_pretrained(dir)")
    if not getattr(hf_model, _FAST_MODEL_ATTR, False):
        raise ConfigError(
            f"{what}: this model was not made by swiftune's FastModel / FastLanguageModel (from_pretrained or "
            "get_peft_model), so swiftune does not know how its layers are stored. Merge a plain PEFT model with PEFT "
            "itself: model.merge_and_unload().save_pretrained(dir)")
    return hf_model


# ------------------------------------------------------------------ what gets written


@dataclass(frozen=True)
class _Entry:
    """One tensor of the merged checkpoint: its name in the transformers model, what it will take on
    disk (shape, dtype) and how to make it (only when its shard is written)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _compute_dtype(hf_model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its input embeddings' (never quantised by swiftune's loading)."""
    embeddings = hf_model.get_input_embeddings() if hasattr(hf_model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    for p in hf_model.parameters():
        if p.is_floating_point() and p.dtype != torch.float8_e4m3fn:
            return p.dtype
    return torch.float32


def _is_4bit_weight(weight: Any) -> bool:
    return getattr(weight, "quant_state", None) is not None and getattr(weight, "dtype", None) == torch.uint8


def _dequantized_weight(base: nn.Module) -> torch.Tensor:
    """``base``'s weight as the layer multiplies by it, in the layer's compute dtype; a fresh tensor for a
    quantised layer, the parameter itself (detached) otherwise."""
    if isinstance(base, FP8Linear):
        return base.dequantize()  # Q * s in float32, rounded once to the compute dtype: what its forward uses
    weight = base.weight
    if _is_4bit_weight(weight):
        import bitsandbytes.functional as bnbf

        # bitsandbytes' own inverse of its quantisation (PEFT's 4-bit merge calls the same); comes back in
        # the quant state's dtype, the layer's compute dtype
        return bnbf.dequantize_4bit(weight.data, weight.quant_state)
    if getattr(weight, "dtype", None) in (torch.int8, torch.uint8):
        raise ConfigError(f"save_pretrained_merged: a {type(base).__name__} with {weight.dtype} weights is not a layer "
                          "swiftune's loading makes (NF4 or FP8); merge it with PEFT on the unquantised base")
    return weight.detach()


def _lora_adapters(layer: nn.Module) -> list[str]:
    """The adapters PEFT's merge would add into ``layer``: active, present in it, not merged already."""
    present = set(layer.lora_A.keys()) | set(layer.lora_embedding_A.keys())
    merged = set(getattr(layer, "merged_adapters", ()))
    return [a for a in layer.active_adapters if a in present and a not in merged]


def _merge(layer: nn.Module, name: str, out_dtype: torch.dtype) -> torch.Tensor:
    base = layer.get_base_layer()
    weight = _dequantized_weight(base)
    adapters = _lora_adapters(layer)
    if not adapters:
        return weight.to(out_dtype)
    merged = weight.clone() if weight.data_ptr() == base.weight.data_ptr() else weight  # never the live tensor
    with torch.no_grad():
        for adapter in adapters:
            delta = layer.get_delta_weight(adapter)
            if delta.shape != merged.shape:
                raise ConfigError(f"save_pretrained_merged: {name}: the adapter's update has shape "
                                  f"{tuple(delta.shape)}, the weight {tuple(merged.shape)}")
            merged += delta  # PEFT's merge: in place, in the base weight's dtype
    return merged.to(out_dtype)


def _merged_bias(layer: nn.Module, out_dtype: torch.dtype) -> torch.Tensor:
    bias = layer.get_base_layer().bias.detach()
    adapters = [a for a in _lora_adapters(layer) if layer.lora_bias.get(a, False)]
    if not adapters:
        return bias.to(out_dtype)
    merged = bias.clone()
    with torch.no_grad():
        for adapter in adapters:  # PEFT: bias += lora_B.bias * scaling
            merged += layer.lora_B[adapter].bias * layer.scaling[adapter]
    return merged.to(out_dtype)


def _merged_parameter(wrapper: nn.Module, param: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A parameter PEFT's ``target_parameters`` adapts (a ``ParamWrapper``: MoE expert stacks), merged as
    PEFT's ``ParamWrapper.merge`` does: ``param += get_delta_weight(adapter)``."""
    merged = param.detach().clone()
    with torch.no_grad():
        for adapter in _lora_adapters(wrapper):
            merged += wrapper.get_delta_weight(adapter)
    return merged.to(out_dtype)


def _check_lora_layer(layer: nn.Module, name: str) -> None:
    variants = [a for a in _lora_adapters(layer) if a in getattr(layer, "lora_variant", {})]
    if variants:
        kind = type(layer.lora_variant[variants[0]]).__name__
        raise ConfigError(
            f"save_pretrained_merged: {name} has adapter {variants[0]!r} of a LoRA variant ({kind}, e.g. DoRA), whose "
            "merge is not a plain weight update; swiftune merges plain LoRA only. Load the base unquantised and use "
            "PEFT's model.merge_and_unload().save_pretrained(dir)")
    if not hasattr(layer, "get_delta_weight") or getattr(layer.get_base_layer(), "weight", None) is None:
        raise ConfigError(f"save_pretrained_merged: {name} is a {type(layer).__name__}, which has no weight update to "
                          "merge; merge this model with PEFT's merge_and_unload")


def _entries(hf_model: nn.Module, out_dtype: torch.dtype, compute: torch.dtype) -> list[_Entry]:
    """Every tensor of the merged checkpoint in the model's order, under transformers' names (PEFT's
    ``base_layer.`` and ``lora_*`` gone, ``modules_to_save`` copies in the original module's place)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    entries: list[_Entry] = []
    seen: set[int] = set()  # tensors already written under another name (tied embeddings)

    def cast(t: torch.Tensor) -> torch.dtype:
        # the compute dtype follows the requested output dtype; other floating dtypes are tensors a model keeps
        # on purpose (transformers' _keep_in_fp32_modules) and stay as they are, as do integer buffers
        return out_dtype if t.is_floating_point() and t.dtype == compute else t.dtype

    def add(name: str, source: torch.Tensor, dtype: torch.dtype, make: Callable[[], torch.Tensor]) -> None:
        if id(source) in seen:
            return
        seen.add(id(source))
        entries.append(_Entry(name, tuple(source.shape), dtype, make))

    def plain(name: str, t: torch.Tensor) -> None:
        dtype = cast(t)
        add(name, t, dtype, lambda: t.detach().to(dtype))  # t, dtype: this call's locals, bound now

    def quantized_linear(prefix: str, module: nn.Module) -> None:
        add(prefix + "weight", module.weight, out_dtype, lambda: _dequantized_weight(module).to(out_dtype))
        if module.bias is not None:
            plain(prefix + "bias", module.bias)

    def walk(module: nn.Module, prefix: str, adapted: dict[str, nn.Module] | None = None) -> None:
        if isinstance(module, ParamWrapper):
            # target_parameters: one wrapper per adapted parameter of the module underneath (nested when several)
            adapted = {}
            while isinstance(module, ParamWrapper):
                if module.parameter_name in adapted or [a for a in _lora_adapters(module)
                                                        if a in getattr(module, "lora_variant", {})]:
                    raise ConfigError(f"save_pretrained_merged: {prefix}{module.parameter_name} is adapted in a way "
                                      "swiftune does not merge; merge this model with PEFT's merge_and_unload")
                adapted[module.parameter_name] = module
                module = module.base_layer
        if isinstance(module, ModulesToSaveWrapper):
            active = [a for a in module.active_adapters if a in module.modules_to_save]
            walk(module.modules_to_save[active[0]] if active else module.original_module, prefix)
            return
        if isinstance(module, AuxiliaryTrainingWrapper) or (isinstance(module, BaseTunerLayer)
                                                            and not isinstance(module, LoraLayer)):
            raise ConfigError(f"save_pretrained_merged: {prefix[:-1]} is a PEFT {type(module).__name__}, which "
                              "swiftune does not merge (LoRA layers and modules_to_save only); merge with PEFT's "
                              "merge_and_unload")
        if isinstance(module, LoraLayer):
            name = prefix[:-1]
            _check_lora_layer(module, name)
            base = module.get_base_layer()
            add(prefix + "weight", base.weight, out_dtype, lambda: _merge(module, name, out_dtype))
            if base.bias is not None:
                add(prefix + "bias", base.bias, cast(base.bias), lambda: _merged_bias(module, cast(base.bias)))
            return
        if isinstance(module, FP8Linear) or _is_4bit_weight(getattr(module, "weight", None)):
            quantized_linear(prefix, module)  # a quantised layer without adapters
            return
        for n, p in module.named_parameters(recurse=False):
            if adapted and n in adapted:
                dtype, wrapper = cast(p), adapted[n]
                add(prefix + n, p, dtype, lambda p=p, w=wrapper, d=dtype: _merged_parameter(w, p, d))
            else:
                plain(prefix + n, p)
        for n, b in module.named_buffers(recurse=False):
            if b is not None and n not in module._non_persistent_buffers_set:
                plain(prefix + n, b)
        for n, child in module.named_children():
            walk(child, f"{prefix}{n}.")

    walk(hf_model, "")
    # names transformers ties at load (lm_head.weight -> embed_tokens.weight): written once, under the source
    tied = getattr(hf_model, "all_tied_weights_keys", None) or {}
    written = {e.name for e in entries}
    return [e for e in entries if not (e.name in tied and tied[e.name] in written)]


def _group_key(name: str) -> str:
    """Tensors that must share a shard: those of one numbered block (``model.layers.3``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _plan_shards(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    groups: dict[str, list[_Entry]] = {}
    for e in entries:
        groups.setdefault(_group_key(e.name), []).append(e)
    shards: list[list[_Entry]] = [[]]
    size = 0
    for group in groups.values():
        nbytes = sum(e.nbytes for e in group)
        if shards[-1] and size + nbytes > limit:  # a group larger than the limit gets a shard of its own
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += nbytes
    return shards


def _revert_conversions(hf_model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' own reverse of the weight conversions it applied at load (fused MoE experts back to the
    checkpoint's layout), as its save_pretrained does; older transformers have none."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return revert_weight_conversion(hf_model, tensors)


def _clear_old_weights(directory: str) -> None:
    """Remove a previous save's weight files, which the new ones might not all replace (a stale
    ``model.safetensors`` beside a new index would be loaded instead of it)."""
    for name in os.listdir(directory):
        if name in (_WEIGHTS_NAME, _INDEX_NAME) or _SHARD_NAME.fullmatch(name):
            os.remove(os.path.join(directory, name))


def _write_merged(hf_model: nn.Module, directory: str, out_dtype: torch.dtype, shard_limit: int) -> list[str]:
    """Write the weights and the config; return the weight files written."""
    from safetensors.torch import save_file

    entries = _entries(hf_model, out_dtype, _compute_dtype(hf_model))
    shards = _plan_shards(entries, shard_limit)
    _clear_old_weights(directory)
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        filename = _WEIGHTS_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for e in shard:
            t = e.make().to("cpu").contiguous()
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ConfigError(f"save_pretrained_merged: {e.name} is not finite in {t.dtype} after the merge"
                                  + (" (float16 overflows past 65504: save in bfloat16)" if t.dtype == torch.float16
                                     else ": the adapter or the base weights hold NaN or inf"))
            tensors[e.name] = t
        tensors = _revert_conversions(hf_model, tensors)
        save_file(tensors, os.path.join(directory, filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        files.append(filename)
        del tensors  # this shard's merged tensors go before the next shard's are made
    if len(shards) > 1:
        with open(os.path.join(directory, _INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
            f.write("\n")
    _write_config(hf_model, directory, out_dtype)
    return files


def _write_config(hf_model: nn.Module, directory: str, out_dtype: torch.dtype) -> None:
    import copy

    config = copy.deepcopy(hf_model.config)  # the training model's config stays as it is
    # the weights are no longer quantised: a quantization_config would make transformers expect NF4 tensors
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = str(out_dtype).removeprefix("torch.")
    config.architectures = [type(hf_model).__name__]
    config.save_pretrained(directory)
    generation_config = getattr(hf_model, "generation_config", None)
    can_generate = getattr(hf_model, "can_generate", lambda: False)
    if generation_config is not None and can_generate():
        generation_config.save_pretrained(directory)


# ------------------------------------------------------------------ the entry points


def _warn_ignored(names: list[str]) -> None:
    if names:
        warnings.warn(f"swiftune: save_pretrained_merged ignores {', '.join(names)} (Unsloth's settings for its own "
                      "saving: swiftune merges one shard at a time and writes safetensors)", stacklevel=3)


def save_pretrained_merged(
    model: nn.Module,
    save_directory: str | os.PathLike,
    tokenizer: Any = None,
    save_method: str = "merged_16bit",
    push_to_hub: bool = False,
    token: str | bool | None = None,
    is_main_process: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
    save_function: Callable | None = None,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    variant: str | None = None,
    save_peft_format: bool = True,
    tags: list[str] | None = None,
    temporary_location: str | None = None,
    maximum_memory_usage: float | None = None,
    *,
    dtype: torch.dtype | str | None = None,
) -> None:
    """Save ``model`` (a FastModel LoRA model) as Unsloth's ``model.save_pretrained_merged`` does.

    Args:
        save_directory: the folder to write (made if missing).
        tokenizer: saved into the folder too when given (a tokenizer or processor).
        save_method: ``"merged_16bit"``: a plain transformers checkpoint of the base with the active adapters
            merged, loadable without swiftune or PEFT; ``"lora"``: the adapter folder (PEFT's
            ``save_pretrained``). ``"merged_4bit"`` / ``"merged_4bit_forced"`` are refused (see the message).
        dtype: the merged checkpoint's dtype (``torch.bfloat16``, ``torch.float16``, ``torch.float32`` or their
            names); default the model's compute dtype (bf16 where it trains in bf16; a float32 model is written
            in float32, since nothing asked for rounding).
        max_shard_size: the largest safetensors file (``"5GB"``, ``"500MB"`` or bytes); a decoder layer is never
            split across two files. It also bounds the memory the merge takes beyond the model.
        is_main_process: ``False`` writes nothing (the other ranks of a distributed run).
        push_to_hub: refused here: :func:`push_to_hub_merged` uploads.
        token: for the Hub only; unused when saving.
        state_dict, variant: refused when given (the merged tensors come from the model; one file name scheme).
        save_function, safe_serialization, save_peft_format, tags, temporary_location, maximum_memory_usage:
            Unsloth's settings of its own saver; ignored with a warning when given (safetensors is always
            written, one shard at a time, in memory).

    The in-memory model is not changed: training can go on after saving.
    """
    if save_method not in SAVE_METHODS:
        raise ConfigError(f"save_pretrained_merged: save_method={save_method!r} is not one of 'merged_16bit' (a plain "
                          "transformers checkpoint with the adapters merged) or 'lora' (the adapter folder)")
    if save_method in ("merged_4bit", "merged_4bit_forced"):
        raise ConfigError(f"save_pretrained_merged: save_method={save_method!r} is not supported: "
                          f"{_QUANTIZED_4BIT_ADVICE}")
    if push_to_hub:
        raise ConfigError("save_pretrained_merged: push_to_hub=True is not taken here; upload with "
                          "model.push_to_hub_merged(repo_id, tokenizer, save_method=...)")
    if state_dict is not None:
        raise ConfigError("save_pretrained_merged: state_dict= is not supported; the merged weights are computed from "
                          "the model itself")
    if variant is not None:
        raise ConfigError(f"save_pretrained_merged: variant={variant!r} is not supported; the weights are written as "
                          "model.safetensors (or model-0000i-of-0000n.safetensors)")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise ConfigError(f"save_pretrained_merged: tokenizer is a {type(tokenizer).__name__}, which has no "
                          "save_pretrained; pass the tokenizer (or processor) FastModel.from_pretrained returned")
    _warn_ignored([name for name, given in (("save_function", save_function is not None),
                                            ("safe_serialization", safe_serialization is not True),
                                            ("save_peft_format", save_peft_format is not True),
                                            ("tags", tags is not None),
                                            ("temporary_location", temporary_location is not None),
                                            ("maximum_memory_usage", maximum_memory_usage is not None)) if given])
    hf_model = _check_model(model, "save_pretrained_merged")
    shard_limit = _shard_bytes(max_shard_size)
    out_dtype = _resolve_out_dtype(dtype, _compute_dtype(hf_model))
    directory = os.fspath(save_directory)
    if save_method == "lora":
        from peft import PeftModel

        if not isinstance(model, PeftModel):
            raise ConfigError("save_pretrained_merged(save_method='lora'): call it on the PEFT model that "
                              "FastModel.get_peft_model returned (model.save_pretrained_merged(...)), which holds the "
                              "adapter's config")
        if dtype is not None:
            warnings.warn("swiftune: save_method='lora' writes the adapters in their own dtype; dtype= is ignored",
                          stacklevel=2)
    if not is_main_process:
        return
    if os.path.isfile(directory):
        raise ConfigError(f"save_pretrained_merged: {directory} is a file; give a folder")
    os.makedirs(directory, exist_ok=True)
    if save_method == "lora":
        model.save_pretrained(directory)  # PEFT's adapter folder
    else:
        if os.path.isfile(os.path.join(directory, "adapter_config.json")):
            raise ConfigError(f"save_pretrained_merged: {directory} holds a LoRA adapter (adapter_config.json); a "
                              "merged model written beside it would be read as that adapter on its base. Save into "
                              "another folder")
        _write_merged(hf_model, directory, out_dtype, shard_limit)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def push_to_hub_merged(
    model: nn.Module,
    repo_id: str,
    tokenizer: Any = None,
    save_method: str = "merged_16bit",
    use_temp_dir: bool | None = None,
    commit_message: str | None = "Trained with swiftune",
    private: bool | None = None,
    token: str | bool | None = None,
    max_shard_size: int | str = "5GB",
    create_pr: bool = False,
    safe_serialization: bool = True,
    revision: str | None = None,
    commit_description: str | None = None,
    tags: list[str] | None = None,
    temporary_location: str | None = None,
    maximum_memory_usage: float | None = None,
    *,
    dtype: torch.dtype | str | None = None,
) -> str:
    """Unsloth's ``model.push_to_hub_merged``: :func:`save_pretrained_merged` into a temporary folder, then
    ``huggingface_hub``'s ``create_repo`` (``exist_ok``) and ``upload_folder`` of that folder to ``repo_id``.
    Returns the commit URL ``upload_folder`` gives. Needs the network and a write token (``token`` or a
    ``hf auth login``); ``use_temp_dir`` is ignored (a temporary folder is always used)."""
    from huggingface_hub import HfApi

    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ConfigError(f"push_to_hub_merged: repo_id={repo_id!r} must be a Hub repository name, e.g. 'you/model'")
    _warn_ignored(["use_temp_dir"] if use_temp_dir is not None else [])
    with tempfile.TemporaryDirectory(prefix="swiftune-merged-") as folder:
        save_pretrained_merged(model, folder, tokenizer, save_method, max_shard_size=max_shard_size,
                               safe_serialization=safe_serialization, tags=tags, temporary_location=temporary_location,
                               maximum_memory_usage=maximum_memory_usage, dtype=dtype)
        api = HfApi(token=token)
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=getattr(repo, "repo_id", repo_id), folder_path=folder, repo_type="model",
                                   commit_message=commit_message, commit_description=commit_description,
                                   revision=revision, create_pr=create_pr)
    return str(commit)

