"""The memory planner: exact parameter counts against real models, monotonicity, max_tokens, CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftune.data import tiny_model_config
from swiftune.cli.plan import main_plan
from swiftune.memory import (
    KNOWN_MODELS,
    lora_param_count,
    max_tokens,
    model_shape,
    param_count,
    plan_memory,
)
from swiftune.memory.planner import TrainSetup, layer_saved_bytes, pinned_slot_bytes

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]


def _real_count(cfg) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [True, False])
def test_param_count_matches_real_models(family, tied):
    cfg = tiny_model_config(family, tie_word_embeddings=tied, num_hidden_layers=3, intermediate_size=200)
    assert param_count(model_shape(cfg)) == _real_count(cfg)


@pytest.mark.parametrize("overrides", [dict(attention_bias=True), dict(mlp_bias=True), dict(head_dim=48)])
def test_param_count_with_biases_and_odd_head_dim(overrides):
    cfg = tiny_model_config("llama", **overrides)
    assert param_count(model_shape(cfg)) == _real_count(cfg)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama3-8b"])
def test_param_count_of_known_shapes_matches_transformers(name):
    from transformers import AutoConfig

    shape = dict(KNOWN_MODELS[name])
    cfg = AutoConfig.for_model(shape.pop("model_type"), **shape)
    assert param_count(model_shape(cfg)) == _real_count(cfg) == param_count(model_shape(name))
    # published sizes
    assert param_count(model_shape("llama3-8b")) == 8_030_261_248


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_lora_param_count_matches_peft(family):
    from peft import LoraConfig, get_peft_model

    cfg = tiny_model_config(family, num_hidden_layers=2)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=8, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(model_shape(cfg), 8) == trainable


def test_qwen3_8b_checkpoint_bytes_per_token():
    plan = plan_memory("qwen3-8b", 1000, gradient_checkpointing=True)
    assert plan.checkpoints == 1000 * 36 * 4096 * 2  # 288 KB per token
    assert plan.kept_layers == 36 and plan.offloaded_layers == 0 and plan.host_bytes == 0


MODES = [
    dict(gradient_checkpointing=True),
    dict(gradient_checkpointing=False),
    dict(gradient_checkpointing="offload", gpu_bytes=int(141e9)),
    dict(gradient_checkpointing=True, full_finetune=True),
    dict(gradient_checkpointing=True, chunked_loss=False, tiled_mlp=False),
    dict(gradient_checkpointing="offload", gpu_bytes=int(141e9), tiled_projections=True, lora_dtype_bytes=2),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items() if k != "gpu_bytes"))
def test_plan_is_monotone_in_tokens(mode):
    sizes = [1, 100, 4095, 4096, 4097, 8192, 65_536, 131_072, 400_000]
    plans = [plan_memory("qwen3-8b", t, 16, **mode) for t in sizes]
    totals = [p.total for p in plans]
    assert totals == sorted(totals)
    for a, b in zip(plans, plans[1:]):
        assert b.layer_working_set >= a.layer_working_set and b.loss >= a.loss
        assert b.host_bytes >= a.host_bytes


def test_offload_plan_keeps_fewer_layers_as_tokens_grow_and_stays_under_the_gpu():
    gpu = int(141e9)
    kept = []
    for t in (32_768, 131_072, 262_144, 400_000):
        plan = plan_memory("qwen3-8b", t, gradient_checkpointing="offload", gpu_bytes=gpu)
        assert plan.fits and plan.total <= gpu
        assert plan.kept_layers + plan.offloaded_layers == 36
        assert plan.host_bytes == plan.offloaded_layers * pinned_slot_bytes(t * 4096 * 2)
        assert t * 4096 * 2 <= pinned_slot_bytes(t * 4096 * 2) < t * 4096 * 2 + 64 * 2**20  # whole 64 MiB pages
        kept.append(plan.kept_layers)
    assert kept == sorted(kept, reverse=True) and kept[0] == 36 and kept[-1] < 36
    # offloading reaches further than keeping every checkpoint on the GPU, which reaches further
    # than full logits without tiling
    off = max_tokens("qwen3-8b", gpu, gradient_checkpointing="offload")
    on = max_tokens("qwen3-8b", gpu, gradient_checkpointing=True)
    plain = max_tokens("qwen3-8b", gpu, gradient_checkpointing=True, chunked_loss=False, tiled_mlp=False)
    assert off > on > plain > 0


@pytest.mark.parametrize("tokens", [65_536, 300_000, 409_600, 600_000])
@pytest.mark.parametrize("tiled", [True, False])
def test_offload_plan_keeps_the_layers_the_runtime_budget_keeps(tokens, tiled):
    """The planner's offload split and the runtime's (training/checkpointing.py: free memory at the
    first layer, minus step_reserve, minus offload_margin_bytes, then split_layers) agree."""
    from swiftune.memory.planner import CUDA_CONTEXT_BYTES, offload_margin_bytes, step_reserve
    from swiftune.training.checkpointing import split_layers

    gpu = int(149.3e9)
    plan = plan_memory("qwen3-8b", tokens, gradient_checkpointing="offload", gpu_bytes=gpu,
                       tiled_projections=tiled, kv_expanded=True)
    setup = TrainSetup(lora_rank=16, tiled_projections=tiled, kv_expanded=True)
    per_layer = tokens * 4096 * 2
    resident = plan.weights + plan.trainable + plan.gradients + plan.optimizer
    free_at_first_layer = gpu - CUDA_CONTEXT_BYTES - resident - per_layer  # the embedding output is alive
    budget = free_at_first_layer - step_reserve("qwen3-8b", tokens, setup) - offload_margin_bytes(gpu)
    runtime = split_layers(36, per_layer, budget, host_budget_bytes=2**62)
    assert plan.kept_layers == len(runtime.keep)
    assert plan.host_bytes == runtime.host_bytes
    # a host that holds fewer inputs than are offloaded: the same ones derived, the same pinned bytes,
    # also where the layer input's bytes would fit one more than its whole pages do
    offloaded = 36 - plan.kept_layers
    if offloaded > 1:
        slot = pinned_slot_bytes(per_layer)
        for holds in (offloaded - 1, offloaded // 2 + 1):
            for host in (holds * slot, (holds + 1) * per_layer):
                p = plan_memory("qwen3-8b", tokens, gradient_checkpointing="offload", gpu_bytes=gpu, host_bytes=host,
                                tiled_projections=tiled, kv_expanded=True)
                r = split_layers(36, per_layer, budget, host_budget_bytes=host)
                assert (p.kept_layers, p.offloaded_layers, p.derived_layers, p.host_bytes) == (
                    len(r.keep), len(r.offload), len(r.derived), r.host_bytes), (holds, host)


@pytest.mark.parametrize("mode", MODES[:4], ids=str)
def test_max_tokens_is_the_fitting_boundary(mode):
    gpu = int(mode.pop("gpu_bytes", 80e9))
    best = max_tokens("qwen3-1.7b", gpu, 16, **mode)
    assert best > 0
    assert plan_memory("qwen3-1.7b", best, 16, gpu_bytes=gpu, **mode).fits
    assert not plan_memory("qwen3-1.7b", best + 1, 16, gpu_bytes=gpu, **mode).fits


def test_max_tokens_zero_when_weights_do_not_fit_and_host_limit_applies():
    assert max_tokens("llama3-70b", int(80e9), full_finetune=True) == 0
    free_host = max_tokens("qwen3-8b", int(141e9), gradient_checkpointing="offload")
    small_host = max_tokens("qwen3-8b", int(141e9), gradient_checkpointing="offload", host_bytes=int(20e9))
    assert 0 < small_host < free_host


def test_tiling_and_projection_tiling_shrink_the_layer_working_set():
    shape = model_shape("qwen3-8b")
    t = 131_072
    untiled = layer_saved_bytes(shape, t, TrainSetup(tiled_mlp=False))
    tiled = layer_saved_bytes(shape, t, TrainSetup(tiled_mlp=True))
    both = layer_saved_bytes(shape, t, TrainSetup(tiled_mlp=True, tiled_projections=True))
    assert both < tiled < untiled


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError):
        plan_memory("qwen3-8b", 0)
    with pytest.raises(ValueError):
        plan_memory("qwen3-8b", 10, gradient_checkpointing="sometimes")
    with pytest.raises(ValueError):
        plan_memory("no-such-model", 10)
    with pytest.raises(TypeError):
        plan_memory("qwen3-8b", 10, not_an_option=1)
    # values that once gave a plan for nothing: a negative GPU or host, a rank-0 adapter, an empty loss chunk
    for kwargs, needle in ((dict(gpu_bytes=-5 * 10**9), "GPU's memory must be > 0"),
                           (dict(gpu_bytes=0), "GPU's memory must be > 0"),
                           (dict(host_bytes=-1, gradient_checkpointing="offload"), "must be >= 0 bytes"),
                           (dict(lora_rank=0), "LoRA rank must be a whole number >= 1"),
                           (dict(logit_chunk_tokens=0), "logit_chunk_tokens must be >= 1")):
        with pytest.raises(ValueError, match=needle):
            plan_memory("qwen3-8b", 10, **kwargs)
    assert plan_memory("qwen3-8b", 10, lora_rank=0, full_finetune=True).trainable_params > 0  # no adapters there


def test_model_shape_sources_agree(tmp_path):
    cfg = tiny_model_config("gemma2")
    cfg.save_pretrained(tmp_path)
    from_dir = model_shape(str(tmp_path))
    from_file = model_shape(str(tmp_path / "config.json"))
    assert from_dir == from_file == model_shape(cfg) == model_shape(cfg.to_dict())
    assert from_dir.norms_per_layer == 4


def test_cli_prints_table_and_max_tokens(capsys, tmp_path):
    assert main_plan(["--model", "qwen3-8b", "--tokens", "65536", "--lora_rank", "16", "--gpu_gb", "141"]) == 0
    out = capsys.readouterr().out
    assert "layer checkpoints (GPU)" in out and "largest context that fits 141.0 GB" in out
    tiny_model_config("qwen3").save_pretrained(tmp_path)
    assert main_plan(["--model", str(tmp_path / "config.json"), "--tokens", "1024", "--gpu_gb", "24",
                      "--gradient_checkpointing", "offload", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["tokens"] == 1024 and data["max_tokens"] > 1024
    assert main_plan(["--model", "no-such-model"]) == 2


def test_cli_refuses_what_training_refuses_and_files_that_are_not_configs(capsys, tmp_path):
    base = ["--model", "qwen3-8b", "--tokens", "8192", "--gradient_checkpointing", "offload"]
    assert main_plan(base + ["--offload_attention_output_layers", "36"]) == 0
    capsys.readouterr()
    for layers in ("37", "-2"):  # training's check: 0..36 for this model; the plan counted 100 or -2 layers
        assert main_plan(base + ["--offload_attention_output_layers", layers]) == 2
        err = capsys.readouterr().err
        assert "from 0 (keep none) to the model's 36 decoder layers" in err and f"got {layers}" in err
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert main_plan(["--model", str(rows)]) == 2
    assert "rows.jsonl is not a model's config.json" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"lr": 1}')
    assert main_plan(["--model", str(other)]) == 2
    assert "the model config has no hidden_size" in capsys.readouterr().err
    other.write_text('[1, 2]')
    assert main_plan(["--model", str(other)]) == 2
    assert "holds a JSON list, not a model's config.json" in capsys.readouterr().err


def test_cli_flex_attention_keeps_kv_heads_and_bf16_dq(capsys):
    """--flex_attention: the working set loses the K/V expansion and the float32 dq accumulator,
    per token 2 x 2 (dq - dkv) b + dq 4 on the attention phase (Qwen3-8B: 2 x 2 x 3072 x 2 + 4096 x 4)."""
    base = ["--model", "qwen3-8b", "--tokens", "262144", "--gpu_gb", "150", "--tiled_projections",
            "--gradient_checkpointing", "offload", "--autocast", "--json"]
    plans = []
    for extra in ([], ["--flex_attention"]):
        assert main_plan(base + extra) == 0
        plans.append(json.loads(capsys.readouterr().out))
    (default, flex) = plans
    per_token = 2 * 2 * (4096 - 1024) * 2 + 4096 * 4
    assert default["plan"]["layer_working_set"] - flex["plan"]["layer_working_set"] == 262144 * per_token
    assert flex["max_tokens"] > default["max_tokens"]
    # --sdpa_attention: K/V keep their heads, the float32 dq stays (one sequence: the whole row),
    # and the output projection saves the documents' concatenated outputs (dq b) once more
    assert main_plan(base + ["--sdpa_attention"]) == 0
    sdpa = json.loads(capsys.readouterr().out)
    per_token = 2 * 2 * (4096 - 1024) * 2 - 4096 * 2
    assert default["plan"]["layer_working_set"] - sdpa["plan"]["layer_working_set"] == 262144 * per_token
    assert flex["max_tokens"] > sdpa["max_tokens"] > default["max_tokens"]
    assert main_plan(base + ["--sdpa_attention", "--flex_attention"]) == 2


@pytest.mark.parametrize("casts", [True, False], ids=["casts", "no_casts"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
def test_lora_saved_bytes_match_autograd(autocast, lora_dtype, casts):
    """What one PEFT LoRA linear saves per token, measured with saved-tensor hooks, against the
    planner's term (``_lora_input_bytes``), with float32 / bf16 adapters, with and without autocast,
    with PEFT's input casts on or switched off (the trainers' bf16 steps)."""
    from peft import LoraConfig, get_peft_model

    from swiftune.memory.planner import _lora_input_bytes
    from swiftune.training.lora_casting import lora_input_casting

    H, out, r, T = 48, 80, 8, 37

    class Up(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(H, out, bias=False)

        def forward(self, x):
            return self.up(x)

    torch.manual_seed(0)
    model = get_peft_model(Up().to(torch.bfloat16), LoraConfig(r=r, target_modules=["up"]))
    if lora_dtype == torch.bfloat16:
        model.to(torch.bfloat16)
    assert model.base_model.model.up.lora_A["default"].weight.dtype == lora_dtype
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    inp = x * 1  # the layer's input: a non-leaf activation, as in a model
    saved: list[torch.Tensor] = []
    if not casts and not autocast and lora_dtype == torch.float32:
        # why the trainers keep the casts without autocast: bf16 inputs cannot meet float32 adapters
        with lora_input_casting(model, False), pytest.raises(RuntimeError, match="dtype"):
            model(inp)
        return
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), lora_input_casting(model, casts):
            model(inp)
    per_token = [t for t in saved if t.dim() == 2 and t.shape[0] == T]  # weights are not per token
    own = sum(t.numel() * t.element_size() for t in per_token if t.data_ptr() != inp.data_ptr()) // T
    shares_input = any(t.data_ptr() == inp.data_ptr() for t in per_token)
    setup = TrainSetup(lora_rank=r, lora_dtype_bytes=4 if lora_dtype == torch.float32 else 2, autocast=autocast,
                       lora_input_casts=casts)
    assert own == _lora_input_bytes(H, setup)
    # no copy: the adapters save the shared input itself (the planner counts it once per input)
    assert shares_input == (not setup.lora_copies_input)
    assert setup.lora_copies_input == (lora_dtype == torch.float32 and (casts or not autocast))


def _saved_bytes_per_token(block: torch.nn.Module, hidden: int, tiled: bool) -> float:
    """Bytes a MoE block's forward saves per token beyond its input and its weights, measured with
    saved-tensor hooks at two token counts (the difference drops what does not grow with T)."""
    from swiftune.models.tiled_mlp import tiled_moe_forward

    totals = []
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    for tokens in (64, 128):
        inp = torch.randn(1, tokens, hidden, requires_grad=True) * 1  # an activation, as in a model
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            tiled_moe_forward(block, inp, 16) if tiled else block(inp)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        totals.append(sum(n for ptr, n in storages.items()
                          if ptr not in params and ptr != inp.untyped_storage().data_ptr()))
    return (totals[1] - totals[0]) / 64


def _activation_saved_bytes_per_row(experts: torch.nn.Module, family: str, width: int) -> float:
    """Bytes the patched experts' activation saves per routed row of ``[gate | up]`` (``2 width``
    columns; gpt-oss: transformers' own clamped GLU on interleaved columns, else the reference SwiGLU)."""
    from swiftune.kernels import swiglu

    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        if family == "gpt_oss":
            return experts._apply_gate(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return swiglu(gate.contiguous(), up.contiguous(), backend="reference")

    rows = 64
    gate_up = torch.randn(rows, 2 * width, requires_grad=True) * 1
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        activation(gate_up)
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values()) / rows


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_moe_saved_bytes_tiled_and_untiled(family):
    """What a MoE block saves per token, measured, against the planner's MoE term: tiled experts keep
    only the routing (the per-row tensors live inside a tile); swiftune's untiled experts (patched) keep the
    routing, the sort's two indices, each routed row's gathered input and its expert output, beside the
    activation's own tensors and the down projection's input, which the dense part of the term counts."""
    from swiftune.models import patch_model
    from tests.test_moe_parity import tiny_moe

    model = tiny_moe(family).train()
    cfg = model.config
    hidden, k = cfg.hidden_size, cfg.num_experts_per_tok
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    shape = model_shape(cfg)
    # the same layer as a dense MLP of the active width: the planner's MoE term is the difference
    plain = dataclasses.replace(shape, experts=0, intermediate=shape.active_intermediate)
    term = {}
    for tiled in (True, False):
        setup = TrainSetup(lora_rank=0, full_finetune=True, dtype_bytes=4, tiled_mlp=tiled)
        term[tiled] = layer_saved_bytes(shape, 1, setup) - layer_saved_bytes(plain, 1, setup)
    routing = experts * 4 + k * 16 + 4
    assert term[True] == routing and term[False] == routing + k * (16 + 2 * hidden * 4)
    measured_tiled = _saved_bytes_per_token(model.model.layers[0].mlp, hidden, tiled=True)
    assert 0 < measured_tiled <= term[True]
    block = patch_model(model, kernel_backend="reference").model.layers[0].mlp
    measured_untiled = _saved_bytes_per_token(block, hidden, tiled=False)
    # per routed row, what the dense part counts: the activation's own saved tensors (the CPU reference
    # SwiGLU: the SiLU's input and output and up; gpt-oss's clamped GLU more) and the down projection's input
    width = shape.active_intermediate // k
    dense_rows = _activation_saved_bytes_per_row(block.experts, family, width) + width * 4
    rest = measured_untiled - k * dense_rows
    # within 8 bytes a routed row: gpt-oss's bias gather keeps one more index, its router no renormalised weights
    assert abs(rest - term[False]) <= 8 * k, (rest, term[False])


def test_planner_derives_layer_inputs_like_the_runtime_when_the_host_is_short():
    """Offload with too little host memory: the planner recomputes the inputs the host cannot hold
    (at most every second layer), as split_layers does at run time, and fits where it did not."""
    from swiftune.memory import plan_memory
    from swiftune.training.offload_memory import split_layers

    tokens, gpu = 400_000, 150 * 10**9
    per_layer = tokens * 4096 * 2
    roomy = plan_memory("qwen3-8b", tokens, 16, gradient_checkpointing="offload", gpu_bytes=gpu, host_bytes=10**12)
    assert roomy.derived_layers == 0
    host = (roomy.offloaded_layers - 4) * pinned_slot_bytes(per_layer)  # four inputs short (whole pinned pages)
    short = plan_memory("qwen3-8b", tokens, 16, gradient_checkpointing="offload", gpu_bytes=gpu, host_bytes=host)
    assert short.derived_layers == 4 and short.offloaded_layers == roomy.offloaded_layers - 4
    assert short.kept_layers == roomy.kept_layers and short.host_bytes <= host and short.fits
    assert "recomputed" in short.table()
    runtime = split_layers(36, per_layer, short.kept_layers * per_layer, host)
    assert len(runtime.derived) == short.derived_layers and len(runtime.offload) == short.offloaded_layers
    # more than every second layer missing: no derivation, the plan does not fit
    none = plan_memory("qwen3-8b", tokens, 16, gradient_checkpointing="offload", gpu_bytes=gpu, host_bytes=0)
    assert none.derived_layers == 0 and not none.fits


def test_memory_docs_example_is_the_commands_output(capsys):
    """docs/memory.md shows `swiftune plan`'s output for one command: it must be what the command prints
    (the example had drifted to an older planner's largest context)."""
    import os
    import re
    import shlex

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "memory.md")
    block = re.search(r"```text\n\$ swiftune plan (.*?)\n(memory plan:.*?)```", open(path).read(), re.S)
    argv = shlex.split(block.group(1).replace("\\\n", " "))
    assert main_plan(argv) == 0
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert printed == [line.rstrip() for line in block.group(2).strip().splitlines()]


def test_flex_attention_in_head_groups_is_planned_past_its_int32_offsets():
    """flex's q of 2^31 elements or more runs in groups of heads (attention.backends.flex_in_head_groups): the
    layer being recomputed holds the joined output and the joined dq beside the groups' (2 dq bytes a token
    more), from the first token past the limit; below it the plan is unchanged."""
    from swiftune.attention.backends import FLEX_MAX_ELEMENTS, planner_attention_terms
    from swiftune.memory.planner import layer_working_set

    shape = model_shape(KNOWN_MODELS["gpt-oss-20b"])
    flex = TrainSetup(**planner_attention_terms("flex"))
    never = TrainSetup(**{**planner_attention_terms("flex"), "attention_group_elements": None})
    first_split = FLEX_MAX_ELEMENTS // shape.q_dim + 1  # 524,288 tokens for 64 heads x 64
    assert first_split == 524_288
    below = first_split - 1
    assert layer_working_set(shape, below, flex) == layer_working_set(shape, below, never)
    extra = layer_working_set(shape, first_split, flex) - layer_working_set(shape, first_split, never)
    assert extra == 2 * first_split * shape.q_dim * flex.dtype_bytes
