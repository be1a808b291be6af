"""4-bit (QLoRA) base weights: the loading options as Unsloth and transformers name them, checked.

``FastModel.from_pretrained(path, load_in_4bit=True)`` (Unsloth's name) and
``quantization_config=BitsAndBytesConfig(...)`` (transformers' name) both load the decoder's linear
weights as bitsandbytes NF4 with double quantisation and a bf16 (or the load dtype's) compute
dtype, the way PEFT users run QLoRA; embeddings, norms and the LM head stay in the load dtype. On a
vision-language model (Qwen3-VL) only the text decoder's projections are quantised: the vision tower
and its mergers go to bitsandbytes' skip list (:func:`skip_modules_in_4bit`), and with FP8 to
:func:`~swiftune.models.fp8_linear.quantize_model_fp8`'s ``skip``.
LoRA adapters then train on top (PEFT wraps ``bnb.nn.Linear4bit`` in its own ``lora.Linear4bit``).

What cannot run is refused here, before any weight is read: 4-bit together with 8-bit, 8-bit alone
(swiftune trains on 4-bit bases only), a quantisation config that is not bitsandbytes', bitsandbytes
not installed, or a bitsandbytes without a native library for the GPU the model would load on.
Full fine-tuning of a 4-bit model is refused where it would start (``FastModel.for_training``, the
trainers): NF4 weights cannot take gradient steps.

FP8 base weights (``load_in_fp8=True``, Unsloth's name; docs/fp8.md): the decoder's linear weights in
``float8_e4m3fn`` with per-row scales (:mod:`swiftune.models.fp8_linear`), quantised by swiftune after
transformers loads the model, so no quantisation config reaches transformers. Refused before any file
is read: together with 4-bit, 8-bit or a ``quantization_config``. On a CUDA GPU without FP8 tensor
cores (compute capability < 8.9) a warning says the dequantising reference runs (the weights still
take 1 byte each). Checkpoints already in transformers' fine-grained FP8 format (block scales) load
dequantised by transformers, then, with ``load_in_fp8=True``, re-quantised per row. Full fine-tuning
of an FP8 model is refused like that of a 4-bit one.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["QLORA_INSTALL", "check_fp8_request", "fp8_checkpoint_kwargs", "is_quantized_4bit", "is_quantized_fp8",
           "nf4_config", "refuse_full_finetuning_of_4bit", "keep_4bit_layout_on_cpu",
           "resolve_quantization", "skip_modules_in_4bit"]

QLORA_INSTALL = "pip install 'swiftune[qlora]'"


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as e:
        raise ConfigError(f"load_in_4bit=True needs bitsandbytes, which is not installed ({e}): {QLORA_INSTALL}") from e
    return bitsandbytes


def _check_gpu_support(bnb: Any) -> None:
    """A CUDA machine whose bitsandbytes has no CUDA library would fail at the first matmul."""
    if not torch.cuda.is_available():
        return
    try:
        from bitsandbytes import cextension
    except ImportError:  # an unusual build: let bitsandbytes speak for itself at load
        return
    native = getattr(cextension, "CudaBNBNativeLibrary", None)
    if native is not None and not isinstance(getattr(cextension, "lib", None), native):
        major, minor = torch.cuda.get_device_capability()
        raise ConfigError(
            f"load_in_4bit=True: bitsandbytes {getattr(bnb, '__version__', '?')} has no CUDA library for this GPU "
            f"({torch.cuda.get_device_name()}, compute capability {major}.{minor}, torch CUDA {torch.version.cuda}); "
            "install a bitsandbytes build for this CUDA version, or load without load_in_4bit")


def nf4_config(compute_dtype: torch.dtype) -> Any:
    """The QLoRA recipe: NF4 weights, double quantisation, ``compute_dtype`` matmuls."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def resolve_quantization(load_in_4bit: bool, load_in_8bit: bool, quantization_config: Any,
                         compute_dtype: torch.dtype) -> Any:
    """The ``quantization_config`` to load with (``None``: unquantised), or a :class:`ConfigError`
    that says what to change. Checks bitsandbytes (installed, usable on this machine's GPU)."""
    if load_in_4bit and load_in_8bit:
        raise ConfigError("load_in_4bit and load_in_8bit are exclusive: pick load_in_4bit=True (QLoRA)")
    if load_in_8bit or getattr(quantization_config, "load_in_8bit", False):
        raise ConfigError("8-bit base weights are not supported: load with load_in_4bit=True (QLoRA, NF4) or "
                          "unquantised")
    if quantization_config is not None:
        if isinstance(quantization_config, dict):
            from transformers import BitsAndBytesConfig

            quantization_config = BitsAndBytesConfig(**quantization_config)
        if type(quantization_config).__name__ != "BitsAndBytesConfig":
            raise ConfigError(f"quantization_config must be a transformers BitsAndBytesConfig (4-bit), got "
                              f"{type(quantization_config).__name__}")
        if not getattr(quantization_config, "load_in_4bit", False):
            raise ConfigError("quantization_config must set load_in_4bit=True (swiftune trains on 4-bit bases)")
    elif not load_in_4bit:
        return None
    bnb = _bitsandbytes()
    _check_gpu_support(bnb)
    return quantization_config if quantization_config is not None else nf4_config(compute_dtype)


def skip_modules_in_4bit(quantization_config: Any, modules: tuple[str, ...]) -> Any:
    """A copy of the 4-bit ``quantization_config`` whose ``llm_int8_skip_modules`` (which transformers
    honours for 4-bit as well: module-name prefixes, regexes or suffixes left unquantised) also holds
    ``modules``. Giving the list replaces transformers' own default skips (the output head), so
    ``modules`` must name the head too; a list the caller set is kept and added to."""
    import copy

    config = copy.deepcopy(quantization_config)
    given = list(getattr(config, "llm_int8_skip_modules", None) or [])
    config.llm_int8_skip_modules = given + [m for m in modules if m not in given]
    return config


def keep_4bit_layout_on_cpu(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking ``model``'s NF4 weights for its CPU bf16 kernel; returns how
    many layers it set.

    On a CPU with AVX512-BF16, bitsandbytes' ``Linear4bit`` repacks its weight, in place and for good,
    the first time it runs in eval mode without gradients (an evaluation, a GRPO rollout): from then
    on every forward, training included, multiplies in bf16 through that kernel, whatever compute
    dtype was asked for (a float32 run drifts by ~3e-3), and swiftune's fused LoRA node has to fall
    back to PEFT's. Clearing the layer's ``support_avx512bf16_for_cpu`` flag keeps the layout it was
    quantised in (the ``compute_dtype`` matmuls). GPUs never repack: nothing changes there."""
    count = 0
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def is_quantized_4bit(model: nn.Module) -> bool:
    """Whether ``model`` (a PEFT model or a transformers model) holds bitsandbytes 4-bit weights."""
    for p in model.parameters():
        if type(p).__name__ == "Params4bit":
            return True
    return False


def is_quantized_fp8(model: nn.Module) -> bool:
    """Whether ``model`` (a PEFT model or a transformers model) holds FP8 (e4m3 / e5m2) weights."""
    fp8 = {torch.float8_e4m3fn, torch.float8_e5m2}
    return any(p.dtype in fp8 for p in model.parameters())


def check_fp8_request(load_in_fp8: bool, load_in_4bit: bool, load_in_8bit: bool, quantization_config: Any) -> None:
    """With ``load_in_fp8``: a :class:`ConfigError` for another quantisation asked at the same time,
    and a warning when this machine's GPU has no FP8 tensor cores. Reads no file."""
    if not load_in_fp8:
        return
    others = [name for name, on in (("load_in_4bit", load_in_4bit), ("load_in_8bit", load_in_8bit),
                                    ("quantization_config", quantization_config is not None)) if on]
    if others:
        raise ConfigError(f"load_in_fp8=True and {' and '.join(others)} are exclusive: pick load_in_fp8=True (FP8 "
                          "frozen weights, per-row scales) or load_in_4bit=True (QLoRA, NF4)")
    if torch.cuda.is_available():
        from ..models.fp8_linear import fp8_matmul_supported

        if not fp8_matmul_supported():
            major, minor = torch.cuda.get_device_capability()
            warnings.warn(
                f"swiftune: load_in_fp8=True on {torch.cuda.get_device_name()} (compute capability {major}.{minor}), "
                "which has no FP8 tensor cores (they need >= 8.9: Ada, Hopper): the weights take 1 byte each, but "
                "every matmul dequantises them first (the reference path), slower than bf16", stacklevel=3)


def fp8_checkpoint_kwargs(config: Any) -> dict[str, Any]:
    """``from_pretrained`` keywords for a checkpoint already in transformers' fine-grained FP8 format
    (``quantization_config`` with ``quant_method`` ``"fp8"``, block scales): load it dequantised, so
    that swiftune's layers (or, with ``load_in_fp8``, its per-row FP8 layers) replace transformers'
    FP8 ones, whose e4m3 weight PEFT would give e4m3 adapters. ``{}`` for any other checkpoint."""
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(getattr(method, "value", method)) != "fp8":
        return {}
    from transformers import FineGrainedFP8Config

    settings = dict(quant) if isinstance(quant, dict) else quant.to_dict()
    settings.pop("quant_method", None)
    settings["dequantize"] = True
    try:
        return {"quantization_config": FineGrainedFP8Config(**settings)}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"this checkpoint's FP8 quantization_config ({quant}) is not one transformers "
                          f"{_transformers_version()} can dequantise ({e}): swiftune loads FP8 checkpoints in "
                          "transformers' fine-grained format (weight_block_size, float32 scales), or any "
                          "unquantised checkpoint with load_in_fp8=True") from e


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def refuse_full_finetuning_of_4bit(model: nn.Module, where: str) -> None:
    """A :class:`ConfigError` when ``model`` is 4-bit or FP8 and nothing but its frozen weights would
    train."""
    if is_quantized_fp8(model):
        raise ConfigError(
            f"{where}: full fine-tuning of an FP8 model is not possible (its e4m3 base weights are frozen): add LoRA "
            "adapters (FastModel.get_peft_model, or --use_lora true in the command), or load the model without "
            "load_in_fp8 to train every weight")
    if is_quantized_4bit(model):
        raise ConfigError(
            f"{where}: full fine-tuning of a 4-bit model is not possible (NF4 weights take no gradient steps): add "
            "LoRA adapters (FastModel.get_peft_model, or --use_lora true in the command), or load the model without "
            "load_in_4bit to train every weight")
