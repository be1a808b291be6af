"""The rollout engine's one-launch router top-k (swiftune.kernels.moe_router) and the router forward bound
in the engine (swiftune.models.experts.rollout_router_forward).

References, never swiftune: torch's softmax / topk / sum / division / cast as transformers' routers run them,
and each family's own router module (Qwen3MoeTopKRouter, MixtralTopKRouter, GptOssTopKRouter,
Qwen3VLMoeTextTopKRouter) on the same logits. On the CPU the kernel runs through the Triton interpreter
(tests/conftest.py); on CUDA it is compiled.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swiftune.kernels.moe_router as router_kernel
from swiftune.kernels.moe_router import moe_router_topk, moe_router_topk_reference
from swiftune.models import patch_model
from swiftune.models.experts import rollout_experts
from swiftune.models.families import FAMILIES
from tests.test_moe_parity import tiny_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [  # (experts, top_k, order, normalize, logits dtype, weights dtype)
    (128, 8, "softmax_first", True, torch.bfloat16, torch.bfloat16),    # Qwen3-30B-A3B
    (128, 8, "softmax_first", False, torch.float32, torch.float32),     # norm_topk_prob off
    (8, 2, "softmax_first", True, torch.bfloat16, torch.float32),       # Mixtral (float32 weights)
    (32, 4, "topk_first", True, torch.bfloat16, torch.bfloat16),        # gpt-oss-20b
    (60, 4, "softmax_first", True, torch.float32, torch.float32),       # not a power of two
    (256, 1, "topk_first", True, torch.float32, torch.float32),
]


@pytest.mark.parametrize("experts,top_k,order,normalize,dtype,out_dtype", CASES)
def test_router_topk_equals_torch(experts, top_k, order, normalize, dtype, out_dtype):
    g = torch.Generator().manual_seed(experts + top_k)
    # distinct values in every row (bf16 keeps them apart: spacing 6 / E, above bf16's 2^-6 near 3), so
    # that the chosen experts do not depend on how ties break
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(19)])
    logits = (ranks.float() * (6 / experts) - 3).to(dtype).to(DEVICE)
    weights, index = moe_router_topk(logits, top_k, order, normalize, out_dtype, backend="triton")
    ref_w, ref_i = moe_router_topk_reference(logits.double() if dtype == torch.float32 else logits, top_k, order,
                                             normalize, torch.float64)
    assert weights.dtype == out_dtype and index.dtype == torch.int64 and weights.shape == (19, top_k)
    assert torch.equal(index, ref_i)  # the same experts, largest first
    # float32 math against float64 (and the cast to the weights' dtype): within the dtype's rounding
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8}[out_dtype]
    torch.testing.assert_close(weights.double(), ref_w, rtol=tol, atol=tol)
    if order == "topk_first" or normalize:
        torch.testing.assert_close(weights.double().sum(-1), torch.ones(19, dtype=torch.float64, device=DEVICE),
                                   rtol=2 * tol, atol=2 * tol)


def test_router_topk_keeps_the_lower_expert_among_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, 2.0]], device=DEVICE)
    _, index = moe_router_topk(logits, 3, "topk_first", backend="triton")
    assert index.tolist() == [[1, 3, 5]]


def test_router_topk_refuses_bad_arguments():
    z = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_router_topk(z, 5, "softmax_first")
    with pytest.raises(ValueError, match="order must be"):
        moe_router_topk(z, 2, "softmax")
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        moe_router_topk(z[0], 2, "softmax_first")


def test_router_topk_keeps_autograd_where_a_gradient_is_asked_for():
    z = torch.randn(3, 8, requires_grad=True)
    weights, _ = moe_router_topk(z, 2, "softmax_first")
    weights.sum().backward()  # the reference path (the kernel has no backward)
    assert z.grad is not None


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_bound_router_equals_the_family_router(family, monkeypatch):
    """Inside ``rollout_experts`` every router of the model runs the fused top-k; its (logits, weights,
    experts) equal the router module's own forward (transformers' code) on the same hidden states."""
    torch.manual_seed(0)
    model = tiny_moe(family).to(DEVICE)
    reference = copy.deepcopy(model)
    patch_model(model, kernel_backend="triton")  # the kernel (interpreted on the CPU), not torch's ops
    router_class = FAMILIES[model.config.model_type].router_class
    routers = [m for m in model.modules() if type(m).__name__ == router_class]
    own = [m for m in reference.modules() if type(m).__name__ == router_class]
    assert routers and len(routers) == len(own)
    x = torch.randn(11, model.config.hidden_size, device=DEVICE)
    with torch.no_grad(), rollout_experts(model, FAMILIES[model.config.model_type]):
        assert all("forward" in m.__dict__ for m in routers)
        launches = []
        monkeypatch.setattr(router_kernel, "moe_router_topk_reference",
                            lambda *a: launches.append(a) or moe_router_topk_reference(*a))
        got = [m(x) for m in routers]
        assert not launches  # the kernel computed them
        expected = [m(x) for m in own]
    assert all("forward" not in m.__dict__ for m in routers)  # the class's forward again
    for (lg, w, i), (rl, rw, ri) in zip(got, expected):
        assert torch.equal(lg, rl) and torch.equal(i, ri) and w.dtype == rw.dtype
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("order", ["softmax_first", "topk_first"])
def test_router_topk_keeps_distinct_experts_in_range_on_nan_logits(order):
    """A diverged model's NaN logits give garbage weights but k distinct expert ids of the layer: the expert
    kernels index memory with them."""
    logits = torch.randn(3, 12, device=DEVICE)
    logits[0] = float("nan")
    logits[1, 4] = float("nan")
    _, index = moe_router_topk(logits, 4, order, backend="triton")
    assert ((index >= 0) & (index < 12)).all()
    assert all(len(set(row)) == 4 for row in index.tolist())
    assert 4 not in index[1].tolist()  # a NaN logit ranks last


def test_engine_with_lora_on_the_router_equals_generate_of_the_peft_model(monkeypatch):
    """PEFT's "all-linear" (swiftune's default targets) wraps Qwen3-MoE's router too (a ParamWrapper on its
    weight): in the engine the fused top-k runs inside that wrapper on the adapted weight, and greedy tokens
    (fp32) equal transformers' generate on the unpatched PEFT model."""
    from peft import LoraConfig, get_peft_model

    import swiftune.models.experts as experts_module
    from swiftune import FastModel
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
    from tests.test_moe_rollout import PAD, PROMPTS, _hf_greedy

    base = tiny_moe("qwen3_moe", seed=6, eos_token_id=None)
    torch.manual_seed(1)
    reference = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                init_lora_weights=False)).eval()
    policy = patch_model(copy.deepcopy(base), kernel_backend="triton")
    policy = FastModel.get_peft_model(policy, r=4, lora_alpha=8, init_lora_weights=False,
                                      use_gradient_checkpointing=False, target_modules="all-linear")
    policy.load_state_dict(reference.state_dict())
    assert type(policy.base_model.model.model.layers[0].mlp.gate).__name__ == "ParamWrapper"
    calls = []
    monkeypatch.setattr(experts_module, "moe_router_topk", lambda *a, **k: calls.append(a) or moe_router_topk(*a, **k))
    engine = FastRolloutEngine(policy.eval().to(DEVICE), pad_token_id=PAD, kv_bucket=4,
                               use_cuda_graph=torch.cuda.is_available())
    out = engine.generate(PROMPTS, 1, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=()))
    assert calls
    for prompt, got in zip(PROMPTS, out.completion_ids):
        assert got == _hf_greedy(reference.to(DEVICE), prompt, 10)
