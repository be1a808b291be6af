"""Gradient parity for the mixture-of-experts families (Qwen3-MoE, gpt-oss, Mixtral) against the *unpatched*
transformers (+ PEFT) model run on each document alone (issues 20 and 25).

The helpers (documents, reference step, swiftune step, assertions) are tests/test_gradient_parity.py's;
only the model and the cases are MoE-specific: a tiny Qwen3-MoE (2 layers, hidden 64, 4 experts top-2,
the second layer a dense MLP through ``mlp_only_layers`` so both kinds of feed-forward are covered),
full fine-tuning; LoRA on the attention projections only; LoRA on the seven projection names of the
dense suite (which PEFT 0.21 maps onto the fused 3-D experts, gate/up at rank 2r); LoRA on the experts
through explicit ``target_parameters``; padded, padding-free and packed batches; checkpointing off and on.
Mixtral (a tiny one: 2 sparse layers, the config's sliding window) runs a subset: full fine-tuning, LoRA
through PEFT's mapping of Mixtral's own names (w1/w2/w3 onto the fused experts, gate onto the router)
and through ``target_parameters``.

The load-balancing loss: the reference is transformers' own ``load_balancing_loss_func`` on the router
logits of the unpatched model run document by document (transformers' padded-batch value: the loss is
a statistic of the whole batch, counted over real tokens), added with ``router_aux_loss_coef`` as
transformers adds it; the swiftune side records the router logits of its packed forward.
"""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from swiftune.attention import build_packed_batch, packed_attention
from swiftune.attention.sinks import sink_attention
from swiftune.models import causal_lm_of, enable_tiled_mlp, patch_model
from swiftune.models.moe import load_balancing_loss, record_router_logits, router_aux_loss
from swiftune.sft.trainer import sft_loss
from swiftune.data import make_collator
from swiftune.training import FastModel
from tests.helpers import VOCAB, assert_gradients_match, rel_err
from tests.test_gradient_parity import (
    PAD_ID,
    TOL,
    _assert_parity,
    bf16_step_equals_unpatched_fp32,
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


def tiny_gpt_oss(seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Random fp32 gpt-oss with eager attention: a sliding layer (window 4, shorter than the longest
    document) then a full one, YaRN RoPE, 4 biased experts top-2 with the clamped SwiGLU (limit 1, so
    the clamp bends), and sinks drawn large enough to take real probability mass."""
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                 swiglu_limit=1.0, router_aux_loss_coef=AUX_COEF, pad_token_id=None, initializer_range=0.2)
    sizes.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**sizes),
                                                          attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.2)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.2)
            layer.mlp.router.bias.normal_(0.0, 0.2)
    return model.eval()


def tiny_mixtral(seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Random fp32 Mixtral with eager attention: two sparse layers of 4 experts top-2 and one sliding
    window from the config (4, shorter than the longest document), no q/k norm."""
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                 router_aux_loss_coef=AUX_COEF, pad_token_id=None, initializer_range=0.2)
    sizes.update(overrides)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**sizes),
                                                         attn_implementation="eager", dtype=torch.float32).eval()


def tiny_moe(family: str, **overrides) -> transformers.PreTrainedModel:
    return {"qwen3_moe": tiny_qwen3_moe, "gpt_oss": tiny_gpt_oss, "mixtral": tiny_mixtral}[family](**overrides)


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


# adapter kind -> LoraConfig targets ("seven" is the dense suite's own _lora_reference / _swiftune_model).
# "v4_names": Mixtral's transformers-4 per-expert linear names and its router, which PEFT's conversion
# table maps onto the fused experts (w1 + w3 -> gate_up_proj at rank 2r, w2 -> down_proj) and onto the
# router's weight (gate -> gate.weight), all as target_parameters
TARGETS = {
    "attention": dict(target_modules=ATTENTION),
    "experts": dict(target_modules=ATTENTION, target_parameters=EXPERT_PARAMETERS),
    "v4_names": dict(target_modules=ATTENTION + ["w1", "w2", "w3", "gate"]),
}


def _targeted_lora_reference(base: torch.nn.Module, lora: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **TARGETS[lora])
    return get_peft_model(copy.deepcopy(base), config)


def _targeted_lora_model(base: torch.nn.Module, reference: torch.nn.Module, lora: str, checkpointing: str,
                         kernel_backend: str) -> torch.nn.Module:
    model = patch_model(copy.deepcopy(base), kernel_backend=kernel_backend)
    mode = {"off": False, "on": True, "offload": "offload", "tiled_mlp": False}[checkpointing]
    budget = {"offload_gpu_budget_bytes": 0} if mode == "offload" else {}  # offload tiles the MLPs/experts too
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, init_lora_weights=False,
                                     use_gradient_checkpointing=mode, **budget, **TARGETS[lora])
    model.load_state_dict(reference.state_dict())
    if checkpointing == "tiled_mlp":
        enable_tiled_mlp(model, tile_tokens=4, projections=True)  # several tiles per document
    return model.train()


@pytest.fixture(scope="module")
def references() -> dict:
    """Per (family, LoRA kind: None, "attention", "seven", "experts"): base model, reference model,
    reference step."""
    cache: dict = {}

    def get(family: str, lora: str | None):
        if (family, lora) not in cache:
            base = tiny_moe(family).train()
            if lora is None:
                reference = copy.deepcopy(base)
            elif lora == "seven":
                reference = _lora_reference(base)
            else:
                reference = _targeted_lora_reference(base, lora)
            cache[family, lora] = (base, reference, _reference_step(reference, _examples()))
        return cache[family, lora]

    return get


def _model(references, family: str, lora: str | None, checkpointing: str, kernel_backend: str):
    base, reference, expected = references(family, lora)
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
    ("qwen3_moe", lora, layout, mode, "auto" if layout == "padding_free" and lora in (None, "seven") else "reference")
    for lora in (None, "seven", "attention", "experts") for layout, mode in LAYOUT_MODES
    if lora in (None, "seven") or layout != "padded" and (layout, mode) != ("packed", "off")
] + [
    # gpt-oss: sinks, windows and YaRN in every case; PEFT maps no per-expert names there, so the
    # experts' adapters come from target_parameters
    ("gpt_oss", lora, layout, mode, "auto" if (lora, layout) == (None, "padding_free") else "reference")
    for lora in (None, "experts") for layout, mode in LAYOUT_MODES
    if lora is None or layout != "padded" and (layout, mode) != ("packed", "off")
] + [
    # offloaded checkpointing (every layer input on the host, recomputed through the MoE block; with LoRA
    # the MLPs and MoE blocks are tiled too)
    ("qwen3_moe", "seven", "packed", "offload", "reference"), ("gpt_oss", None, "packed", "offload", "reference"),
    ("gpt_oss", "experts", "packed", "offload", "reference"),
    # tiled MLP: the MoE blocks' experts in tiles of 4 tokens (the router once over every token), the
    # dense MLP of Qwen3-MoE's second layer as before; gpt-oss's block returns its routing weights too
    ("qwen3_moe", None, "packed", "tiled_mlp", "reference"), ("gpt_oss", "experts", "padding_free", "tiled_mlp",
                                                              "reference"),
] + [
    # Mixtral: the config's sliding window and the all-sparse layers in every case; its experts module
    # and the grouped path are Qwen3-MoE's, so the Triton kernels and the attention-only adapters are
    # not repeated. LoRA through PEFT's own mapping of Mixtral's names (experts and router) and
    # through explicit target_parameters.
    ("mixtral", lora, layout, mode, "reference")
    for lora, layout, mode in [(None, "padded", "off"), (None, "padding_free", "off"), (None, "packed", "on"),
                               (None, "packed", "offload"), ("v4_names", "padded", "off"),
                               ("v4_names", "padding_free", "off"), ("v4_names", "packed", "on"),
                               ("experts", "packed", "on"), ("v4_names", "packed", "tiled_mlp")]
]


def _case_id(case: tuple) -> str:
    family, lora, layout, mode, backend = case
    return f"{family}-{lora or 'full'}-{layout}-ckpt_{mode}-{backend}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_moe_training_gradients_equal_unpatched_model(references, case, monkeypatch):
    family, lora, layout, checkpointing, kernel_backend = case
    model, reference, expected = _model(references, family, lora, checkpointing, kernel_backend)
    tiled_calls = _count_tiled_experts(monkeypatch)
    trainable = _trainable(reference)
    assert _trainable(model) == trainable
    on_experts = any("experts" in name and "lora_A" in name for name in trainable)
    assert on_experts == (lora in ("seven", "experts", "v4_names"))  # the fused 3-D experts carry adapters, or not
    if lora == "v4_names":  # PEFT's mapping: rank 2r on the fused gate/up, an adapter on the router too
        assert any(name.endswith("mlp.gate.lora_A.default.weight") for name in trainable), trainable
    if lora is None:  # full fine-tuning trains the experts and the router themselves (gpt-oss: sinks too)
        assert any(name.endswith("experts.gate_up_proj") for name in trainable)
        assert any(name.endswith(("mlp.gate.weight", "mlp.router.weight")) for name in trainable)
        assert family != "gpt_oss" or any(name.endswith("self_attn.sinks") for name in trainable)
    _assert_parity(expected, _swiftune_step(model, _examples(), layout), trainable)
    if checkpointing == "tiled_mlp":  # the experts really ran in tiles, forward and backward
        assert tiled_calls["forward"] > 0 and tiled_calls["backward"] > 0, tiled_calls


def _count_tiled_experts(monkeypatch) -> dict:
    """Counts the tiled experts' forward and backward calls (:class:`TiledExperts`)."""
    from swiftune.models.tiled_mlp import TiledExperts

    calls = {"forward": 0, "backward": 0}
    for name in calls:
        def spy(*args, _f=getattr(TiledExperts, name), _k=name):
            calls[_k] += 1
            return _f(*args)
        monkeypatch.setattr(TiledExperts, name, staticmethod(spy))
    return calls


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
    # transformers' function of the model's own modeling file
    reference_aux = importlib.import_module(type(causal_lm_of(model)).__module__).load_balancing_loss_func
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    aux = reference_aux(tuple(torch.cat(parts) for parts in per_layer), experts, config.num_experts_per_tok)
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
    sparse = sum(1 for layer in causal_lm_of(model).model.layers if not hasattr(layer.mlp, "gate_proj"))
    assert len(logits) == sparse  # each sparse layer recorded once
    aux = router_aux_loss(model, logits, mask)
    loss = loss + aux
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.mark.parametrize(("family", "layout", "checkpointing"), [("qwen3_moe", *case) for case in LAYOUT_MODES] + [
    ("gpt_oss", "padding_free", "off"), ("gpt_oss", "packed", "on"), ("mixtral", "packed", "on"),
    # tiled experts: the router runs once over every token, so the recorded logits (and, on the padded
    # batch, transformers' own output_router_logits capture with its attention mask) see the whole batch
    ("qwen3_moe", "padded", "tiled_mlp"), ("mixtral", "packed", "tiled_mlp")])
def test_moe_router_aux_loss_and_gradients_equal_transformers(family, layout, checkpointing):
    base = tiny_moe(family, output_router_logits=True).train()
    reference = copy.deepcopy(base)
    expected = _reference_step_with_aux(reference, _examples())
    without_aux = _reference_step(copy.deepcopy(base), _examples())
    # the aux term moves the loss and the router's gradient well beyond the tolerance: the test can fail
    assert rel_err(without_aux[0], expected[0]) > 100 * TOL
    router = "model.layers.0.mlp.router.weight" if family == "gpt_oss" else "model.layers.0.mlp.gate.weight"
    assert rel_err(without_aux[1][router], expected[1][router]) > 100 * TOL
    model = patch_model(copy.deepcopy(base), kernel_backend="reference")
    model = FastModel.for_training(model, use_gradient_checkpointing=checkpointing == "on").train()
    if checkpointing == "tiled_mlp":
        enable_tiled_mlp(model, tile_tokens=4)
    _assert_parity(expected, _swiftune_step_with_aux(model, _examples(), layout), _trainable(reference))


def test_moe_router_aux_loss_with_lora_on_the_router_equals_peft():
    """Mixtral with PEFT's own mapping of its names (LoRA on the experts and on the router's weight, a
    parametrised router): the recorded logits carry the adapter, loss and every gradient equal PEFT's
    model run per document with transformers' aux on top (packed rows, checkpointing on)."""
    base = tiny_mixtral(output_router_logits=True).train()
    reference = _targeted_lora_reference(base, "v4_names")
    expected = _reference_step_with_aux(reference, _examples())
    model = _targeted_lora_model(base, reference, "v4_names", "on", "reference")
    assert any("mlp.gate.lora_A" in name for name in _trainable(reference))
    _assert_parity(expected, _swiftune_step_with_aux(model, _examples(), "packed"), _trainable(reference))


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
    """Qwen3-MoE, gpt-oss and Mixtral are supported families now: padding-free rows stay padding-free.
    A MoE family swiftune does not patch (Qwen2-MoE) still falls back to padded rows, never mixing
    examples."""
    from swiftune.models.support import batch_layout_for

    for family in ("qwen3_moe", "gpt_oss", "mixtral"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every module it should patch is patched: no warning
            patched = patch_model(tiny_moe(family), attention="reference", kernel_backend="reference")
            assert batch_layout_for(patched, "padding_free") == "padding_free"
            assert batch_layout_for(patched, "packed") == "packed"
    unsupported = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=2, num_experts_per_tok=1))
    with pytest.warns(UserWarning, match="not a supported family"):
        patch_model(unsupported)
    with pytest.warns(UserWarning, match=r"Qwen2MoeForCausalLM.*padded instead"):
        assert batch_layout_for(unsupported, "padding_free") == "padded"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_rollouts_of_moe_go_through_transformers_generation(family):
    """All three are on the fast engine (tests/test_moe_rollout.py, tests/test_gptoss_rollout.py), and
    transformers' engine (GRPO's choice on the CPU) still runs them: its greedy completions on the patched
    model (its decode steps: the dense path of the packed attention, sinks included) equal the unpatched
    model's own greedy generate."""
    from swiftune.models.families import FAMILIES
    from swiftune.rl.rollout import SamplingParams, TransformersRolloutEngine
    from swiftune.rl.rollout.fast import SUPPORTED

    assert FAMILIES[family].fast_rollout and family in SUPPORTED
    plain = tiny_moe(family)
    patched = patch_model(copy.deepcopy(plain), kernel_backend="reference")
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    got = TransformersRolloutEngine(patched, pad_token_id=0).generate(prompts, 1, SamplingParams(max_tokens=5,
                                                                                                 temperature=0.0))
    for prompt, completion in zip(prompts, got.completion_ids):
        want = plain.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, len(prompt):].tolist()
        assert completion == want


# ----------------------------------------------------------------------------- attention sinks

def _sink_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 9]
    total, hq, hk, d = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(total, h, d, generator=g, requires_grad=True) for h in (hq, hk, hk))
    sinks = torch.randn(hq, generator=g).mul(2).requires_grad_()
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return lengths, q, k, v, sinks, build_packed_batch(1, total, position_ids, None, device=torch.device("cpu"))


@pytest.mark.parametrize("window", [None, 4])
def test_reference_sink_attention_equals_transformers_eager_per_document(window):
    """Packed attention with sinks against transformers' gpt-oss eager attention run on each document
    alone (its own additive causal + window mask): output and the gradients of q, k, v and the sinks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    lengths, q, k, v, sinks, packed = _sink_inputs()
    scale = 8 ** -0.5
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks = 2, sinks
    module.training = False
    outs, start = [], 0
    for n in lengths:
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        allowed = (j <= i) & ((i - j < window) if window else True)
        mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
        sl = slice(start, start + n)
        out, _ = eager_attention_forward(module, q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None],
                                         v[sl].transpose(0, 1)[None], mask, scaling=scale)
        outs.append(out[0])
        start += n
    want = torch.cat(outs)
    cotangent = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * cotangent).sum(), (q, k, v, sinks))
    got = sink_attention(q, k, v, packed, scale=scale, sinks=sinks, window=window, backend="reference")
    got_grads = torch.autograd.grad((got * cotangent).sum(), (q, k, v, sinks))
    assert rel_err(got, want) < 1e-6
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < 1e-6 and w.abs().max() > 0
    # the sinks matter (the test can fail): without them the output is another one
    plain = packed_attention(q, k, v, packed, scale=scale, window=window, backend="reference")
    assert rel_err(plain, want) > 1e-2


def test_flex_sink_attention_forward_equals_reference():
    """The flex formulation (one extra key slot whose score is the sink) on CPU, forward only (flex has
    no backward off CUDA; the GPU suite checks its gradients)."""
    _, q, k, v, sinks, packed = (t.detach() if isinstance(t, torch.Tensor) else t for t in _sink_inputs(1))
    with torch.no_grad():
        for window in (None, 4):
            want = sink_attention(q, k, v, packed, scale=0.3, sinks=sinks, window=window, backend="reference")
            got = sink_attention(q, k, v, packed, scale=0.3, sinks=sinks, window=window, backend="flex")
            assert rel_err(got, want) < 1e-5
    with pytest.raises(ValueError, match="no attention sinks"):
        sink_attention(q, k, v, packed, scale=0.3, sinks=sinks, backend="varlen")


def test_gpt_oss_grpo_policy_logprobs_equal_unpatched_model():
    """GRPO's policy forward (swiftune's GRPO attention on a policy row) on gpt-oss: each completion
    token's log-probability equals the unpatched model's on the sequence alone, sinks included, in plain
    and in shared-prompt rows."""
    from swiftune.rl import build_policy_row, completion_logprobs
    from swiftune.rl.policy import install_grpo_attention

    plain = tiny_gpt_oss()
    model = patch_model(copy.deepcopy(plain), attention="reference", kernel_backend="reference")
    install_grpo_attention(model)
    prompts = [[5, 6, 7]] * 2 + [[8, 9, 10, 11]] * 2
    completions = [[20, 21, 22, 23, 24], [23], [24, 25], [26, 27, 28, 29]]
    want = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            logps = torch.log_softmax(plain(input_ids=torch.tensor([p + c])).logits[0].float(), -1)
            want += [logps[len(p) - 1 + i, t] for i, t in enumerate(c)]
        row = build_policy_row(prompts, completions, share_prompt=False, group_ids=[0, 0, 1, 1])
        got, _ = completion_logprobs(model, row, kernel_backend="reference")
        assert rel_err(got, torch.stack(want)) < 1e-5
        shared = build_policy_row(prompts, completions, share_prompt=True, group_ids=[0, 0, 1, 1])
        got_shared, _ = completion_logprobs(model, shared, kernel_backend="reference")
        assert rel_err(got_shared, torch.stack(want)) < 1e-5


# ----------------------------------------------------------------------------- grouped experts

@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_grouped_mm_experts_equal_transformers_experts(family):
    """The grouped-GEMM experts (``F.grouped_mm``, bf16, the kernel the GPU runs; torch has a CPU one)
    and the per-expert loop (bf16) against transformers' own experts forward in float32: output and
    the gradients of the tokens, the routing weights and every expert tensor. (The fp32 parity cases
    above run the loop inside the whole model.)"""
    from swiftune.models.experts import grouped_experts_forward, grouped_mm_supported
    from swiftune.models.families import FAMILIES
    from swiftune.models.state import PatchState, is_bound, set_patch_state

    model = tiny_moe(family)
    assert all(is_bound(m) for m in patch_model(copy.deepcopy(model)).modules() if type(m).__name__.endswith("Experts"))
    experts = model.model.layers[0].mlp.experts
    spec = FAMILIES[family].experts
    g = torch.Generator().manual_seed(0)
    tokens, k = 13, model.config.num_experts_per_tok
    x = torch.randn(tokens, model.config.hidden_size, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(tokens)])
    index[:, 0] = 1  # expert 3 may go unused in some rows, expert 1 is used by every token
    weights = torch.rand(tokens, k, generator=g)
    cotangent = torch.randn(tokens, model.config.hidden_size, generator=g)

    def run(module, dtype, forward=None):
        inputs = [x.to(dtype).requires_grad_(), weights.to(dtype).requires_grad_()]
        out = (forward or module)(inputs[0], index, inputs[1])
        tensors = inputs + list(module.parameters())
        grads = torch.autograd.grad((out.float() * cotangent).sum(), tensors)
        return [out] + list(grads)

    want = run(copy.deepcopy(experts), torch.float32)
    for mode in ("grouped", "loop"):
        module = copy.deepcopy(experts).to(torch.bfloat16)
        set_patch_state(module, PatchState("auto" if mode == "grouped" else "reference"))
        if mode == "grouped":
            assert grouped_mm_supported(x.to(torch.bfloat16), module.gate_up_proj)
        got = run(module, torch.bfloat16, lambda a, i, w, m=module: grouped_experts_forward(m, a, i, w, spec=spec))
        for g_, w_ in zip(got, want):
            assert rel_err(g_, w_) < 2e-2, mode
            assert g_.abs().max() > 0


@pytest.mark.parametrize(("family", "checkpointing"), [("gpt_oss", "offload"), ("mixtral", "on")])
def test_tiled_moe_under_checkpointing_equals_the_unpatched_model(family, checkpointing, monkeypatch):
    """Tiles of 4 tokens inside a checkpointed layer (its recompute routes and tiles again; offloaded:
    the layer inputs on the host): loss and every gradient as the unpatched model per document."""
    base = tiny_moe(family).train()
    expected = _reference_step(copy.deepcopy(base), _examples())
    model = patch_model(copy.deepcopy(base), kernel_backend="reference")
    mode = {"on": True, "offload": "offload"}[checkpointing]
    budget = {"offload_gpu_budget_bytes": 0} if mode == "offload" else {}
    model = enable_tiled_mlp(FastModel.for_training(model, use_gradient_checkpointing=mode, **budget), tile_tokens=4)
    calls = _count_tiled_experts(monkeypatch)
    _assert_parity(expected, _swiftune_step(model.train(), _examples(), "packed"), _trainable(base))
    assert calls["forward"] > 0 and calls["backward"] > 0, calls


def test_tiled_mlp_refuses_moe_blocks_it_cannot_tile_as_router_then_experts():
    """A MoE block with more than a router and experts (Qwen2-MoE's shared expert) or with router
    jitter (Mixtral's router_jitter_noise, applied to the input in place) is refused, naming why."""
    shared = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=2, num_experts_per_tok=1))
    with pytest.raises(ValueError, match="Qwen2MoeSparseMoeBlock is a mixture-of-experts block swiftune cannot tile"):
        enable_tiled_mlp(shared)
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        enable_tiled_mlp(tiny_mixtral(router_jitter_noise=0.1))


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_tiled_moe_without_gradient_equals_the_unpatched_model(family):
    """Evaluation (no gradient: the experts tile by tile, no autograd function) gives transformers' logits."""
    plain = tiny_moe(family)
    tiled = enable_tiled_mlp(copy.deepcopy(plain), tile_tokens=3)
    ids = torch.randint(0, VOCAB - 1, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(tiled(ids, use_cache=False).logits, plain(ids, use_cache=False).logits) < 1e-5


def test_grouped_experts_refuse_weights_that_are_not_fused():
    """The grouped forward reads [E, out, in] tensors; a module of the experts class with other shapes
    (another transformers layout) is refused with a message, never computed on as if it were fused."""
    model = patch_model(tiny_mixtral(), kernel_backend="reference")
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach().flatten(0, 1))
    with pytest.raises(TypeError, match=r"MixtralExperts.gate_up_proj has shape \(256, 64\).*fused"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


# ----------------------------------------------------------------------------- the same on the GPU, bf16

def _moe_bf16_case(family: str, lora: str | None, layout: str, checkpointing: str, autocast: bool = False,
                   device: str = "cuda") -> None:
    """bf16 (compiled kernels, grouped_mm experts, flex with sinks on gpt-oss on CUDA) against the unpatched model
    in fp32, one document at a time, as the dense suite's GPU cases
    (:func:`tests.test_gradient_parity.bf16_step_equals_unpatched_fp32`). ``device="cpu"``: the reference kernels,
    and autocast with CUDA's float32 ops emulated."""
    backend = "reference" if device == "cpu" else "auto"
    base = tiny_moe(family).to(device).train()
    reference = copy.deepcopy(base) if lora is None else _targeted_lora_reference(base, lora)

    def swiftune_model():
        if lora is None:
            return _swiftune_model(base.to(torch.bfloat16), reference, False, checkpointing, kernel_backend=backend)
        return _targeted_lora_model(base.to(torch.bfloat16), reference, lora, checkpointing, backend)

    bf16_step_equals_unpatched_fp32(reference, swiftune_model, layout, autocast, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
@pytest.mark.parametrize(("layout", "checkpointing"), [("padding_free", "off"), ("packed", "on")])
@pytest.mark.parametrize("lora", [None, "experts"], ids=["full", "lora_experts"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_gpu_bf16_moe_gradients_equal_unpatched_model(family, lora, layout, checkpointing):
    _moe_bf16_case(family, lora, layout, checkpointing)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_autocast_with_cudas_float32_ops_keeps_every_layer_bf16(family):
    """A bf16 model under autocast (a Trainer's ``bf16=True``) with CUDA's float32 ops emulated on the CPU:
    every decoder layer returns bf16, and the loss and every gradient equal the unpatched fp32 model's. The
    experts' combine once summed under autocast and returned float32 on CUDA; every later layer then ran in
    float32 (gpt-oss-20b's batch-16 step 1.8x slower). The CUDA test below is the same check on the device."""
    _moe_bf16_case(family, None, "packed", "off", autocast=True, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_gpu_autocast_moe_keeps_bf16_and_equals_unpatched_model(family):
    """Under bf16 autocast (a Trainer's ``bf16=True``), as the SFT and GRPO trainers run, on CUDA, whose autocast
    runs ``sum`` in float32 (the CPU's keeps it in bf16): every decoder layer bf16, loss and every gradient."""
    _moe_bf16_case(family, None, "packed", "on", autocast=True)


# ----------------------------------------------------------------------------- loading and training

def test_from_pretrained_patches_moe_and_sft_trains_padding_free(tmp_path):
    """A saved MoE checkpoint (gpt-oss, the family with the most swiftune-specific paths) through the
    real loading code: patched (attention, experts), the same logits as transformers, and one
    SFTTrainer step on padding-free rows (no fallback warning)."""
    family = "gpt_oss"
    from swiftune.attention import ATTENTION_NAME
    from swiftune.data import build_tokenizer, builtin_instruction_dataset
    from swiftune.models import is_patched
    from swiftune.models.state import is_bound
    from swiftune.sft import SFTConfig, SFTTrainer

    tokenizer = build_tokenizer()
    reference = tiny_moe(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    reference.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    model, tokenizer = FastModel.from_pretrained(str(tmp_path / "model"), dtype=torch.float32, device_map="cpu")
    assert is_patched(model) and model.config._attn_implementation == ATTENTION_NAME
    assert all(is_bound(m) for m in model.modules() if type(m).__name__.endswith("Experts"))
    ids = torch.randint(0, len(tokenizer) - 1, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits) < 1e-5
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, max_length=64,
                     kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
                     logging_steps=1, seed=1, disable_tqdm=True, dataloader_pin_memory=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*padded instead")
        trainer = SFTTrainer(model=model, args=args, train_dataset=builtin_instruction_dataset(num_rows=4),
                             processing_class=tokenizer)
    out = trainer.train()
    assert torch.isfinite(torch.tensor(out.training_loss))


def _router_loss_reference(base, examples, scale: float = 1.0):
    """transformers' own loss of the unpatched MoE model on the padded batch (mean CE + coef * aux over the real
    tokens), and the gradients of ``scale`` times it."""
    reference = copy.deepcopy(base)
    reference.config.output_router_logits = True
    padded = make_collator("padded", pad_token_id=PAD_ID)(examples)
    out = reference(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], labels=padded["labels"],
                    use_cache=False)
    (out.loss * scale).backward()
    return reference, out, _grads(reference)


def _moe_sft_trainer(base, layout: str, tmp_path, **config):
    """The patched copy of ``base`` for full fine-tuning and an SFTTrainer on it (``config``: more SFTConfig)."""
    from swiftune.data import build_tokenizer
    from swiftune.sft import SFTConfig, SFTTrainer

    model = patch_model(copy.deepcopy(base), kernel_backend="reference")
    model = FastModel.for_training(model, use_gradient_checkpointing=False).train()
    args = SFTConfig(output_dir=str(tmp_path), kernel_backend="reference", attention_backend="reference",
                     report_to="none", max_length=24, packing=layout == "packed", **config)
    trainer = SFTTrainer(model=model, args=args, train_dataset=[{"input_ids": [5, 6, 7]}],
                         processing_class=build_tokenizer())
    return model, trainer


@pytest.mark.parametrize("layout", ["padding_free", "packed"])
def test_sft_trainer_adds_trls_router_loss_as_transformers_computes_it(layout, tmp_path):
    """SFTTrainer on a MoE model, router_aux_loss_coef left at None (TRL's default: the model config's
    coefficient, output_router_logits switched on): its loss is transformers' own loss of the
    unpatched model on the padded batch (mean CE + coef * aux over the real tokens), its gradients
    equal that model's, and aux_loss is logged; 0.0 switches the term off; a dense model refuses a
    non-zero coefficient."""
    from swiftune.errors import ConfigError
    from swiftune.training.router_aux import RouterAuxLoss, real_token_mask

    base = tiny_qwen3_moe().train()
    examples = _examples()
    _, out, want = _router_loss_reference(base, examples)

    model, trainer = _moe_sft_trainer(base, layout, tmp_path)
    assert trainer.router_aux.enabled and model.config.output_router_logits
    batch = make_collator(layout, max_length=24, pad_token_id=PAD_ID)(examples)
    if layout == "packed":
        assert real_token_mask(batch) is not None  # the rows carry padding: it must not count as tokens
    model.zero_grad(set_to_none=True)
    inputs = trainer._prepare_inputs(dict(batch))  # on the trainer's device (CUDA on a GPU machine)
    loss = trainer.compute_loss(model, inputs)  # num_items_in_batch None: the mean, as transformers
    loss.backward()
    assert rel_err(loss.detach().cpu(), out.loss.detach()) < TOL
    for name, grad in want.items():
        got = _grads(model)[name].cpu()
        assert rel_err(got, grad) < TOL, name
        assert got.abs().sum() > 0 or grad.abs().sum() == 0, name
    trainer.log({"loss": float(loss.detach())})
    assert trainer.state.log_history[-1]["aux_loss"] > 0

    off = RouterAuxLoss(patch_model(copy.deepcopy(base), kernel_backend="reference"), 0.0)
    assert not off.enabled and off.term([], None) is None
    dense = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        RouterAuxLoss(dense, 0.01)


def test_grpo_on_an_unsupported_moe_says_it_adds_no_router_loss(tmp_path, caplog):
    """TRL's GRPOTrainer adds the MoE load-balancing loss by default; swiftune's GRPO adds it on the
    families it patches (tests/test_grpo_router_loss.py). On a MoE architecture it does not patch
    (Qwen2-MoE: no router recorder) it cannot, and says so once the trainer is built (instead of
    training differently in silence)."""
    import logging

    from swiftune.data import build_tokenizer
    from swiftune.rl import GRPOConfig, GRPOTrainer

    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.25))
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2, report_to="none",
                      max_completion_length=4, save_strategy="no", use_cpu=True)
    with caplog.at_level(logging.WARNING, logger="swiftune"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not a supported family: patched nothing, padded policy rows
        trainer = GRPOTrainer(model, [lambda prompts, completions, **kw: [0.0] * len(completions)], args,
                              [{"prompt": "abc"}] * 2, processing_class=build_tokenizer())
    assert not trainer.router_aux.enabled
    assert "adds no router load-balancing loss" in caplog.text and "0.25" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swiftune"):  # a supported MoE family: no such warning
        GRPOTrainer(tiny_qwen3_moe(), [lambda prompts, completions, **kw: [0.0] * len(completions)], args,
                    [{"prompt": "abc"}] * 2, processing_class=build_tokenizer())
    assert "router load-balancing" not in caplog.text


@pytest.mark.parametrize("layout", ["padding_free", "packed"])
def test_sft_router_loss_under_gradient_accumulation_is_averaged_over_the_steps(layout, tmp_path):
    """With ``num_items_in_batch`` (the token count of the whole accumulated step) TRL 1.16's SFTTrainer
    divides the MoE term ``coef * aux`` by the accumulation steps (it is a per-micro-batch mean) while the
    cross entropy is already normalised by the step's tokens. Two accumulation steps of the same batch
    (``num_items_in_batch`` = twice its trained tokens) must then give half of transformers' own loss of
    the unpatched model on that batch (mean CE + coef * aux) and half of its gradients, the router's
    included: dropping the division leaves the cross entropy halved but the whole aux term in."""
    steps = 2
    base = tiny_qwen3_moe().train()
    examples = _examples()
    reference, out, want = _router_loss_reference(base, examples, scale=1 / steps)
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    # the term is visible well above the tolerance: a trainer that leaves it undivided fails below
    assert reference.config.router_aux_loss_coef * float(out.aux_loss) / steps > 100 * TOL * float(out.loss)

    model, trainer = _moe_sft_trainer(base, layout, tmp_path, gradient_accumulation_steps=steps)
    assert trainer.router_aux.enabled
    trainer.current_gradient_accumulation_steps = steps  # what Trainer's loop sets for each step
    batch = make_collator(layout, max_length=24, pad_token_id=PAD_ID)(examples)
    model.zero_grad(set_to_none=True)
    inputs = trainer._prepare_inputs(dict(batch))
    num_items = torch.tensor(steps * batch["num_trained_tokens"])  # both micro-batches' trained tokens
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items)
    loss.backward()
    assert rel_err(loss.detach().cpu(), (out.loss / steps).detach()) < TOL, (float(loss), float(out.loss / steps))
    got = _grads(model)
    assert any(name.endswith("mlp.gate.weight") for name in want)
    assert_gradients_match(want, {n: g.cpu() for n, g in got.items()}, _trainable(reference), TOL)
