"""LoRA inputs left in the activation dtype while training under autocast.

PEFT keeps LoRA adapters in float32 (``autocast_adapter_dtype=True``) and casts every input of a
LoRA layer to the adapters' dtype before the adapter matmuls. Under bf16/fp16 autocast those
matmuls run in the half dtype anyway: autocast casts the float32 copy straight back. So every LoRA
call of every pass (forward, checkpoint recompute, tiled-MLP recompute) writes and reads two full
copies of its input for nothing, and holds a float32 ``[tokens, intermediate]`` transient at
``down_proj``. A bf16 -> fp32 -> bf16 round trip is exact, so skipping it changes no number.

:func:`lora_input_casting` switches PEFT's own per-layer flag (``cast_input_dtype_enabled``, what
``peft.helpers.disable_input_dtype_casting`` sets) for a ``with`` block; the trainers wrap each
training step in it when :func:`can_skip_lora_input_casts` says autocast covers the step (decided
from the arguments and the PEFT config, without walking the model). GRPO's generation runs inside a
training step without autocast, so it switches casting back on around it.

Which modules are LoRA layers is found by one walk over the module tree (thousands of modules for
an 8B model with LoRA on every linear layer); the trainers keep the answer in a
:class:`LoraLayerIndex` across steps, walked again only when the model or its set of adapters
changes (:class:`~swiftune.training.model_walks.ModelKey`), so a step does not walk the tree;
:func:`lora_inputs_cast`, asked by offloaded checkpointing at every forward, keeps its layer in the
caller's :class:`~swiftune.training.model_walks.ModelWalkIndex` the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from .model_walks import ModelKey, ModelWalkIndex, peft_adapter_names

LORA_CAST_FLAG = "cast_input_dtype_enabled"  # peft.tuners.tuners_utils.BaseTunerLayer's attribute


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, LORA_CAST_FLAG) and hasattr(module, "lora_A")


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _is_lora_layer(m)]


def first_lora_layer(model: nn.Module) -> nn.Module | None:
    """The first PEFT LoRA layer of ``model`` in ``modules()`` order, ``None`` without one (a walk
    that stops there)."""
    return next((m for m in model.modules() if _is_lora_layer(m)), None)


class LoraLayerIndex:
    """The PEFT LoRA layers of one model, found once and reused while the model and its adapters
    stay the same.

    The list is walked again when a different model object is asked for or when the model's set of
    adapter names changes (PEFT's ``add_adapter`` / ``load_adapter`` / ``delete_adapter``, the ways
    LoRA layers are added or dropped on a PEFT model). Modules swapped in by hand without PEFT's
    adapter API are not seen: call :meth:`clear` after such surgery.
    """

    def __init__(self) -> None:
        self._key = ModelKey()
        self._layers: list[nn.Module] = []

    def layers(self, model: nn.Module) -> list[nn.Module]:
        if self._key.changed(model):
            self._layers = _lora_layers(model)
        return self._layers

    def clear(self) -> None:
        self._key.clear()
        self._layers = []


def lora_inputs_cast(model: nn.Module, walks: ModelWalkIndex | None = None) -> bool:
    """Whether ``model``'s PEFT LoRA layers copy their inputs to the adapter dtype right now
    (PEFT's default; False inside :func:`lora_input_casting` ``(enabled=False)``). True without
    LoRA layers. Reads the first layer only: the flag is switched for all of them together.
    ``walks``: where that layer is kept (its flag is read at every call); ``None``: the model is walked."""
    layer = walks.answer(model, first_lora_layer) if walks is not None else first_lora_layer(model)
    return layer is None or bool(getattr(layer, LORA_CAST_FLAG))


@contextlib.contextmanager
def lora_input_casting(model: nn.Module, enabled: bool, index: LoraLayerIndex | None = None) -> Iterator[None]:
    """Within the block, PEFT LoRA layers of ``model`` cast their inputs to the adapter dtype
    (``enabled=True``, PEFT's default) or leave them as they come (``False``); restored after.
    ``index``: where the layers are looked up (kept across calls); ``None``: the model is walked."""
    layers = index.layers(model) if index is not None else _lora_layers(model)
    before = [getattr(m, LORA_CAST_FLAG) for m in layers]
    for m in layers:
        setattr(m, LORA_CAST_FLAG, enabled)
    try:
        yield
    finally:
        for m, value in zip(layers, before):
            setattr(m, LORA_CAST_FLAG, value)


def can_skip_lora_input_casts(model: nn.Module, args: Any) -> bool:
    """Whether a training step under these ``TrainingArguments`` runs under half-precision autocast
    (``bf16`` or ``fp16``) and ``model`` has PEFT LoRA layers without DoRA (whose magnitude step
    computes in the adapter dtype outside autocast's matmuls)."""
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return False
    configs = getattr(model, "peft_config", None) or getattr(getattr(model, "module", None), "peft_config", None) or {}
    return bool(configs) and all(getattr(c, "peft_type", None) == "LORA" and not getattr(c, "use_dora", False)
                                 for c in configs.values())


def training_step_lora_casting(model: nn.Module, args: Any,
                               index: LoraLayerIndex | None = None) -> contextlib.AbstractContextManager:
    """What the trainers wrap each ``training_step`` in: casting switched off when
    :func:`can_skip_lora_input_casts` allows it (forward and every recompute of the backward; the
    same numbers), else nothing. ``index``: the trainer's :class:`LoraLayerIndex`, so that a step
    does not walk the module tree."""
    if can_skip_lora_input_casts(model, args):
        return lora_input_casting(model, enabled=False, index=index)
    return contextlib.nullcontext()


__all__ = ["LORA_CAST_FLAG", "LoraLayerIndex", "can_skip_lora_input_casts", "first_lora_layer", "lora_input_casting",
           "lora_inputs_cast", "peft_adapter_names", "training_step_lora_casting"]
