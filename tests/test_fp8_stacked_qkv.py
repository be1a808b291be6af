"""q/k/v's FP8 products as one (``quantize_model_fp8``'s adjacent layout, ``stacked_fp8_products``,
``FastRolloutEngine(fp8_stacked_qkv=True)``).

References, never the stacked path itself: each projection's own call (the FP8 layer, or PEFT's LoRA layer over
it: its own forward), per-row quantisation of the unquantised weights (``quantize_rowwise``), and the engine's
decoding with three products a layer (the same greedy tokens and log-probabilities). On the CPU the FP8 kernels run through the Triton interpreter (tests/conftest.py); ``_scaled_mm``'s path (18+ rows) is
switched on by hand, as tests/test_fp8_shared_quant.py does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import swiftune.models.fp8_linear as fl
import swiftune.models.lora_linear as ll
import swiftune.rl.rollout.layers as rollout_layers
from tests.helpers import tiny_model


def _fp8_model(dtype: torch.dtype = torch.bfloat16, scaled_mm: bool = False) -> tuple[nn.Module, nn.Module]:
    reference = tiny_model("qwen3").to(dtype).eval()
    model = copy.deepcopy(reference)
    fl.quantize_model_fp8(model, scaled_mm=scaled_mm)
    return reference, model


def _qkv(attn: nn.Module) -> list[nn.Module]:
    return [getattr(attn, name) for name in fl.QKV_NAMES]


def test_quantize_model_lays_qkv_out_adjacent_with_each_layers_own_codes():
    """After ``quantize_model_fp8`` every attention's q/k/v codes and scales are views of one buffer each, in
    that order (one spanning view exists), and equal the per-row quantisation of each unquantised weight; o_proj
    and the MLP keep their own buffers. A layer moved off the buffer (a copy of its weight) breaks the span."""
    reference, model = _fp8_model()
    for ref_layer, layer in zip(reference.model.layers, model.model.layers):
        projections = _qkv(layer.self_attn)
        span = fl.adjacent_rows([p.weight for p in projections])
        scales = fl.adjacent_rows([p.weight_scale for p in projections])
        assert span is not None and scales is not None
        assert span.shape == (sum(p.out_features for p in projections), projections[0].in_features)
        for p, ref in zip(projections, _qkv(ref_layer.self_attn)):
            codes, scale = fl.quantize_rowwise(ref.weight.detach())
            assert torch.equal(p.weight.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(p.weight_scale, scale)
        assert fl.adjacent_rows([layer.self_attn.o_proj.weight, layer.mlp.gate_proj.weight]) is None
    k_proj = model.model.layers[0].self_attn.k_proj
    k_proj.weight = nn.Parameter(k_proj.weight.clone(), requires_grad=False)
    assert fl.adjacent_rows([p.weight for p in _qkv(model.model.layers[0].self_attn)]) is None


def _peft_fp8(model: nn.Module, adapter_dtype: torch.dtype = torch.float32) -> nn.Module:
    """LoRA r=8 on q/k/v over the FP8 bases, PEFT's own layers (B made non-zero; the adapters in ``adapter_dtype``:
    PEFT's float32, or the bases' bf16), then swiftune's fused forward."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(fl.QKV_NAMES)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                # drawn on the CPU, so the same values on either device (a CPU generator cannot fill a CUDA tensor)
                param.copy_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
            if "lora_" in name:
                param.data = param.data.to(adapter_dtype)
    ll.fuse_lora_linears(peft_model)
    return peft_model


@pytest.mark.parametrize("rows,scaled_mm", [(3, False), (16, False), (18, True), (40, True)])
@pytest.mark.parametrize("lora", [None, torch.float32, torch.bfloat16], ids=["no-lora", "lora-fp32", "lora-bf16"])
def test_stacked_products_equal_each_projections_own_call(rows, scaled_mm, lora):
    """Weight-only kernel rows (3, 16) and the FP8 x FP8 rows (18, 40, shared codes): the stacked product's
    columns equal each projection's own call under no_grad, bit for bit; with LoRA each adapter's product is
    added to its columns as PEFT's layer (fused) adds it."""
    if scaled_mm:
        from tests.test_fp8 import _require_cpu_scaled_mm

        _require_cpu_scaled_mm()
    _, model = _fp8_model(scaled_mm=scaled_mm)
    model = _peft_fp8(model, lora) if lora else model
    attn = (model.base_model.model if lora else model).model.layers[1].self_attn
    projections = _qkv(attn)
    x = torch.randn(rows, 1, attn.config.hidden_size, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with torch.no_grad():
        shared = ll.shared_fp8_input(x, projections)
        assert bool(shared) == scaled_mm
        got = ll.stacked_fp8_products(projections, x, **shared)
        want = [p(x) for p in projections]
    assert got is not None and len(got) == 3
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)  # the CPU's kernels (interpreter) tile each column alike: the same bits


def test_stacked_products_decline_what_they_do_not_compute():
    """Under autograd, with a bias, with block scales' layers out of the buffer, or a non-FP8 projection: None
    (the caller multiplies each)."""
    _, model = _fp8_model()
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 1, attn.config.hidden_size).to(torch.bfloat16)
    projections = _qkv(attn)
    assert ll.stacked_fp8_products(projections, x) is None  # grad mode on
    with torch.no_grad():
        assert ll.stacked_fp8_products(projections, x) is not None
        attn.v_proj.bias = nn.Parameter(torch.zeros(attn.v_proj.out_features, dtype=torch.bfloat16),
                                        requires_grad=False)
        assert ll.stacked_fp8_products(projections, x) is None
        attn.v_proj.bias = None
        plain = tiny_model("qwen3").to(torch.bfloat16).model.layers[0].self_attn
        assert ll.stacked_fp8_products([attn.q_proj, attn.k_proj, plain.v_proj], x) is None


@pytest.mark.parametrize("lora", [False, True])
def test_engine_with_stacked_qkv_decodes_as_with_three_products(lora, monkeypatch):
    """``FastRolloutEngine(fp8_stacked_qkv=True)`` on an FP8 model (LoRA adapters at run time too): every
    decode step's attention takes the stacked product, and the greedy tokens and log-probabilities equal the
    engine's with three products a layer (on the CPU bit for bit; on CUDA, compiled, to bf16's rounding)."""
    from swiftune.models import patch_model
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CUDA: the compiled kernels, _scaled_mm's FP8 flag
    reference = tiny_model("qwen3").to(torch.bfloat16).to(device).eval()
    fl.quantize_model_fp8(reference)
    model = patch_model(reference)
    model = _peft_fp8(model) if lora else model
    calls = []  # per decode step's attention: did the stacked product run
    stacked = rollout_layers.stacked_fp8_products

    def counted(*args, **kwargs):
        out = stacked(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(rollout_layers, "stacked_fp8_products", counted)
    prompts = [[5, 9, 17, 33, 2], [7, 8, 100, 12]]
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())
    runs = {}
    for on in (False, True):
        calls.clear()
        engine = FastRolloutEngine(model, use_cuda_graph=False, kv_bucket=4, fp8_stacked_qkv=on)
        runs[on] = engine.generate(prompts, 2, params)
        assert (bool(calls) and all(calls)) if on else not calls
    assert runs[True].completion_ids == runs[False].completion_ids
    for got, want in zip(runs[True].logprobs, runs[False].logprobs):
        if device == "cpu":
            assert torch.equal(got, want)
        else:  # a compiled kernel may tile the wider product's columns otherwise: bf16 roundings apart
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
