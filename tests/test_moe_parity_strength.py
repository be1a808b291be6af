"""MoE parity where tests/test_moe_parity.py's tiny models are degenerate (found by mutating swiftune's source).

Every model there is 4 experts top-2 with SiLU experts, and its Qwen3-MoE renormalises the top-k weights and
has no sliding window. Swiftune code that only matters outside that corner went untested:

* the grouped experts' activation: ``act_fn(gate) * up`` for an experts module whose activation is not SiLU
  (the fused SwiGLU kernel is taken only for SiLU); forcing the SwiGLU kernel for every activation passed;
* Qwen3-MoE's sliding window (``use_sliding_window``: every layer windowed, read from each attention module):
  reading no window for the family passed;
* Qwen3-MoE's ``norm_topk_prob=False`` (its config default): routing weights that do not sum to 1, so a
  renormalisation of the routing weights inside the experts changes the model (with renormalised weights it
  is the identity, as in every model of the parity suite);
* the rollout experts' combine of more than two experts per token: with two, ``a + b == b + a`` in any
  rounding, so adding a token's expert outputs in router order instead of ascending expert order (the order
  of transformers' experts loop, which bf16 rollouts match bit for bit) passed.

The reference is always the unpatched transformers model (one document at a time for training, the
unpatched MoE block for the rollout experts).
"""

from __future__ import annotations

import copy

import pytest
import torch

from swiftune.models import patch_model
from swiftune.models.experts import rollout_experts
from swiftune.models.families import FAMILIES
from tests.helpers import rel_err
from tests.test_gradient_parity import (
    TOL,
    _assert_parity,
    _examples,
    _reference_step,
    _swiftune_model,
    _swiftune_step,
    _trainable,
)
from tests.test_moe_parity import tiny_moe

# id -> (family, config overrides); each override changes the unpatched model's loss on the documents
VARIANTS = {
    "qwen3_moe-sliding_window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4)),
    "qwen3_moe-gelu_experts": ("qwen3_moe", dict(hidden_act="gelu_pytorch_tanh")),
    "qwen3_moe-unnormalised_topk": ("qwen3_moe", dict(norm_topk_prob=False)),
    "mixtral-gelu_experts": ("mixtral", dict(hidden_act="gelu")),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_config_variant_gradients_equal_unpatched_model(variant):
    """Full fine-tuning on packed rows: loss and every gradient (non-zero where the reference's is) as the
    unpatched model run per document, for a config the parity suite's tiny models do not have."""
    family, overrides = VARIANTS[variant]
    base = tiny_moe(family, **overrides).train()
    expected = _reference_step(copy.deepcopy(base), _examples())
    # the override matters on these documents (the same weights, the family's default config): the test can fail
    default_loss, _ = _reference_step(tiny_moe(family).train(), _examples())
    assert rel_err(default_loss, expected[0]) > 100 * TOL, variant
    model = _swiftune_model(base, base, False, "off", kernel_backend="reference")
    _assert_parity(expected, _swiftune_step(model, _examples(), "packed"), _trainable(base))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_rollout_experts_combine_three_experts_per_token_as_transformers(family):
    """Three experts per token, bf16 on the CPU: the rollout experts' output equals the unpatched MoE block's
    with transformers' experts loop (``experts_implementation="eager"``, the order and roundings the rollout
    combine follows: each token's expert outputs added in ascending expert order, rounded per add) bit for bit,
    and that order matters here: the same outputs added in the router's slot order differ. (transformers'
    default ``grouped_mm`` experts sum a token's k outputs in float32 and round once: from k = 3 on that is
    another rounding, which the rollout combine does not claim.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit equality is about the order of the additions, not the GEMM's threading
    try:
        torch.manual_seed(0)
        reference = tiny_moe(family, num_experts_per_tok=3).to(torch.bfloat16)
        reference.set_experts_implementation("eager")  # transformers' per-expert loop
        model = patch_model(copy.deepcopy(reference), attention="reference", kernel_backend="reference")
        block, ref_block = model.model.layers[0].mlp, reference.model.layers[0].mlp
        x = torch.randn(1, 11, reference.config.hidden_size, dtype=torch.bfloat16)
        with torch.no_grad():
            want = ref_block(x)
            want = want[0] if isinstance(want, tuple) else want
            with rollout_experts(model, FAMILIES[family]) as (bound, total):
                assert bound == total >= 1
                got = block(x)
            got = got[0] if isinstance(got, tuple) else got
            # control: each slot's weighted expert output from transformers' own experts, summed in slot order
            router, experts = (ref_block.router if family == "gpt_oss" else ref_block.gate), ref_block.experts
            flat = x.reshape(-1, x.shape[-1])
            _, weights, index = router(flat)
            assert index.shape[1] == 3 and not torch.equal(index, index.sort(dim=1).values)  # some rows unsorted
            parts = [experts(flat, index[:, j:j + 1], weights[:, j:j + 1]) for j in range(3)]
            slot_order = (parts[0] + parts[1]) + parts[2]
        assert not torch.equal(slot_order.view_as(want), want)  # the order of the additions shows in bf16
        assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)
