"""Routed experts as grouped matrix multiplies (Qwen3-MoE, gpt-oss, Mixtral), bound on the experts module.

transformers' experts forward loops over the experts, gathering each one's tokens, running two
matmuls and scattering back: ``E`` small launches per projection. Here the ``T * k`` (token, expert)
assignments are sorted by expert once, so each expert's tokens are one contiguous block of ``x_s``
(``offsets`` = running sums of the per-expert counts), and each projection is one grouped GEMM:

    y_s[o_{e-1}:o_e] = x_s[o_{e-1}:o_e] @ B_e        for every expert e        (B_e = W_e^T or W_e)

Forward: gather ``x_s = x[token_of]`` -> gate/up GEMM (+ bias) -> activation -> down GEMM (+ bias) ->
scale by the routing weight -> ``index_add`` into the token rows. Backward is autograd's through
the same ops: the GEMM's gradients are grouped GEMMs too (``dX_s = dY_s B_e^T``, ``dB_e = X_s^T dY_s``
per block), the gather's is a scatter-add, the routing weights get ``<y, dOut>`` per assignment.

Two ways for the GEMM, the same math: ``torch.nn.functional.grouped_mm`` (one kernel; bf16, CUDA
with SM >= 80, and on CPU where torch has it) and a plain loop over the experts' blocks (the
reference, fp32, and every case the grouped kernel does not take). The weights are read through the
module's attributes, so PEFT's ``target_parameters`` adapters (which parametrise them) apply.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import swiglu
from .families import ExpertsSpec
from .state import patch_state

__all__ = ["expert_blocks", "grouped_experts_forward", "grouped_linear", "grouped_mm_supported"]


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes this projection: bf16 operands, dims multiples of 16 (its
    alignment), on a GPU of compute capability 8.0 or newer (or the CPU, where torch has a kernel)."""
    if not hasattr(F, "grouped_mm") or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if any(d % 16 for d in weight.shape[1:]):
        return False
    if x.is_cuda:
        return torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu"


def expert_blocks(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``[T, k]`` assignments by expert: ``(order, token_of, offsets)`` with ``order`` the
    flat assignment index of each sorted row, ``token_of`` its token and ``offsets`` int32 ``[E]`` the
    end of each expert's block. The sort is stable, so a token's rows keep transformers' expert order."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // top_k_index.shape[1], counts.cumsum(0).to(torch.int32)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, transposed: bool, grouped: bool | None = None
) -> torch.Tensor:
    """``y[block e] = x[block e] @ B_e`` for sorted rows ``x [M, in]``: ``weight`` is ``[E, out, in]``
    (``B_e = W_e^T``) or, ``transposed``, ``[E, in, out]`` (``B_e = W_e``). ``grouped``: force the
    grouped kernel (True) or the loop (False); ``None`` picks (:func:`grouped_mm_supported`)."""
    b = weight if transposed else weight.transpose(1, 2)  # [E, in, out]: column-major for [E, out, in]
    if grouped is None:
        grouped = grouped_mm_supported(x, weight)
    if grouped:
        return F.grouped_mm(x, b, offs=offsets)
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):  # one host sync; the loop is the reference / fp32 path
        if end > start:
            outs.append(x[start:end] @ b[e])
        start = end
    return torch.cat(outs) if outs else x.new_zeros(0, b.shape[2])


def _activation(module: nn.Module, spec: ExpertsSpec, backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if spec.interleaved:  # gpt-oss: the module's own clamped SwiGLU on interleaved gate/up columns
        return module._apply_gate
    act = getattr(module, "act_fn", None)

    def gate_times_up(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if type(act).__name__ in ("SiLU", "SiLUActivation"):
            return swiglu(gate.contiguous(), up.contiguous(), backend=backend)
        return act(gate) * up

    return gate_times_up


def grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    *, spec: ExpertsSpec,
) -> torch.Tensor:
    """The experts module's forward (``[T, H]`` tokens, ``[T, k]`` experts and routing weights ->
    ``[T, H]``), as grouped GEMMs (module docstring); bound by :func:`swiftune.patch_model`."""
    for name in ("gate_up_proj", "down_proj"):
        # transformers 5 fuses the experts into [E, ., .] tensors (Qwen3-MoE, gpt-oss, Mixtral); an
        # older layout (a ModuleList of per-expert linears) has no such module class to bind to, but a
        # module that has the class name and other shapes must not be read as if it were fused
        if getattr(self, name).dim() != 3:
            raise TypeError(f"{type(self).__name__}.{name} has shape {tuple(getattr(self, name).shape)}, not the "
                            "fused [num_experts, out, in] layout swiftune's grouped experts read; call "
                            "swiftune.models.unpatch_model(model) to run this transformers version's own experts")
    state = patch_state(self)
    backend = state.kernel_backend if state is not None else "auto"
    grouped = False if backend == "reference" else None
    num_experts = self.gate_up_proj.shape[0]
    order, token_of, offsets = expert_blocks(top_k_index, num_experts)
    x = hidden_states[token_of]
    gate_up = grouped_linear(x, self.gate_up_proj, offsets, transposed=spec.transposed, grouped=grouped)
    expert_of = None
    if spec.biased:
        expert_of = top_k_index.reshape(-1)[order]
        gate_up = gate_up + self.gate_up_proj_bias[expert_of]
    h = _activation(self, spec, backend)(gate_up)
    y = grouped_linear(h, self.down_proj, offsets, transposed=spec.transposed, grouped=grouped)
    if spec.biased:
        y = y + self.down_proj_bias[expert_of]
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, token_of, y.to(out.dtype))
