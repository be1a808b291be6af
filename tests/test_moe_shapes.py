"""The planner's parameter counts for mixture-of-experts shapes against the real transformers models
(issue 25): total, active per token, linear weights and LoRA (PEFT's own count), on tiny random
models and on the real sizes of Qwen3-30B-A3B and gpt-oss-20b built on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from benchmarks.workload import MODEL_SHAPES, model_config
from swiftune.memory import plan_memory
from swiftune.memory.shapes import (
    KNOWN_MODELS,
    active_param_count,
    expert_lora_param_count,
    expert_param_count,
    linear_weight_count,
    lora_param_count,
    model_shape,
    param_count,
    peft_adapts_dense_mlps_of_moe_models,
)

TINY = {
    # one dense layer among the sparse ones (mlp_only_layers), as Qwen3-MoE configs allow
    "qwen3_moe": dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                      num_experts_per_tok=2, mlp_only_layers=[1]),
    "gpt_oss": dict(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=5, num_experts_per_tok=2, sliding_window=8),
    "mixtral": dict(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=5, num_experts_per_tok=2, sliding_window=8),
}


def _tiny(model_type: str) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(model_type, **TINY[model_type])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _numel(model: torch.nn.Module, keep) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if keep(name))


def _expert_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(all expert parameters, one expert of one layer's share times layers): from the real tensors."""
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    total = sum(p.numel() for m in experts for p in m.parameters())
    per_expert = sum(p.numel() // m.num_experts for m in experts for p in m.parameters())
    return total, per_expert


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_tiny_moe_counts_equal_the_real_model(model_type):
    model = _tiny(model_type)
    shape = model_shape(model.config)
    assert shape.is_moe
    assert param_count(shape) == _numel(model, lambda n: True)
    experts, per_expert = _expert_numel(model)
    assert expert_param_count(shape) == experts
    k = model.config.num_experts_per_tok
    # a token uses k of the E experts of each sparse layer and every other parameter
    assert active_param_count(shape) == param_count(shape) - experts + k * per_expert
    decoder_linears = sum(m.weight.numel() for name, m in model.model.named_modules() if isinstance(m, torch.nn.Linear))
    assert linear_weight_count(shape) == decoder_linears


def test_tiny_qwen3_moe_lora_counts_equal_peft():
    """PEFT's own adapters: "all-linear" (which PEFT maps onto the fused experts and the router),
    explicit ``target_parameters``, and the seven projection names."""
    from peft import LoraConfig, get_peft_model

    shape = model_shape(_tiny("qwen3_moe").config)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    attention_only = lora_param_count(model_shape(TINY["qwen3_moe"] | dict(model_type="qwen3_moe", num_experts=0,
                                                                       mlp_only_layers=[0, 1, 2])), 4)
    cases = {
        "all-linear": (dict(target_modules="all-linear"), lora_param_count(shape, 4)),
        "explicit": (dict(target_modules=[], target_parameters=experts), expert_lora_param_count(shape, 4)),
        "seven": (dict(target_modules=attention + ["gate_proj", "up_proj", "down_proj"]),
                  expert_lora_param_count(shape, 4, gate_up_rank=8) + _attention_lora(shape, 4)
                  + _dense_mlp_lora(shape, 4)),
    }
    for name, (kwargs, want) in cases.items():
        model = get_peft_model(_tiny("qwen3_moe"), LoraConfig(r=4, **kwargs))
        assert _numel(model, lambda n: "lora_" in n) == want, name
    assert attention_only > _attention_lora(shape, 4)  # the dense formula counts MLP adapters too
    oss = model_shape(_tiny("gpt_oss").config)  # no mapping in PEFT: all-linear is attention only
    assert _numel(get_peft_model(_tiny("gpt_oss"), LoraConfig(r=4, target_modules="all-linear")),
                  lambda n: "lora_" in n) == lora_param_count(oss, 4) == _attention_lora(oss, 4)
    explicit = get_peft_model(_tiny("gpt_oss"), LoraConfig(r=4, target_modules=[], target_parameters=experts))
    assert _numel(explicit, lambda n: "lora_" in n) == expert_lora_param_count(oss, 4)


def test_tiny_mixtral_lora_counts_equal_peft():
    """Mixtral: PEFT maps its transformers-4 names (w1 + w3 -> the fused gate_up_proj at rank 2r,
    w2 -> down_proj, gate -> the router's weight), so "all-linear" covers experts and router."""
    from peft import LoraConfig, get_peft_model

    shape = model_shape(_tiny("mixtral").config)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    router = 4 * (shape.hidden + shape.experts) * shape.moe_layers
    cases = {
        "all-linear": (dict(target_modules="all-linear"), lora_param_count(shape, 4)),
        "explicit": (dict(target_modules=[], target_parameters=experts), expert_lora_param_count(shape, 4)),
        "v4 names": (dict(target_modules=attention + ["w1", "w2", "w3"]),
                     expert_lora_param_count(shape, 4, gate_up_rank=8) + _attention_lora(shape, 4)
                     + _dense_mlp_lora(shape, 4)),
    }
    for name, (kwargs, want) in cases.items():
        model = get_peft_model(_tiny("mixtral"), LoraConfig(r=4, **kwargs))
        assert _numel(model, lambda n: "lora_" in n) == want, name
    assert lora_param_count(shape, 4) == expert_lora_param_count(shape, 4, gate_up_rank=8) + _attention_lora(
        shape, 4) + router


def _attention_lora(shape, r: int) -> int:
    H, dq, dkv = shape.hidden, shape.q_dim, shape.kv_dim
    return r * ((H + dq) + 2 * (H + dkv) + (dq + H)) * shape.layers


def _dense_mlp_lora(shape, r: int) -> int:
    """The dense MLP layers' gate/up/down adapters of a MoE model, where the installed PEFT adapts them beside the
    experts (0.22 on; 0.21 mapped the projection names onto the experts only)."""
    if not peft_adapts_dense_mlps_of_moe_models():
        return 0
    H, I = shape.hidden, shape.intermediate
    return r * (2 * (H + I) + (I + H)) * (shape.layers - shape.moe_layers)


# the published sizes: Qwen3-30B-A3B 30.5B total / 3.3B active (embedding table counted), gpt-oss-20b
# 20.9B total / 3.6B active (embedding table not counted, the unembedding is), Mixtral-8x7B 46.7B total
# / 12.9B active (embedding table counted)
PUBLISHED = {"qwen3-30b-a3b": (30.5e9, 3.3e9, True), "gpt-oss-20b": (20.9e9, 3.6e9, False),
             "mixtral-8x7b": (46.7e9, 12.9e9, True)}


def _real_config(name: str) -> transformers.PretrainedConfig:
    """The benchmarks' random-init shape, or (a shape the benchmarks do not list) the planner's table
    entry as a transformers config."""
    if name in MODEL_SHAPES:
        return model_config(name)
    fields = dict(KNOWN_MODELS[name])
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_moe_shapes_count_the_meta_model(name):
    config = _real_config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shape = model_shape(name)
    assert shape == model_shape(config)  # the table and the config built from it agree
    assert param_count(shape) == _numel(model, lambda n: True)
    total, active, embedding = PUBLISHED[name]
    assert abs(param_count(shape) - total) < 0.01 * total
    assert abs(active_param_count(shape, embedding=embedding) - active) < 0.02 * active
    assert active_param_count(shape) - active_param_count(shape, embedding=False) == shape.vocab * shape.hidden
    assert name in MODEL_SHAPES  # the benchmarks build the same shape


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_planner_counts_every_expert_weight(name):
    """Full fine-tuning in bf16 holds every expert's weights (not only the active ones)."""
    plan = plan_memory(name, 4096, 16, full_finetune=True)
    weights = param_count(model_shape(name)) * 2
    assert plan.weights == weights


def test_planner_counts_each_tokens_chosen_experts_in_the_activations():
    """The MoE layer saves k expert-width activations per token (not the config's dense
    intermediate_size, which gpt-oss sets to one expert's width) and the routing; untiled also, per routed
    row, the sort's indices, the gathered input and the expert output (tiled, they live inside a tile;
    measured in test_planner.py)."""
    import dataclasses

    from swiftune.memory.planner import TrainSetup, layer_saved_bytes
    from swiftune.memory.shapes import KNOWN_MODELS, model_shape

    shape = model_shape(KNOWN_MODELS["gpt-oss-20b"])
    assert shape.is_moe and shape.active_intermediate == 4 * 2880
    dense_equivalent = dataclasses.replace(shape, experts=0, intermediate=shape.active_intermediate)
    H, E, k = shape.hidden, shape.experts, shape.experts_per_token
    untiled, tiled = TrainSetup(full_finetune=True, tiled_mlp=False), TrainSetup(full_finetune=True, tiled_mlp=True)
    b = untiled.dtype_bytes
    routing = E * 4 + k * 16 + 4
    assert (layer_saved_bytes(shape, 1000, untiled)
            == layer_saved_bytes(dense_equivalent, 1000, untiled) + 1000 * (routing + k * (16 + 2 * H * b)))
    assert (layer_saved_bytes(shape, 1000, tiled)
            == layer_saved_bytes(dense_equivalent, 1000, tiled) + 1000 * routing)
    fewer = dataclasses.replace(shape, experts_per_token=2)
    for setup in (untiled, tiled):
        assert layer_saved_bytes(fewer, 1000, setup) < layer_saved_bytes(shape, 1000, setup)


def test_plan_counts_expert_adapters_given_as_target_parameters():
    """``lora_experts``: the plan's trainable parameters are PEFT's own count for all-linear plus explicit expert
    ``target_parameters`` (gpt-oss, where all-linear reaches only the attention), with their gradients and AdamW
    states; on Qwen3-MoE, whose experts all-linear already adapts, nothing changes. ``swiftune plan
    --lora_experts`` asks for it."""
    from peft import LoraConfig, get_peft_model

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config = _tiny("gpt_oss").config.to_dict()
    with_experts = plan_memory(config, 512, 4, lora_experts=True)
    plain = plan_memory(config, 512, 4)
    peft_count = _numel(get_peft_model(_tiny("gpt_oss"), LoraConfig(r=4, target_modules="all-linear",
                                                                     target_parameters=experts)),
                        lambda n: "lora_" in n)
    assert with_experts.trainable_params == peft_count > plain.trainable_params
    added = with_experts.trainable_params - plain.trainable_params
    assert (with_experts.trainable - plain.trainable, with_experts.gradients - plain.gradients,
            with_experts.optimizer - plain.optimizer) == (4 * added, 4 * added, 8 * added)
    moe = _tiny("qwen3_moe").config.to_dict()
    assert plan_memory(moe, 512, 4, lora_experts=True).trainable_params == plan_memory(moe, 512, 4).trainable_params


def test_plan_command_takes_lora_experts(capsys):
    from swiftune.cli import main

    assert main(["plan", "--model", "gpt-oss-20b", "--tokens", "4096", "--gpu_gb", "80", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "gpt-oss-20b", "--tokens", "4096", "--gpu_gb", "80", "--json", "--lora_experts"]) == 0
    experts = json.loads(capsys.readouterr().out)
    assert experts["plan"]["trainable_params"] - plain["plan"]["trainable_params"] == 176_947_200
