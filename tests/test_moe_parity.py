"""Gradient parity for the mixture-of-experts families (Qwen3-MoE) against the *unpatched*
transformers (+ PEFT) model run on each document alone (issues 20 and 25).

The helpers (documents, reference step, swiftune step, assertions) are tests/test_gradient_parity.py's;
only the model and the cases are MoE-specific: a tiny Qwen3-MoE (2 layers, hidden 64, 4 experts top-2,
the second layer a dense MLP through ``mlp_only_layers`` so both kinds of feed-forward are covered),
full fine-tuning; LoRA on the attention projections only; LoRA on the seven projection names of the
dense suite (which PEFT 0.21 maps onto the fused 3-D experts, gate/up at rank 2r); LoRA on the experts
through explicit ``target_parameters``; padded, padding-free and packed batches; checkpointing off and on.

The load-balancing loss: the reference is transformers' own ``load_balancing_loss_func`` on the router
logits of the unpatched model run document by document (transformers' padded-batch value: the loss is
a statistic of the whole batch, counted over real tokens), added with ``router_aux_loss_coef`` as
transformers adds it; the swiftune side records the router logits of its packed forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from swiftune.models import patch_model
from swiftune.models.moe import load_balancing_loss, record_router_logits, router_aux_loss
from swiftune.sft.trainer import sft_loss
from swiftune.data import make_collator
from swiftune.training import FastModel
from tests.helpers import VOCAB, rel_err
from tests.test_gradient_parity import (
    PAD_ID,
    TOL,
    _assert_parity,
    _examples,
    _grads,
    _lora_reference,
    _reference_step,
    _swiftune_model,
    _swiftune_step,
    _trainable,
    _trained_labels,
)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
AUX_COEF = 0.25  # large enough that a wrong aux gradient shows far above the tolerance


def tiny_qwen3_moe(seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Random fp32 Qwen3-MoE with eager attention: layer 0 sparse (4 experts, top-2, renormalised
    top-k weights as the real model), layer 1 a dense MLP (``mlp_only_layers``)."""
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                 router_aux_loss_coef=AUX_COEF, pad_token_id=None, initializer_range=0.2)
    sizes.update(overrides)
    config = transformers.Qwen3MoeConfig(**sizes)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         dtype=torch.float32).eval()


# adapter kind -> LoraConfig targets ("seven" is the dense suite's own _lora_reference / _swiftune_model)
TARGETS = {
    "attention": dict(target_modules=ATTENTION),
    "experts": dict(target_modules=ATTENTION, target_parameters=EXPERT_PARAMETERS),
}


def _targeted_lora_reference(base: torch.nn.Module, lora: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **TARGETS[lora])
    return get_peft_model(copy.deepcopy(base), config)


def _targeted_lora_model(base: torch.nn.Module, reference: torch.nn.Module, lora: str, checkpointing: str,
                         kernel_backend: str) -> torch.nn.Module:
    model = patch_model(copy.deepcopy(base), kernel_backend=kernel_backend)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, init_lora_weights=False,
                                     use_gradient_checkpointing={"off": False, "on": True}[checkpointing],
                                     **TARGETS[lora])
    model.load_state_dict(reference.state_dict())
    return model.train()


@pytest.fixture(scope="module")
def references() -> dict:
    """Per LoRA kind (None, "attention", "seven", "experts"): base model, reference model, reference step."""
    cache: dict = {}

    def get(lora: str | None):
        if lora not in cache:
            base = tiny_qwen3_moe().train()
            if lora is None:
                reference = copy.deepcopy(base)
            elif lora == "seven":
                reference = _lora_reference(base)
            else:
                reference = _targeted_lora_reference(base, lora)
            cache[lora] = (base, reference, _reference_step(reference, _examples()))
        return cache[lora]

    return get


def _model(references, lora: str | None, checkpointing: str, kernel_backend: str):
    base, reference, expected = references(lora)
    if lora in TARGETS:
        model = _targeted_lora_model(base, reference, lora, checkpointing, kernel_backend)
    else:
        model = _swiftune_model(base, reference, lora is not None, checkpointing, kernel_backend)
    return model, reference, expected


# Full fine-tuning and the seven projections (attention + experts): every layout with checkpointing
# off, and checkpointing on for the packed rows (the recompute runs router and experts again); the
# other adapter kinds on padding-free and packed + checkpointing. The Triton kernels through the
# interpreter on the padding-free rows of full fine-tuning and the seven projections (~10 s each);
# the rest with the kernels' PyTorch references (the attention, packing, checkpointing and MoE paths
# are the same).
LAYOUT_MODES = [("padded", "off"), ("padding_free", "off"), ("packed", "off"), ("packed", "on")]
CASES = [
    (lora, layout, mode, "auto" if layout == "padding_free" and lora in (None, "seven") else "reference")
    for lora in (None, "seven", "attention", "experts") for layout, mode in LAYOUT_MODES
    if lora in (None, "seven") or layout != "padded" and (layout, mode) != ("packed", "off")
]


def _case_id(case: tuple) -> str:
    lora, layout, mode, backend = case
    return f"{lora or 'full'}-{layout}-ckpt_{mode}-{backend}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_moe_training_gradients_equal_unpatched_model(references, case):
    lora, layout, checkpointing, kernel_backend = case
    model, reference, expected = _model(references, lora, checkpointing, kernel_backend)
    trainable = _trainable(reference)
    assert _trainable(model) == trainable
    on_experts = any("experts" in name and "lora_A" in name for name in trainable)
    assert on_experts == (lora in ("seven", "experts"))  # the fused 3-D experts carry adapters, or not
    if lora is None:  # full fine-tuning trains the experts and the router themselves
        assert any(name.endswith("experts.gate_up_proj") for name in trainable)
        assert any(name.endswith("mlp.gate.weight") for name in trainable)
    _assert_parity(expected, _swiftune_step(model, _examples(), layout), trainable)


# ----------------------------------------------------------------------------- load-balancing loss

def _reference_step_with_aux(model: torch.nn.Module, examples: list[dict]) -> tuple[torch.Tensor, dict]:
    """The unpatched model per document: CE as in the parity suite plus ``coef * aux`` from
    transformers' own function on the per-document router logits (its padded-batch value)."""
    model.zero_grad(set_to_none=True)
    labels = [_trained_labels(e) for e in examples]
    count = sum(int((lab[1:] != -100).sum()) for lab in labels)
    total, per_layer = 0.0, None
    for example, lab in zip(examples, labels):
        out = model(input_ids=torch.tensor([example["input_ids"]]), use_cache=False, output_router_logits=True)
        total = total + torch.nn.functional.cross_entropy(out.logits[0, :-1].double(), lab[1:], ignore_index=-100,
                                                          reduction="sum")
        layers = out.router_logits
        per_layer = [[t] for t in layers] if per_layer is None else [a + [t] for a, t in zip(per_layer, layers)]
    config = model.config
    aux = load_balancing_loss_func(tuple(torch.cat(parts) for parts in per_layer), config.num_experts,
                                   config.num_experts_per_tok)
    loss = total / count + config.router_aux_loss_coef * aux
    loss.backward()
    return loss.detach(), _grads(model)


def _swiftune_step_with_aux(model: torch.nn.Module, examples: list[dict], layout: str):
    batch = make_collator(layout, max_length=24, pad_token_id=PAD_ID)(examples)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    # real tokens: the padded batch's attention mask; packed rows' padding slots hold PAD_ID, which no
    # document token of these tests is (they are drawn below it)
    mask = batch.get("attention_mask", batch["input_ids"] != PAD_ID)
    model.zero_grad(set_to_none=True)
    with record_router_logits(model) as logits:
        loss, _ = sft_loss(model, inputs, batch["labels"], num_items_in_batch=batch["num_trained_tokens"])
    assert len(logits) == 1  # one sparse layer, recorded once
    aux = router_aux_loss(model, logits, mask)
    loss = loss + aux
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.mark.parametrize(("layout", "checkpointing"), LAYOUT_MODES)
def test_moe_router_aux_loss_and_gradients_equal_transformers(layout, checkpointing):
    base = tiny_qwen3_moe(output_router_logits=True).train()
    reference = copy.deepcopy(base)
    expected = _reference_step_with_aux(reference, _examples())
    without_aux = _reference_step(copy.deepcopy(base), _examples())
    # the aux term moves the loss and the router's gradient well beyond the tolerance: the test can fail
    assert rel_err(without_aux[0], expected[0]) > 100 * TOL
    router = "model.layers.0.mlp.gate.weight"
    assert rel_err(without_aux[1][router], expected[1][router]) > 100 * TOL
    model = patch_model(copy.deepcopy(base), kernel_backend="reference")
    model = FastModel.for_training(model, use_gradient_checkpointing=checkpointing == "on").train()
    _assert_parity(expected, _swiftune_step_with_aux(model, _examples(), layout), _trainable(reference))


def test_load_balancing_loss_matches_transformers_with_padding():
    """The formula itself against transformers' function, with an attention mask and several layers."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 7, 6, generator=g) for _ in range(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    want = load_balancing_loss_func(logits, 6, 2, mask)
    assert rel_err(load_balancing_loss(logits, 6, 2, mask), want) < 1e-6
    assert rel_err(load_balancing_loss(logits, 6, 2), load_balancing_loss_func(logits, 6, 2)) < 1e-6
    assert rel_err(load_balancing_loss(logits, 6, 2), want) > 1e-3  # the mask matters


def test_dense_model_and_disabled_router_output_add_nothing():
    model = tiny_qwen3_moe()  # output_router_logits off (the config default): transformers adds no aux
    with record_router_logits(model) as logits:
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert len(logits) == 1 and router_aux_loss(model, logits) is None
    model.config.output_router_logits = True
    assert router_aux_loss(model, logits) is not None


# ----------------------------------------------------------------------------- layout and rollouts

def test_patched_moe_runs_packed_rows_and_unsupported_moe_does_not():
    """Qwen3-MoE is a supported family now: its padding-free rows stay padding-free. A MoE family
    swiftune does not patch (Mixtral) still falls back to padded rows, never mixing examples."""
    from swiftune.models.support import batch_layout_for

    patched = patch_model(tiny_qwen3_moe(), attention="reference", kernel_backend="reference")
    assert batch_layout_for(patched, "padding_free") == "padding_free"
    assert batch_layout_for(patched, "packed") == "packed"
    mixtral = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1))
    with pytest.warns(UserWarning, match="not a supported family"):
        patch_model(mixtral)
    with pytest.warns(UserWarning, match=r"MixtralForCausalLM.*padded instead"):
        assert batch_layout_for(mixtral, "padding_free") == "padded"


def test_rollouts_of_moe_go_through_transformers_generation():
    """The fast engine has no expert routing in its decode step yet: the family record keeps it out
    (GRPO's "auto" then picks transformers' generation), and that engine's greedy completions on the
    patched model equal the unpatched model's own greedy generate."""
    from swiftune.models.families import FAMILIES
    from swiftune.rl.rollout import SamplingParams, TransformersRolloutEngine
    from swiftune.rl.rollout.fast import SUPPORTED

    assert not FAMILIES["qwen3_moe"].fast_rollout and "qwen3_moe" not in SUPPORTED
    plain = tiny_qwen3_moe()
    patched = patch_model(copy.deepcopy(plain), kernel_backend="reference")
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    got = TransformersRolloutEngine(patched, pad_token_id=0).generate(prompts, 1, SamplingParams(max_tokens=5,
                                                                                                 temperature=0.0))
    for prompt, completion in zip(prompts, got.completion_ids):
        want = plain.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, len(prompt):].tolist()
        assert completion == want
