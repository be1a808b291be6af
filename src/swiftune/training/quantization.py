"""4-bit (QLoRA) base weights: the loading options as Unsloth and transformers name them, checked.

``FastModel.from_pretrained(path, load_in_4bit=True)`` (Unsloth's name) and
``quantization_config=BitsAndBytesConfig(...)`` (transformers' name) both load the decoder's linear
weights as bitsandbytes NF4 with double quantisation and a bf16 (or the load dtype's) compute
dtype, the way PEFT users run QLoRA; embeddings, norms and the LM head stay in the load dtype.
LoRA adapters then train on top (PEFT wraps ``bnb.nn.Linear4bit`` in its own ``lora.Linear4bit``).

What cannot run is refused here, before any weight is read: 4-bit together with 8-bit, 8-bit alone
(swiftune trains on 4-bit bases only), a quantisation config that is not bitsandbytes', bitsandbytes
not installed, or a bitsandbytes without a native library for the GPU the model would load on.
Full fine-tuning of a 4-bit model is refused where it would start (``FastModel.for_training``, the
trainers): NF4 weights cannot take gradient steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["QLORA_INSTALL", "is_quantized_4bit", "nf4_config", "refuse_full_finetuning_of_4bit", "resolve_quantization"]

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


def is_quantized_4bit(model: nn.Module) -> bool:
    """Whether ``model`` (a PEFT model or a transformers model) holds bitsandbytes 4-bit weights."""
    for p in model.parameters():
        if type(p).__name__ == "Params4bit":
            return True
    return False


def refuse_full_finetuning_of_4bit(model: nn.Module, where: str) -> None:
    """A :class:`ConfigError` when ``model`` is 4-bit and nothing but its frozen weights would train."""
    if is_quantized_4bit(model):
        raise ConfigError(
            f"{where}: full fine-tuning of a 4-bit model is not possible (NF4 weights take no gradient steps): add "
            "LoRA adapters (FastModel.get_peft_model, or --use_lora true in the command), or load the model without "
            "load_in_4bit to train every weight")
