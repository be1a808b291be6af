"""q/k/v's and gate/up's FP8 products as one each (``quantize_model_fp8``'s adjacent layout,
``stacked_fp8_products``, ``FastRolloutEngine(fp8_stacked_qkv=True, fp8_stacked_gate_up=True)``, the decode
step's ``decode_mlp``).

References, never the stacked path itself: each projection's own call (the FP8 layer, or PEFT's LoRA layer over
it: its own forward), transformers' own MLP forward over them, per-row quantisation of the unquantised weights
(``quantize_rowwise``), and the engine's decoding with a product per projection (the same greedy tokens and
log-probabilities). On the CPU the FP8 kernels run through the Triton interpreter (tests/conftest.py);
``_scaled_mm``'s path (18+ rows) is switched on by hand, as tests/test_fp8_shared_quant.py does.
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


def _gate_up(mlp: nn.Module) -> list[nn.Module]:
    return [getattr(mlp, name) for name in fl.GATE_UP_NAMES]


def test_quantize_model_lays_qkv_and_gate_up_out_adjacent_with_each_layers_own_codes():
    """After ``quantize_model_fp8`` every attention's q/k/v codes and scales are views of one buffer each, in
    that order (one spanning view exists), and so are every MLP's gate/up; each equals the per-row quantisation
    of its unquantised weight; o_proj and down_proj keep their own buffers. A layer moved off the buffer (a copy
    of its weight) breaks the span."""
    reference, model = _fp8_model()
    for ref_layer, layer in zip(reference.model.layers, model.model.layers):
        for group, ref_group in ((_qkv(layer.self_attn), _qkv(ref_layer.self_attn)),
                                 (_gate_up(layer.mlp), _gate_up(ref_layer.mlp))):
            span = fl.adjacent_rows([p.weight for p in group])
            scales = fl.adjacent_rows([p.weight_scale for p in group])
            assert span is not None and scales is not None
            assert span.shape == (sum(p.out_features for p in group), group[0].in_features)
            for p, ref in zip(group, ref_group):
                codes, scale = fl.quantize_rowwise(ref.weight.detach())
                assert torch.equal(p.weight.view(torch.uint8), codes.view(torch.uint8))
                assert torch.equal(p.weight_scale, scale)
        assert fl.adjacent_rows([layer.self_attn.o_proj.weight, layer.mlp.gate_proj.weight]) is None
        assert fl.adjacent_rows([layer.mlp.up_proj.weight, layer.mlp.down_proj.weight]) is None
    k_proj = model.model.layers[0].self_attn.k_proj
    k_proj.weight = nn.Parameter(k_proj.weight.clone(), requires_grad=False)
    assert fl.adjacent_rows([p.weight for p in _qkv(model.model.layers[0].self_attn)]) is None


def _peft_fp8(model: nn.Module, adapter_dtype: torch.dtype = torch.float32) -> nn.Module:
    """LoRA r=8 on q/k/v and gate/up over the FP8 bases, PEFT's own layers (B made non-zero; the adapters in
    ``adapter_dtype``: PEFT's float32, or the bases' bf16), then swiftune's fused forward."""
    from peft import LoraConfig, get_peft_model

    targets = [*fl.QKV_NAMES, *fl.GATE_UP_NAMES]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
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
@pytest.mark.parametrize("group", ["qkv", "gate_up"])
def test_stacked_products_equal_each_projections_own_call(rows, scaled_mm, lora, group):
    """Weight-only kernel rows (3, 16) and the FP8 x FP8 rows (18, 40, shared codes): the stacked product's
    columns equal each projection's own call under no_grad, bit for bit; with LoRA each adapter's product is
    added to its columns as PEFT's layer (fused) adds it."""
    if scaled_mm:
        from tests.test_fp8 import _require_cpu_scaled_mm

        _require_cpu_scaled_mm()
    _, model = _fp8_model(scaled_mm=scaled_mm)
    model = _peft_fp8(model, lora) if lora else model
    layer = (model.base_model.model if lora else model).model.layers[1]
    projections = _qkv(layer.self_attn) if group == "qkv" else _gate_up(layer.mlp)
    x = torch.randn(rows, 1, layer.self_attn.config.hidden_size,
                    generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with torch.no_grad():
        shared = ll.shared_fp8_input(x, projections)
        assert bool(shared) == scaled_mm
        got = ll.stacked_fp8_products(projections, x, **shared)
        want = [p(x) for p in projections]
    assert got is not None and len(got) == len(projections)
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


@pytest.mark.parametrize("rows,scaled_mm,glu_codes", [(3, False, False), (40, True, False), (40, True, True)])
@pytest.mark.parametrize("lora", [False, True])
def test_decode_mlp_equals_transformers_mlp_forward(rows, scaled_mm, glu_codes, lora):
    """The decode step's MLP with gate/up as one product (the activation reading its two halves in place) gives
    transformers' own MLP forward over the same layers (``type(mlp).forward``: each projection's own call,
    ``act_fn(gate) * up``, then down) to bf16's rounding of the activation (the GLU kernel's, see
    tests/test_glu_rows.py), and the patched module's own forward (three products) bit for bit on the CPU; LoRA
    adapters on gate/up (PEFT's layers) too. ``glu_codes``: the activation also makes down_proj's input codes
    (``glu_fp8``; 40 rows quantise), the same comparisons."""
    from swiftune.models import patch_model

    if scaled_mm:
        from tests.test_fp8 import _require_cpu_scaled_mm

        _require_cpu_scaled_mm()
    _, model = _fp8_model(scaled_mm=scaled_mm)
    model = patch_model(model)
    model = _peft_fp8(model) if lora else model
    mlp = (model.base_model.model if lora else model).model.layers[0].mlp
    x = torch.randn(rows, 1, mlp.config.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    calls, made = [], []
    stacked, glu = rollout_layers.stacked_fp8_products, rollout_layers.gated_activation_fp8
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout_layers, "stacked_fp8_products", lambda *a, **k: calls.append(1) or stacked(*a, **k))
        mp.setattr(rollout_layers, "gated_activation_fp8", lambda *a: made.append(1) or glu(*a))
        got = rollout_layers.decode_mlp(mlp, x, glu_codes=glu_codes)
        want = type(mlp).forward(mlp, x)
        own = mlp(x)
    assert calls and got.shape == want.shape and got.abs().sum() > 0
    assert len(made) == int(glu_codes)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * want.float().abs().max().item())
    assert torch.equal(got, own)


def test_decode_mlp_runs_the_modules_own_forward_where_it_cannot_stack():
    """A bf16 MLP (nothing laid out), or gate/up moved off their buffer: the module's forward, the same result."""
    from swiftune.models import patch_model

    plain = patch_model(tiny_model("qwen3").to(torch.bfloat16).eval())
    _, fp8 = _fp8_model()
    fp8 = patch_model(fp8)
    up = fp8.model.layers[0].mlp.up_proj
    up.weight = nn.Parameter(up.weight.clone(), requires_grad=False)
    for mlp in (plain.model.layers[0].mlp, fp8.model.layers[0].mlp):
        x = torch.randn(2, 1, mlp.config.hidden_size).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(rollout_layers.decode_mlp(mlp, x), mlp(x))


@pytest.mark.parametrize("lora", [False, True])
def test_engine_with_stacked_products_decodes_as_with_a_product_per_projection(lora, monkeypatch):
    """``FastRolloutEngine(fp8_stacked_qkv=..., fp8_stacked_gate_up=...)`` on an FP8 model (LoRA adapters at run
    time too): every decode step's attention (and MLP) takes the stacked product, and the greedy tokens and
    log-probabilities equal the engine's with a product per projection (on the CPU bit for bit; on CUDA,
    compiled, to bf16's rounding)."""
    from swiftune.models import patch_model
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CUDA: the compiled kernels, _scaled_mm's FP8 flag
    reference = tiny_model("qwen3").to(torch.bfloat16).to(device).eval()
    fl.quantize_model_fp8(reference)
    model = patch_model(reference)
    model = _peft_fp8(model) if lora else model
    calls = []  # per decode step's attention and MLP: did the stacked product run
    stacked = rollout_layers.stacked_fp8_products

    def counted(*args, **kwargs):
        out = stacked(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(rollout_layers, "stacked_fp8_products", counted)
    prompts = [[5, 9, 17, 33, 2], [7, 8, 100, 12]]
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())
    runs, counts = {}, {}
    for qkv, gate_up in ((False, False), (True, False), (True, True)):
        calls.clear()
        engine = FastRolloutEngine(model, use_cuda_graph=False, kv_bucket=4, fp8_stacked_qkv=qkv,
                                   fp8_stacked_gate_up=gate_up)
        runs[qkv, gate_up] = engine.generate(prompts, 2, params)
        assert all(calls)
        counts[qkv, gate_up] = len(calls)
    assert counts[False, False] == 0 and counts[True, False] > 0 and counts[True, True] == 2 * counts[True, False]
    for on in ((True, False), (True, True)):
        assert runs[on].completion_ids == runs[False, False].completion_ids
        for got, want in zip(runs[on].logprobs, runs[False, False].logprobs):
            if device == "cpu":
                assert torch.equal(got, want)
            else:  # a compiled kernel may tile the wider product's columns otherwise: bf16 roundings apart
                torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
