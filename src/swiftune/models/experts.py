"""Routed experts as grouped matrix multiplies (Qwen3-MoE, gpt-oss, Mixtral), bound on the experts module.

transformers' experts forward loops over the experts, gathering each one's tokens, running two
matmuls and scattering back: ``E`` small launches per projection. Here the ``T * k`` (token, expert)
assignments are sorted by expert once, so each expert's tokens are one contiguous block of ``x_s``
(``offsets`` = running sums of the per-expert counts), and each projection is one grouped GEMM:

    y_s[o_{e-1}:o_e] = x_s[o_{e-1}:o_e] @ B_e        for every expert e        (B_e = W_e^T or W_e)

Forward: gather ``x_s = x[token_of]`` -> gate/up GEMM (+ bias) -> activation -> down GEMM (+ bias) ->
scale by the routing weight -> each token's ``k`` rows summed into its row. Backward is autograd's through
the same ops: the GEMM's gradients are grouped GEMMs too (``dX_s = dY_s B_e^T``, ``dB_e = X_s^T dY_s``
per block), the gather's is a scatter-add, the combine's a gather, the routing weights get ``<y, dOut>`` per assignment.

Two ways for the GEMM, the same math: ``torch.nn.functional.grouped_mm`` (one kernel; bf16, CUDA
with SM >= 80, and on CPU where torch has it) and a plain loop over the experts' blocks (the
reference, fp32, and every case the grouped kernel does not take). The weights are read through the
module's attributes, so PEFT's ``target_parameters`` adapters (which parametrise them) apply.

The rollout engine's variant (:func:`rollout_experts_forward`, bound for the duration of a
``FastRolloutEngine.generate`` call by :func:`rollout_experts`) computes the same thing with two
differences a CUDA-graph decode step needs: no host synchronisation on CUDA (the fp32 / unaligned case,
which the loop serves in training, becomes a fixed loop over all experts with a per-row select), and
a deterministic combine: each token's ``k`` expert outputs are added one by one in ascending expert
order in the activation dtype (the order and roundings of transformers' experts loop and of
``index_add_`` on the CPU), where ``index_add_`` on CUDA adds them with atomics in an order that
changes from run to run (bf16 sums then differ, and a replayed step would not equal the eager one).

A decode step (at most :func:`default_decode_kernel_cap` tokens, no LoRA factors on the experts, on
CUDA) skips the gather / grouped GEMM / combine chain: :func:`swiftune.kernels.moe_decode.moe_decode`
runs it as three Triton kernels that read each routed expert's weights once, with the same
ascending-expert, rounded-per-add combine and no atomics (:func:`decode_kernel_applies` says when).
The routers of the same model run their softmax / top-k / renormalisation / cast as one Triton launch
(:func:`rollout_router_forward`, :mod:`swiftune.kernels.moe_router`) instead of five of torch's; asked for
(``route_kernels``), a step above that cap sorts by expert in two launches and combines in one
(:mod:`swiftune.kernels.moe_route`; the same bits as the torch ops it replaces, :func:`route_kernels_apply`
says when).
"""

from __future__ import annotations

from collections.abc import Callable

import contextlib
from collections.abc import Iterator
from functools import partial
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import swiglu
from ..kernels.moe_decode import moe_decode, moe_decode_interpreted
from ..kernels.moe_route import EXPERT_SORT_MAX_ASSIGNMENTS, EXPERT_SORT_MAX_EXPERTS, expert_combine, expert_sort
from ..kernels.moe_router import moe_router_topk
from .families import ExpertsSpec, Family, RouterSpec
from .state import is_bound, patch_state

__all__ = ["DECODE_KERNEL_MAX_TOKENS", "INTERLEAVED_DECODE_KERNEL_MAX_TOKENS", "check_decode_kernel_max_tokens",
           "default_decode_kernel_cap", "decode_kernel_applies", "expert_blocks",
           "grouped_experts_forward", "grouped_linear", "grouped_mm_supported",
           "rollout_experts", "rollout_experts_forward", "rollout_router_forward", "route_kernels_apply"]


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
    end of each expert's block. The sort is stable, so a token's rows keep transformers' expert order.

    The ends are a search of the sorted expert ids (the number of assignments to experts ``<= e``), the
    same values as the running sum of ``bincount``, which on CUDA reads its input's maximum back to the
    host; this stays on the device (static shapes, capturable in a CUDA graph)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = torch.arange(num_experts, dtype=flat.dtype, device=flat.device)
    ends = torch.searchsorted(flat[order], experts, right=True)
    return order, order // top_k_index.shape[1], ends.to(torch.int32)


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


def _check_fused_layout(module: nn.Module) -> None:
    for name in ("gate_up_proj", "down_proj"):
        # transformers 5 fuses the experts into [E, ., .] tensors (Qwen3-MoE, gpt-oss, Mixtral); an
        # older layout (a ModuleList of per-expert linears) has no such module class to bind to, but a
        # module that has the class name and other shapes must not be read as if it were fused
        if getattr(module, name).dim() != 3:
            raise TypeError(f"{type(module).__name__}.{name} has shape {tuple(getattr(module, name).shape)}, not the "
                            "fused [num_experts, out, in] layout swiftune's grouped experts read; call "
                            "swiftune.models.unpatch_model(model) to run this transformers version's own experts")


def grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    *, spec: ExpertsSpec,
) -> torch.Tensor:
    """The experts module's forward (``[T, H]`` tokens, ``[T, k]`` experts and routing weights ->
    ``[T, H]``), as grouped GEMMs (module docstring); bound by :func:`swiftune.patch_model`."""
    _check_fused_layout(self)
    order, token_of, y = _routed_outputs(self, hidden_states, top_k_index, top_k_weights, spec, static=False)
    return _SumAssignments.apply(y.to(hidden_states.dtype), order, token_of, top_k_index.shape[1])


class _SumAssignments(torch.autograd.Function):
    """``out[t] = sum_j y[row(t, j)]``: each token's ``k`` weighted expert outputs (``y [T k, H]`` in the
    experts' sorted order, ``order`` the flat assignment ``t k + j`` of each sorted row) added into its row.

    Forward: undo the sort (``row = order^-1``, a scatter of ``arange``), view as ``[T, k, H]`` and sum over
    ``k``; the sum accumulates in float32 for bf16 and rounds once, with no atomics (deterministic on CUDA),
    as transformers' grouped experts combine. Backward: every row of a token receives that token's gradient,
    ``dy[i] = dout[token_of[i]]``, a gather; only ``token_of`` is saved. (``index_add_``'s autograd saves its
    whole source, ``[T k, H]``, to shape that gather: ``k H b`` bytes a token held for nothing.)

    The output keeps ``y``'s dtype under autocast too: CUDA's autocast runs ``sum`` in float32 and returns
    float32, which made the block's output, the residual stream after it and every later layer's inputs float32
    (the experts' grouped GEMMs then fell back to float32 products)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, order: torch.Tensor, token_of: torch.Tensor, k: int) -> torch.Tensor:
        sorted_row = _sorted_row_of(order)
        ctx.save_for_backward(token_of)
        with torch.autocast(y.device.type, enabled=False):
            summed = y[sorted_row].view(-1, k, y.shape[-1]).sum(dim=1, dtype=torch.float32)
        return summed.to(y.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (token_of,) = ctx.saved_tensors
        return grad_out.index_select(0, token_of), None, None, None


def rollout_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    *, spec: ExpertsSpec, adapters: dict[str, LowRank] | None = None, decode_kernel: bool = True,
    decode_kernel_max_tokens: int | None = None, route_kernels: bool = False,
) -> torch.Tensor:
    """:func:`grouped_experts_forward` for the rollout engine (module docstring): on CUDA no host sync
    (capturable), and each token's expert outputs added in ascending expert order, deterministically.
    ``adapters``: weight name -> LoRA factors ``(lhs, rhs, s)`` with the adapted weight ``W + s lhs @ rhs``
    (PEFT's ``ParamWrapper.get_delta_factors``), applied per expert block as ``x W + s (x lhs) rhs``.
    ``decode_kernel``: whether a decode step may take the fused kernels (:func:`decode_kernel_applies`);
    ``False`` keeps the grouped-GEMM chain (the baseline benchmarks/moe_decode.py times).
    ``decode_kernel_max_tokens``: the most tokens that take them (``None``: :func:`default_decode_kernel_cap`).
    ``route_kernels``: whether the grouped-GEMM path may sort and combine through
    :mod:`swiftune.kernels.moe_route` (:func:`route_kernels_apply`; the same bits); ``False`` keeps torch's ops."""
    _check_fused_layout(self)
    if decode_kernel and decode_kernel_applies(self, hidden_states, spec, adapters, decode_kernel_max_tokens):
        return _decode_kernel_forward(self, hidden_states, top_k_index, top_k_weights, spec)
    if route_kernels and route_kernels_apply(self, hidden_states, top_k_index):
        # the sort (two launches) and the weighted combine (one) of kernels/moe_route.py, the same bits
        order, token_of, ends, slot_row = expert_sort(top_k_index, self.gate_up_proj.shape[0])
        _, _, y = _routed_outputs(self, hidden_states, top_k_index, None, spec, static=hidden_states.is_cuda,
                                  adapters=adapters or {}, blocks=(order, token_of, ends))
        return expert_combine(y, slot_row, order, top_k_weights, hidden_states.dtype)
    order, _, y = _routed_outputs(self, hidden_states, top_k_index, top_k_weights, spec,
                                  static=hidden_states.is_cuda, adapters=adapters or {})
    tokens, k = top_k_index.shape
    y = y.to(hidden_states.dtype)
    sorted_row = _sorted_row_of(order)
    # each token's slots by ascending expert (a token's k experts are distinct), as transformers' loop adds them
    by_expert = sorted_row.view(tokens, k).gather(1, top_k_index.argsort(dim=1))
    parts = y[by_expert]  # [T, k, H]
    out = parts[:, 0]
    for slot in range(1, k):  # one add per slot, rounded to the activation dtype each time, as index_add_
        out = out + parts[:, slot]
    return out


#: the most tokens a decode step sends through :func:`swiftune.kernels.moe_decode.moe_decode` for the
#: gate-then-up layout (Qwen3-MoE, Mixtral; prefill and larger steps keep the grouped GEMM). On the H200,
#: one Qwen3-30B-A3B layer at 8 tokens took 0.13 ms against the grouped GEMM's 0.27 (graph replays), and at
#: 64 tokens 0.75 against 0.52 (docs/results/2026-12-02/moe_decode_h200.txt); with 16-row tiles the layer
#: won at 64 tokens (0.36 ms), but the engine's G=64 step did not (14.96 ms against 14.55 at this cap,
#: docs/results/2026-12-02/): the random-init router sends a step's rows to ~12 of 128 experts.
DECODE_KERNEL_MAX_TOKENS = 16

#: the same for the interleaved layout (gpt-oss), whose tiles above 16 rows are 64 columns wide: the
#: gpt-oss-20b engine's G=64 step took 15.52 ms with the kernels against 19.94 with the grouped GEMM
#: (docs/results/2026-12-02/); the tiles hold at most 64 rows of an expert.
INTERLEAVED_DECODE_KERNEL_MAX_TOKENS = 64


def default_decode_kernel_cap(spec: ExpertsSpec) -> int:
    """The most tokens a decode step sends through the fused decode kernels when no cap is given, by the
    experts' layout: :data:`INTERLEAVED_DECODE_KERNEL_MAX_TOKENS` or :data:`DECODE_KERNEL_MAX_TOKENS`."""
    return INTERLEAVED_DECODE_KERNEL_MAX_TOKENS if spec.interleaved else DECODE_KERNEL_MAX_TOKENS


def check_decode_kernel_max_tokens(max_tokens: int) -> int:
    """``max_tokens`` as the decode kernels' token cap (a whole number >= 0; 0: never the kernels)."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise ValueError(f"the MoE decode kernels' token cap must be a whole number >= 0 (0: the grouped GEMM "
                         f"always), got {max_tokens!r}")
    return max_tokens


def decode_kernel_applies(module: nn.Module, hidden_states: torch.Tensor, spec: ExpertsSpec,
                          adapters: dict[str, LowRank] | None, max_tokens: int | None = None) -> bool:
    """Whether a rollout step's experts run the fused decode kernels: no autograd, at most
    ``max_tokens`` tokens (``None``: :func:`default_decode_kernel_cap`), no LoRA factors (merged adapters
    leave plain weights), fp16/bf16/fp32 weights of the activation dtype, SiLU (or gpt-oss's clamped
    SwiGLU), and compiled Triton on CUDA, or the interpreter on the CPU where ``kernel_backend="triton"``
    asks for kernels (the tests); everything else keeps the grouped-GEMM path."""
    backend = _kernel_backend(module)
    if backend == "reference" or adapters or torch.is_grad_enabled():
        return False
    if max_tokens is None:
        max_tokens = default_decode_kernel_cap(spec)
    if hidden_states.dim() != 2 or hidden_states.shape[0] > max_tokens:
        return False
    if hidden_states.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    weights = [module.gate_up_proj, module.down_proj] + (
        [module.gate_up_proj_bias, module.down_proj_bias] if spec.biased else [])
    if any(w.dtype != hidden_states.dtype or w.device != hidden_states.device for w in weights):
        return False
    if not spec.interleaved and type(getattr(module, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return False
    return _kernels_run_on(hidden_states, backend)


def _kernel_backend(module: nn.Module) -> str:
    """The ``kernel_backend`` :func:`swiftune.patch_model` bound the module with (``"auto"`` if unbound)."""
    state = patch_state(module)
    return state.kernel_backend if state is not None else "auto"


def _kernels_run_on(hidden_states: torch.Tensor, backend: str) -> bool:
    """Whether the rollout's Triton kernels take ``hidden_states``: compiled on CUDA; on the CPU only through
    the interpreter and where ``kernel_backend="triton"`` asks for kernels (the tests)."""
    if hidden_states.is_cuda:
        return True
    return backend == "triton" and moe_decode_interpreted()


def route_kernels_apply(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> bool:
    """Whether a rollout step's grouped-GEMM path sorts and combines through :mod:`swiftune.kernels.moe_route`:
    no autograd, at most :data:`EXPERT_SORT_MAX_ASSIGNMENTS` assignments and :data:`EXPERT_SORT_MAX_EXPERTS`
    experts, and compiled Triton on CUDA, or the interpreter on the CPU where ``kernel_backend="triton"``
    asks for kernels (as :func:`decode_kernel_applies`)."""
    backend = _kernel_backend(module)
    if backend == "reference" or torch.is_grad_enabled() or hidden_states.dim() != 2:
        return False
    if top_k_index.numel() > EXPERT_SORT_MAX_ASSIGNMENTS or module.gate_up_proj.shape[0] > EXPERT_SORT_MAX_EXPERTS:
        return False
    return _kernels_run_on(hidden_states, backend)


def _decode_kernel_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, spec: ExpertsSpec) -> torch.Tensor:
    """The experts of a decode step through :func:`moe_decode` (the same ascending-expert combine)."""
    activation = {}
    if spec.interleaved:  # gpt-oss's clamped SwiGLU, with the module's own constants
        activation = dict(activation="clamped_swiglu", swiglu_alpha=float(module.alpha),
                          swiglu_limit=float(module.limit))
    return moe_decode(
        hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
        transposed=spec.transposed, interleaved=spec.interleaved,
        gate_up_bias=module.gate_up_proj_bias if spec.biased else None,
        down_bias=module.down_proj_bias if spec.biased else None,
        **activation, backend="triton",
    )


def _routed_outputs(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None,
    spec: ExpertsSpec, *, static: bool, adapters: dict[str, LowRank] | None = None,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, token_of, y)``: the assignments sorted by expert and each one's weighted expert output
    ``y [T * k, H]`` (in sorted order; unweighted when ``top_k_weights`` is ``None``). ``static``: where the
    grouped kernel does not apply, the sync-free loop (:func:`static_grouped_linear`) instead of the per-block
    one. ``adapters``: see :func:`rollout_experts_forward`. ``blocks``: :func:`expert_blocks`' ``(order,
    token_of, ends)`` when already sorted."""
    backend = _kernel_backend(module)
    grouped = False if backend == "reference" else None
    num_experts = module.gate_up_proj.shape[0]
    order, token_of, offsets = blocks if blocks is not None else expert_blocks(top_k_index, num_experts)
    x = hidden_states[token_of]

    def linear(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        use_grouped = grouped_mm_supported(inputs, weight) if grouped is None else grouped
        if static and not use_grouped:
            return static_grouped_linear(inputs, weight, offsets, transposed=spec.transposed)
        return grouped_linear(inputs, weight, offsets, transposed=spec.transposed, grouped=use_grouped)

    def project(inputs: torch.Tensor, name: str) -> torch.Tensor:
        base = getattr(module, name)
        factors = (adapters or {}).get(name)
        if factors is None:
            return linear(inputs, base)
        lhs, rhs, scaling = factors
        # W' = W + s lhs @ rhs in W's layout: [E, out, in] (x W'^T: rhs first) or, transposed, [E, in, out]
        first, second = (lhs, rhs) if spec.transposed else (rhs, lhs)
        return linear(inputs, base) + scaling * linear(linear(inputs, first), second)

    gate_up = project(x, "gate_up_proj")
    expert_of = None
    if spec.biased:
        expert_of = top_k_index.reshape(-1)[order]
        gate_up = gate_up + module.gate_up_proj_bias[expert_of]
    h = _activation(module, spec, backend)(gate_up)
    y = project(h, "down_proj")
    if spec.biased:
        y = y + module.down_proj_bias[expert_of]
    if top_k_weights is None:
        return order, token_of, y
    return order, token_of, y * top_k_weights.reshape(-1)[order].unsqueeze(-1)


def _sorted_row_of(order: torch.Tensor) -> torch.Tensor:
    """The sorted row of each flat (token, slot) assignment: the inverse of :func:`expert_blocks`' permutation
    ``order`` (a scatter of ``arange``, no host sync)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def static_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                          transposed: bool) -> torch.Tensor:
    """:func:`grouped_linear` with static shapes and no host sync: every expert's matrix applied to all
    ``M`` rows, each row keeping its own expert's result (``E`` times the FLOPs of the grouped GEMM;
    the rollout engine's CUDA fallback for what ``F.grouped_mm`` does not take, e.g. fp32)."""
    b = weight if transposed else weight.transpose(1, 2)  # [E, in, out]
    rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
    expert_of = torch.searchsorted(offsets, rows, right=True)[:, None]  # the block each sorted row is in
    out = x.new_zeros(x.shape[0], b.shape[2])
    for e in range(b.shape[0]):
        out = torch.where(expert_of == e, x @ b[e], out)
    return out


#: LoRA factors of one adapted expert stack: ``(lhs, rhs, scaling)``, the stack being ``W + scaling lhs @ rhs``
LowRank = tuple[torch.Tensor, torch.Tensor, float]


def _is_param_wrapper(module: nn.Module) -> bool:
    """PEFT's ``target_parameters`` LoRA layer (``ParamWrapper``): adapts ``base_layer.<parameter_name>``."""
    return (isinstance(getattr(module, "parameter_name", None), str) and hasattr(module, "base_layer")
            and hasattr(module, "lora_A") and callable(getattr(module, "get_delta_factors", None)))


def _single_adapter_factors(wrapper: nn.Module) -> LowRank | bool:
    """The factors of ``wrapper``'s one active adapter; ``False`` when it adds nothing now (adapters
    disabled, or merged into the weight); ``True`` for a state only PEFT's own forward handles (several
    active adapters, disabled-but-merged, a 1-byte base weight, a single expert)."""
    if wrapper.disable_adapters:
        return bool(wrapper.merged)  # PEFT unmerges first there
    if wrapper.merged:
        return False
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if not active:
        return False
    weight = getattr(wrapper.get_base_layer(), wrapper.parameter_name)
    if len(active) > 1 or getattr(wrapper, "num_experts", 0) <= 1 or weight.element_size() == 1:
        return True
    lhs, rhs, scaling = wrapper.get_delta_factors(active[0])
    # PEFT's lhs is a permuted view of lora_B; the grouped GEMM takes the base weights' layout
    return lhs.contiguous(), rhs.contiguous(), float(scaling)


def _adapted_rollout_forward(
    wrapper: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    *, chain: list[nn.Module], experts: nn.Module, spec: ExpertsSpec, peft_forward: Callable,
    decode_kernel_max_tokens: int | None = None, route_kernels: bool = False,
) -> torch.Tensor:
    """The outermost ``ParamWrapper`` of an experts module in a rollout: the adapters' factors passed to
    :func:`rollout_experts_forward` (each expert's block gets ``x W + s (x lhs) rhs``; the engine's
    ``decode_kernel_max_tokens`` and ``route_kernels`` with them), where PEFT would register a
    parametrisation that rebuilds every expert's adapted matrix on every call (twice: once to check it,
    once to use it); any other adapter state runs PEFT's own forward."""
    adapters: dict[str, LowRank] = {}
    for layer in chain:
        factors = _single_adapter_factors(layer)
        if factors is True:
            return peft_forward(hidden_states, top_k_index, top_k_weights)
        if factors is not False:
            adapters[layer.parameter_name] = factors
    return rollout_experts_forward(experts, hidden_states, top_k_index, top_k_weights, spec=spec, adapters=adapters,
                                   decode_kernel_max_tokens=decode_kernel_max_tokens, route_kernels=route_kernels)


def rollout_router_forward(self: nn.Module, hidden_states: torch.Tensor, *, spec: RouterSpec, backend: str = "auto"
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``{prefix}TopKRouter``'s forward for the rollout engine (bound on the module): ``(logits,
    weights, experts)`` as the router's own forward returns them, its matmul through ``F.linear`` (the
    weight read through the module, so a PEFT parametrisation of it applies) and the rest through
    :func:`~swiftune.kernels.moe_router.moe_router_topk` as ``spec`` says the family computes it.
    ``backend`` is the model's ``kernel_backend``: the kernel on CUDA unless ``"reference"``; on the CPU
    torch's own ops unless ``"triton"`` asks for the interpreter (as the experts' decode kernels)."""
    weight = self.weight
    logits = F.linear(hidden_states.reshape(-1, weight.shape[1]), weight, getattr(self, "bias", None))
    normalize = True if spec.normalize_attr is None else bool(getattr(self, spec.normalize_attr))
    weights, experts = moe_router_topk(logits, int(self.top_k), spec.order, normalize,
                                       torch.float32 if spec.float32_weights else logits.dtype,
                                       backend=backend if logits.is_cuda or backend != "auto" else "reference")
    return logits, weights, experts


@contextlib.contextmanager
def rollout_experts(model: nn.Module, family: Family, decode_kernel_max_tokens: int | None = None,
                    fused_routing: bool = True, route_kernels: bool = False) -> Iterator[tuple[int, int]]:
    """Within the block, every experts module of ``model`` that :func:`swiftune.patch_model` bound runs
    :func:`rollout_experts_forward`, and the outermost PEFT ``target_parameters`` wrapper around one runs
    :func:`_adapted_rollout_forward` (both restored on exit); yields ``(bound, total)`` experts modules
    of the family's class, so a caller can tell whether transformers' own experts forward (with its host
    syncs) would still run somewhere. ``decode_kernel_max_tokens``: the most tokens a step sends
    through the fused decode kernels (``None``: :func:`default_decode_kernel_cap`). The family's routers
    of a patched model (those with no forward of their own bound) run :func:`rollout_router_forward` in
    the block too: their top-k in one launch (``fused_routing=False``: torch's ops, the baseline of an A/B).
    ``route_kernels``: steps above the decode kernels' cap sort and combine through
    :mod:`swiftune.kernels.moe_route` (the same bits as torch's ops; ``FastRolloutEngine`` asks for it by default)."""
    if decode_kernel_max_tokens is not None:
        check_decode_kernel_max_tokens(decode_kernel_max_tokens)
    if family.experts is None:
        yield (0, 0)
        return
    modules = [m for m in model.modules() if type(m).__name__ == family.experts_class]
    bound = [m for m in modules if is_bound(m) and "forward" in m.__dict__]
    routers = [] if family.router is None or not bound or not fused_routing else \
        [m for m in model.modules() if type(m).__name__ == family.router_class and "forward" not in m.__dict__]
    wrapped = {id(w.base_layer) for w in model.modules() if _is_param_wrapper(w)}  # wrappers inside wrappers
    outer = []
    for w in model.modules():
        if not _is_param_wrapper(w) or id(w) in wrapped:
            continue
        chain = [w]
        while _is_param_wrapper(chain[-1].base_layer):
            chain.append(chain[-1].base_layer)
        if any(chain[-1].base_layer is m for m in bound):
            outer.append((w, chain, chain[-1].base_layer))
    saved = [(m, m.__dict__.get("forward")) for m in bound + [w for w, _, _ in outer] + routers]
    try:
        backend = _kernel_backend(bound[0]) if bound else "auto"
        for m in routers:
            m.forward = MethodType(partial(rollout_router_forward, spec=family.router, backend=backend), m)
        for m in bound:
            m.forward = MethodType(partial(rollout_experts_forward, spec=family.experts,
                                           decode_kernel_max_tokens=decode_kernel_max_tokens,
                                           route_kernels=route_kernels), m)
        for w, chain, experts in outer:
            w.forward = MethodType(partial(_adapted_rollout_forward, chain=chain, experts=experts, spec=family.experts,
                                           peft_forward=w.forward, decode_kernel_max_tokens=decode_kernel_max_tokens,
                                           route_kernels=route_kernels), w)
        yield (len(bound), len(modules))
    finally:
        for m, forward in saved:
            if forward is None:
                del m.forward  # the class's forward again
            else:
                m.forward = forward
