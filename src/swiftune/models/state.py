"""What :func:`swiftune.patch_model` recorded on the transformers modules it changed.

Each module whose forward swiftune binds carries one :class:`PatchState` under
:data:`PATCH_STATE_ATTR`; the causal LM itself carries one :class:`ModelPatch` under
:data:`MODEL_PATCH_ATTR`. Readers outside this package go through :func:`patch_state` and
:func:`model_patch` rather than reading attributes, so the record can change shape in one place.
The records are plain attributes of the instance: not parameters or buffers, never saved in a
checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

PATCH_STATE_ATTR = "swiftune_patch_state"
MODEL_PATCH_ATTR = "swiftune_model_patch"


@dataclass(frozen=True)
class AttentionSpec:
    """What a family's attention forward passes to the attention function besides q, k, v.

    Attributes:
        window: the layer's sliding window (``None`` = full attention), read from the module.
        softcap: whether the family passes ``attn_logit_softcapping``.
        eager: the modeling file's own ``eager_attention_forward``, used when the configured
            implementation is ``"eager"`` (transformers' registry has no entry for it).
    """

    window: Callable[[nn.Module], int | None]
    softcap: bool
    eager: Callable


@dataclass(frozen=True)
class GatedActivation:
    """The fused kernel a gated MLP runs: ``"swiglu"``, or ``"geglu"`` with its GELU approximation."""

    kernel: str
    approximate: str | None = None

    @property
    def glu(self) -> str:
        """The name :func:`swiftune.kernels.gated_linear_unit` / ``glu_fp8`` take: ``"silu"``, ``"none"``, ``"tanh"``."""
        return "silu" if self.kernel == "swiglu" else self.approximate or "none"


@dataclass(frozen=True)
class PatchState:
    """One module patched by :func:`swiftune.patch_model`.

    Attributes:
        kernel_backend: ``"auto"``, ``"triton"`` or ``"reference"`` for the fused kernels.
        bound: whether swiftune's forward is bound on the instance now (``unpatch_model`` clears it;
            what the record says about the family's attention stays true either way).
        attention: set on attention modules.
        activation: set on gated MLPs.
        norm_offset: set on RMSNorms (1.0 for Gemma's ``(1 + w)``).
    """

    kernel_backend: str = "auto"
    bound: bool = True
    attention: AttentionSpec | None = None
    activation: GatedActivation | None = None
    norm_offset: float | None = None


@dataclass(frozen=True)
class ModelPatch:
    """The arguments :func:`swiftune.patch_model` was last called with on a causal LM."""

    kernels: bool
    attention: str | None
    kernel_backend: str


def patch_state(module: nn.Module) -> PatchState | None:
    """The :class:`PatchState` of ``module``, or ``None`` when swiftune never patched it."""
    state = module.__dict__.get(PATCH_STATE_ATTR)
    return state if isinstance(state, PatchState) else None


def set_patch_state(module: nn.Module, state: PatchState | None) -> None:
    """Record ``state`` on ``module`` (``None`` removes the record)."""
    if state is None:
        module.__dict__.pop(PATCH_STATE_ATTR, None)
    else:
        module.__dict__[PATCH_STATE_ATTR] = state


def is_bound(module: nn.Module) -> bool:
    """Whether swiftune's forward is bound on ``module`` now."""
    state = patch_state(module)
    return state is not None and state.bound


def mark_unbound(module: nn.Module) -> None:
    """Record that ``module`` runs its class's forward again (the rest of the record is kept)."""
    state = patch_state(module)
    if state is not None:
        set_patch_state(module, dataclasses.replace(state, bound=False))


def model_patch(model: nn.Module) -> ModelPatch | None:
    """The :class:`ModelPatch` of a causal LM (not unwrapped: pass ``causal_lm_of(model)``)."""
    record = model.__dict__.get(MODEL_PATCH_ATTR)
    return record if isinstance(record, ModelPatch) else None


def set_model_patch(model: nn.Module, record: ModelPatch) -> None:
    model.__dict__[MODEL_PATCH_ATTR] = record
