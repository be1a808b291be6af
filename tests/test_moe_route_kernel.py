"""The grouped-GEMM path's sort and combine kernels for rollout steps above the decode kernels' cap
(swiftune.kernels.moe_route).

References, never swiftune: torch's stable ``argsort`` / ``searchsorted`` / ``gather`` for the sort, torch's
``(y * w).to(dtype)`` and rounded adds in ascending expert order for the combine (bit for bit), and
transformers' own experts block for the rollout experts forward that uses them. On the CPU the kernels run
through the Triton interpreter (tests/conftest.py); on CUDA they are compiled.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swiftune.models.experts as experts_module
from swiftune.kernels.moe_route import EXPERT_SORT_MAX_ASSIGNMENTS, expert_combine, expert_sort
from swiftune.models import patch_model
from swiftune.models.families import FAMILIES
from tests.helpers import rel_err
from tests.test_moe_parity import tiny_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    """``[T, k]`` distinct experts per token, drawn from the lower half of the ids more often (uneven blocks,
    some experts with none)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.linspace(2.0, 0.1, experts)
    return torch.stack([torch.multinomial(weights, k, generator=g) for _ in range(tokens)]).to(DEVICE)


def _torch_sort(top_k_index: torch.Tensor, experts: int):
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.searchsorted(flat[order], torch.arange(experts, device=flat.device), right=True)
    sorted_row = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=flat.device))
    slot_row = sorted_row.view_as(top_k_index).gather(1, top_k_index.argsort(dim=1))
    return order, order // top_k_index.shape[1], ends.to(torch.int32), slot_row


@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (64, 128, 8), (37, 60, 4), (70, 256, 8), (17, 32, 1),
                                              (512, 256, 8)])  # the largest it takes: 64 blocks, 256 experts
def test_expert_sort_equals_a_stable_sort(tokens, experts, k):
    index = _routing(tokens, experts, k, seed=tokens + experts)
    got = expert_sort(index, experts)
    want = _torch_sort(index, experts)
    for name, g, w in zip(("order", "token_of", "ends", "slot_row"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_expert_sort_refuses_more_than_it_holds():
    with pytest.raises(ValueError, match="at most"):
        expert_sort(torch.zeros(EXPERT_SORT_MAX_ASSIGNMENTS // 2 + 1, 2, dtype=torch.long), 8)


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.float32)])
def test_expert_combine_equals_torch_bit_for_bit(dtype, weight_dtype):
    tokens, experts, k, hidden = 29, 16, 4, 72
    index = _routing(tokens, experts, k, seed=3)
    order, _, _, slot_row = _torch_sort(index, experts)
    g = torch.Generator().manual_seed(4)
    y = torch.randn(tokens * k, hidden, generator=g).to(dtype).to(DEVICE)
    w = torch.rand(tokens, k, generator=g).to(weight_dtype).to(DEVICE)
    # the torch path: weighted rows in the activation dtype, each token's slots by ascending expert, rounded adds
    parts = (y * w.reshape(-1)[order].unsqueeze(-1)).to(dtype)[slot_row]
    want = parts[:, 0]
    for r in range(1, k):
        want = want + parts[:, r]
    got = expert_combine(y, slot_row, order, w, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_rollout_experts_above_the_cap_take_the_route_kernels(family, monkeypatch):
    """A rollout step above the decode kernels' cap (40 tokens) sorts and combines with the kernels: its
    output equals transformers' own MoE block (fp32), and equals the torch path's bit for bit."""
    torch.manual_seed(0)
    reference = tiny_moe(family).to(DEVICE)
    model = patch_model(copy.deepcopy(reference), kernel_backend="triton")
    block, ref_block = model.model.layers[0].mlp, reference.model.layers[0].mlp
    x = torch.randn(1, 40, reference.config.hidden_size, device=DEVICE)
    calls = []
    monkeypatch.setattr(experts_module, "expert_sort", lambda *a: calls.append(a) or expert_sort(*a))
    with torch.no_grad(), experts_module.rollout_experts(model, FAMILIES[family], decode_kernel_max_tokens=16,
                                                         route_kernels=True):
        got = block(x)
        got = got[0] if isinstance(got, tuple) else got
        assert calls  # the sort kernel ran
        monkeypatch.setattr(experts_module, "route_kernels_apply", lambda *a: False)
        torch_path = block(x)
        torch_path = torch_path[0] if isinstance(torch_path, tuple) else torch_path
        want = ref_block(x)
        want = want[0] if isinstance(want, tuple) else want
    assert torch.equal(got, torch_path)
    assert rel_err(got, want) < 1e-5


def test_routing_settings_bind_what_they_say(monkeypatch):
    """``rollout_experts``: the router kernel unless ``fused_routing=False`` (``FastRolloutEngine(
    moe_fused_routing=False)``, the A/B's baseline); the sort kernel only with ``route_kernels=True``
    (``FastRolloutEngine(moe_route_kernels=True)``, the default); the engine passes both through."""
    torch.manual_seed(0)
    model = patch_model(tiny_moe("qwen3_moe").to(DEVICE), kernel_backend="triton")
    family = FAMILIES["qwen3_moe"]
    router = model.model.layers[0].mlp.gate
    calls = []
    monkeypatch.setattr(experts_module, "expert_sort", lambda *a: calls.append(a) or expert_sort(*a))
    x = torch.randn(1, 40, model.config.hidden_size, device=DEVICE)
    with torch.no_grad(), experts_module.rollout_experts(model, family, 16, fused_routing=False):
        assert "forward" not in router.__dict__
        model.model.layers[0].mlp(x)
    with torch.no_grad(), experts_module.rollout_experts(model, family, 16):
        assert "forward" in router.__dict__
        model.model.layers[0].mlp(x)
    assert not calls  # the route kernels are off unless asked for
    with torch.no_grad(), experts_module.rollout_experts(model, family, 16, route_kernels=True):
        model.model.layers[0].mlp(x)
    assert calls

    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
    seen = []
    real = experts_module.rollout_experts

    def spy(model, family, cap=None, fused_routing=True, route_kernels=False):
        seen.append((fused_routing, route_kernels))
        return real(model, family, cap, fused_routing, route_kernels)

    import swiftune.rl.rollout.fast as fast
    monkeypatch.setattr(fast, "rollout_experts", spy)
    for fused, route in [(False, False), (True, True)]:
        engine = FastRolloutEngine(model, use_cuda_graph=False, moe_fused_routing=fused, moe_route_kernels=route)
        engine.generate([[1, 2, 3]], 2, SamplingParams(max_tokens=2, temperature=0.0))
    assert seen == [(False, False), (True, True)]


@pytest.mark.parametrize("route", [True, False])
def test_expert_adapters_at_run_time_follow_the_engines_routing_setting(route, monkeypatch):
    """LoRA on the experts (PEFT's target_parameters, applied per block at run time): a step above the cap takes
    the sort kernel exactly when the route kernels are asked for, and equals the unpatched PEFT model's block."""
    from tests.test_moe_rollout import _models

    reference, policy = _models("qwen3_moe", "experts", seed=2, kernel_backend="triton")
    reference, policy = reference.to(DEVICE), policy.to(DEVICE)
    calls = []
    monkeypatch.setattr(experts_module, "expert_sort", lambda *a: calls.append(a) or expert_sort(*a))
    x = torch.randn(1, 40, reference.config.hidden_size, device=DEVICE)
    block = policy.base_model.model.model.layers[0].mlp
    with torch.no_grad(), experts_module.rollout_experts(policy, FAMILIES["qwen3_moe"], 16, route_kernels=route):
        got = block(x)
        want = reference.base_model.model.model.layers[0].mlp(x)
    assert bool(calls) == route
    assert rel_err(got, want) < 1e-5
