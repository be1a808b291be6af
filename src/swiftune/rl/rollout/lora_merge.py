"""Merging LoRA adapters into the base weights for the duration of a fast-rollout call.

A decode step at a few rows is bound by kernel launches, and PEFT's layers add a low-rank
matmul pair to every adapted projection; merged, the step runs the plain weights. Merging
must not change training: ``(W + dW) - dW`` is not ``W`` in floating point, so the base
weights are saved before the merge and copied back, bit for bit, after the unmerge.
"""

from __future__ import annotations

import torch
from torch import nn

from ...losses import free_gpu_bytes


def _quantised(weight: torch.Tensor) -> bool:
    """Packed (bitsandbytes' uint8) or 1-byte float (e4m3 / e5m2) weights: e4m3 counts as floating
    point to torch, but adding a LoRA delta to it is not representable."""
    return not weight.is_floating_point() or weight.element_size() == 1


def _adapted_weight(layer: nn.Module) -> torch.Tensor:
    """The base tensor a PEFT LoRA layer adapts: ``base_layer.weight``, or for PEFT's
    ``target_parameters`` wrappers (``ParamWrapper``: fused 3-D expert weights) the parameter it wraps."""
    get_param = getattr(layer, "get_param", None)
    return get_param() if callable(get_param) else layer.get_base_layer().weight


def merge_lora(model: nn.Module, mode: str) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Merge ``model``'s active adapters (``mode`` ``"merge"``, or ``"auto"`` when the saved copy
    fits a quarter of free CUDA memory); returns the (weight, saved copy) pairs for
    :func:`unmerge_lora`, or ``None`` when nothing was merged (``"runtime"``, no adapters,
    adapters disabled, as for the reference policy, or already merged)."""
    if mode == "runtime" or not hasattr(model, "merge_adapter"):
        return None
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
    if not layers or any(getattr(m, "disable_adapters", False) or getattr(m, "merged", False) for m in layers):
        return None
    if any(_quantised(_adapted_weight(m)) for m in layers):
        # 4-bit / FP8 base weights: a merge re-quantises them (adapters are far below their step size),
        # which no saved copy undoes
        if mode == "merge":
            raise ValueError("lora='merge' cannot merge adapters into quantised (4-bit or FP8) base weights "
                             "exactly: use lora='runtime' (or 'auto', which does)")
        return None
    if mode == "auto":
        weight = _adapted_weight(layers[0])
        if weight.device.type != "cuda":
            return None
        copy_bytes = sum(_adapted_weight(m).numel() for m in layers) * weight.element_size()
        if copy_bytes > free_gpu_bytes(weight.device) // 4:
            return None
    saved = [(w, w.detach().clone()) for w in map(_adapted_weight, layers)]
    model.merge_adapter()
    return saved


def unmerge_lora(model: nn.Module, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Undo :func:`merge_lora`: unmerge, then restore the saved base weights exactly."""
    model.unmerge_adapter()
    with torch.no_grad():
        for weight, copy in saved:
            weight.data.copy_(copy)
