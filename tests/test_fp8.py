"""FP8 frozen base weights (``load_in_fp8=True``): e4m3 with float32 per-row scales.

Reference: the plain libraries, unpatched: transformers' own model (eager attention) with each
decoder projection's weight replaced by the dequantised FP8 weight ``Q * s`` (computed here in plain
torch from the stored codes, which are checked against this file's own quantisation of the
checkpoint), PEFT's own LoRA on top, run on each document alone. Compared: the loss and every LoRA
tensor's gradient, non-zero where the reference's is. Accuracy against the unquantised model is
measured (docs/fp8.md has the numbers) and bounded here.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

from transformers import AutoModelForCausalLM  # noqa: E402

from swiftune.data.builtin import build_tokenizer  # noqa: E402
from swiftune.errors import ConfigError  # noqa: E402
from swiftune.memory.planner import fp8_scale_bytes, plan_memory  # noqa: E402
from swiftune.memory.shapes import linear_weight_count, model_shape, param_count  # noqa: E402
from swiftune.models.fp8_linear import FP8Linear, FP8State, fp8_grad_input, fp8_matmul, quantize_model_fp8  # noqa: E402
from swiftune.training import FastModel  # noqa: E402
from swiftune.training.quantization import check_fp8_request, is_quantized_fp8  # noqa: E402
from tests.helpers import (assert_gradients_match, copy_lora_tensors, lora_tensors, rel_err,  # noqa: E402
                           save_tiny_checkpoints, train_adapters_two_sft_steps)
from tests.test_gradient_parity import PROJECTIONS, _examples, _reference_step, _swiftune_step, _trainable  # noqa: E402

E4M3_MAX = 448.0


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This file's own per-row e4m3 quantisation: s = max|row| / 448, Q = e4m3(W / s)."""
    amax = w.double().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).float()
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _dequantized(layer: FP8Linear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (layer.weight.float() * layer.weight_scale).to(dtype)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return save_tiny_checkpoints(tmp_path_factory)


def _fp8_layers(model: nn.Module) -> dict[str, FP8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}


def _plain_with_weights(path: str, fp8_model: nn.Module) -> nn.Module:
    """transformers' unpatched model whose projections hold ``fp8_model``'s dequantised weights."""
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    layers = {n.removeprefix("base_model.model.").removesuffix(".base_layer"): m
              for n, m in _fp8_layers(fp8_model).items()}
    with torch.no_grad():
        for name, layer in layers.items():
            plain.get_submodule(name).weight.copy_(_dequantized(layer))
    return plain


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_load_in_fp8_stores_e4m3_per_row_and_logits_stay_close(checkpoints, family):
    path = checkpoints[family]
    model, _ = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.float32, device_map="cpu")
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    layers = _fp8_layers(model)
    config = plain.config
    assert len(layers) == 7 * config.num_hidden_layers  # every projection of the decoder, nothing else
    assert is_quantized_fp8(model)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    for name, layer in layers.items():
        want_q, want_s = _quantize(plain.get_submodule(name).weight.detach())
        assert layer.weight.dtype == torch.float8_e4m3fn and not layer.weight.requires_grad
        assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (layer.out_features, 1)
        assert torch.equal(layer.weight.view(torch.uint8), want_q.view(torch.uint8)), name
        assert torch.allclose(layer.weight_scale, want_s, rtol=1e-6, atol=0), name
    ids = torch.randint(0, config.vocab_size - 1, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        got = model(input_ids=ids).logits
        bf16 = plain.to(torch.bfloat16)(input_ids=ids).logits
    # measured on these random models: FP8 ~3e-2 relative error of the logits, bf16 weights ~3e-3
    # (docs/fp8.md); e4m3 keeps 3 mantissa bits, so a per-weight error of up to 2^-4
    err = rel_err(got, want)
    assert 1e-3 < err < 6e-2, err
    assert err > rel_err(bf16, want)


# padding-free rows against documents alone; offloaded checkpointing also tiles the MLP and the
# projections (the FP8 layers run per tile under PEFT)
@pytest.mark.parametrize("family,layout,checkpointing", [("llama", "padding_free", False),
                                                         ("qwen3", "padding_free", "offload"),
                                                         ("qwen3", "padding_free", "graphed")])
def test_fp8_lora_loss_and_gradients_equal_transformers_peft_on_dequantised_weights(
        checkpoints, family, layout, checkpointing, monkeypatch):
    """``graphed``: checkpointing with CUDA-graphed decoder layers (closures in place of replays off CUDA)."""
    from swiftune.models.lora_linear import LoRALinearFunction
    from swiftune.training.layer_graphs import enable_graphed_layers, graphed_layer_stats

    path = checkpoints[family]
    model, _ = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.float32, device_map="cpu")
    budget = {"offload_gpu_budget_bytes": 0} if checkpointing == "offload" else {}
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                     use_gradient_checkpointing=True if checkpointing == "graphed" else checkpointing,
                                     init_lora_weights=False, **budget)
    if checkpointing == "graphed":
        enable_graphed_layers(model, min_bucket_tokens=16)  # the interpreted kernels run on the padded bucket
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0, init_lora_weights=False)
    reference = peft.get_peft_model(_plain_with_weights(path, model), config).train()
    got = copy_lora_tensors(reference, model)
    assert all(p.dtype == torch.float32 for p in got.values())  # the adapters keep the model's dtype, not e4m3
    ref_loss, ref_grads = _reference_step(reference, _examples())
    calls = []
    apply = LoRALinearFunction.apply
    monkeypatch.setattr(LoRALinearFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    loss, grads = _swiftune_step(model.train(), _examples(), layout)
    assert calls, "the FP8 projections train through the fused LoRA node"
    if checkpointing == "graphed":
        stats = graphed_layer_stats(model)
        assert stats["graphed_forwards"] == 1 and stats["fallback_forwards"] == 0, stats
    assert rel_err(loss, ref_loss) < 1e-5, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, _trainable(reference), 1e-4)
    assert set(ref_grads) == set(_trainable(reference)), "every adapter gets a gradient"


def _require_cpu_scaled_mm() -> None:
    """Skip where this CPU torch has no ``_scaled_mm`` with per-row scales (the GPU path's CPU run)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"torch._scaled_mm with per-row scales does not run on this CPU torch: {e}")


def test_scaled_mm_path_matches_the_dequantising_reference():
    """The ``torch._scaled_mm`` path (activations quantised per row on the fly) against the
    reference path and float64; CPU torch has ``_scaled_mm`` too, so this runs here (on the GPU,
    :func:`test_cuda_fp8_linear_runs_scaled_mm` below)."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    layer = FP8Linear.from_linear(linear, scaled_mm=False)
    x = torch.randn(40, 128).to(torch.bfloat16)
    g = torch.randn(40, 96).to(torch.bfloat16)
    w64 = (layer.weight.double() * layer.weight_scale.double())
    _require_cpu_scaled_mm()
    fast = fp8_matmul(x, layer.weight, FP8State(layer.weight_scale, True), torch.bfloat16)
    ref = fp8_matmul(x, layer.weight, FP8State(layer.weight_scale, False), torch.bfloat16)
    exact = x.double() @ w64.t()
    # measured: ~3e-2 (the activation's own e4m3 rounding); the reference only rounds to bf16
    assert rel_err(fast, exact) < 5e-2 and rel_err(ref, exact) < 1e-2
    assert rel_err(fast, exact) > rel_err(ref, exact)
    dx_fast = fp8_grad_input(g, layer.weight, FP8State(layer.weight_scale, True), torch.bfloat16)
    dx_exact = g.double() @ w64
    assert rel_err(dx_fast, dx_exact) < 5e-2
    assert rel_err(fp8_grad_input(g, layer.weight, FP8State(layer.weight_scale, False), torch.bfloat16),
                   dx_exact) < 1e-2
    # through the module and autograd: the bias, the input gradient
    layer.scaled_mm = True
    layer.bias.requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    y = layer(xr)
    y.backward(g)
    assert rel_err(y, exact + linear.bias.double()) < 5e-2
    assert rel_err(xr.grad, dx_exact) < 5e-2
    assert torch.allclose(layer.bias.grad.float(), g.float().sum(0), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
def test_cuda_fp8_linear_runs_scaled_mm(monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = FP8Linear.from_linear(linear)
    assert layer.scaled_mm  # chosen from the device
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))
    x = torch.randn(2, 512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    y.backward(g)
    assert len(calls) == 2, "forward and input gradient on the FP8 tensor cores"
    w64 = layer.weight.double() * layer.weight_scale.double()
    assert rel_err(y, x.detach().double() @ w64.t()) < 5e-2
    assert rel_err(x.grad, g.double() @ w64) < 5e-2


def test_adapters_of_an_fp8_model_train_and_load_in_plain_peft(checkpoints, tmp_path):
    from swiftune.models.lora_linear import is_fused_lora

    path = checkpoints["qwen3"]
    # the reference kernel backend: PEFT's own lora.Linear forward over FP8Linear trains here (the
    # fused LoRA node is the parity test's)
    model, tokenizer = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.float32, device_map="cpu",
                                                 kernel_backend="reference")
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    assert not any(is_fused_lora(m) for m in model.modules())
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    train_adapters_two_sft_steps(model, tokenizer, str(tmp_path / "run"))
    after = lora_tensors(model)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(frozen[n].view(torch.uint8), p.view(torch.uint8)), f"{n}: an FP8 weight changed"
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([tokenizer("Reverse: abc\n")["input_ids"]])
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    # plain PEFT on the unquantised base: the adapters load under their own names, unchanged
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                            tmp_path / "adapter").eval()
    for name, p in lora_tensors(loaded).items():
        assert torch.equal(p, after[name].detach()), name
    # and on a base holding the dequantised FP8 weights: the same model as the FP8 one
    on_fp8 = peft.PeftModel.from_pretrained(_plain_with_weights(path, model), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert rel_err(on_fp8(input_ids=ids).logits, want) < 1e-5


def test_a_saved_fp8_model_is_an_ordinary_checkpoint_of_its_dequantised_weights(checkpoints, tmp_path):
    """save_pretrained of an FP8 model writes Q * s in the compute dtype (it wrote the e4m3 codes as the
    weights, which read back 448 / max|w| times too large): plain transformers reloads the FP8 model's
    own function, load_in_fp8 reloads its own codes, and load_state_dict round-trips."""
    path = checkpoints["qwen3"]
    model, tokenizer = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.float32, device_map="cpu")
    model.save_pretrained(str(tmp_path / "saved"))
    tokenizer.save_pretrained(str(tmp_path / "saved"))
    state = model.state_dict()
    assert not any(k.endswith("weight_scale") for k in state)
    assert all(state[f"{n}.weight"].dtype == torch.float32 for n in _fp8_layers(model))
    ids = torch.randint(0, model.config.vocab_size - 1, (1, 10), generator=torch.Generator().manual_seed(5))
    reference = _plain_with_weights(path, model)  # transformers with the FP8 model's dequantised weights
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32,
                                                 attn_implementation="eager")
    again, _ = FastModel.from_pretrained(str(tmp_path / "saved"), load_in_fp8=True, dtype=torch.float32,
                                         device_map="cpu")
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        assert rel_err(plain(input_ids=ids).logits, want) < 1e-6
        assert rel_err(model(input_ids=ids).logits, want) < 1e-5
    for name, layer in _fp8_layers(again).items():
        original = _fp8_layers(model)[name]
        assert torch.equal(layer.weight.view(torch.uint8), original.weight.view(torch.uint8)), name
        assert torch.allclose(layer.weight_scale, original.weight_scale, rtol=1e-6, atol=0), name
    fresh, _ = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.float32, device_map="cpu")
    for layer in _fp8_layers(fresh).values():
        layer.weight_scale.mul_(2)  # so that the load below has something to restore
    fresh.load_state_dict(model.state_dict())
    for name, layer in _fp8_layers(fresh).items():
        assert torch.equal(layer.weight.view(torch.uint8), _fp8_layers(model)[name].weight.view(torch.uint8)), name
    # under PEFT's LoRA layers the state dict keeps the codes (an adapter save reads the whole state dict and
    # keeps only the adapters: no bf16 copy of the model at every checkpoint), and the adapter save is PEFT's
    lora = FastModel.get_peft_model(fresh, r=4, use_gradient_checkpointing=False)
    state = lora.state_dict()
    codes = [k for k in state if k.endswith("base_layer.weight") and "q_proj" in k]
    assert codes and all(state[k].dtype == torch.float8_e4m3fn for k in codes)
    assert any(k.endswith("base_layer.weight_scale") for k in state)
    lora.save_pretrained(str(tmp_path / "adapter"))
    assert not (tmp_path / "adapter" / "model.safetensors").exists()


def test_casting_the_model_keeps_the_e4m3_codes_and_scales():
    layer = FP8Linear.from_linear(nn.Linear(32, 16))
    q, s = layer.weight.detach().clone(), layer.weight_scale.clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, s)
    assert layer.bias.dtype == torch.bfloat16 and layer.compute_dtype == torch.bfloat16
    layer.float()
    assert layer.compute_dtype == torch.float32 and torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    zero = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        zero.weight[1] = 0  # a row of zeros: scale 1, codes 0, no NaN
    fp8 = FP8Linear.from_linear(zero)
    assert fp8.weight_scale[1].item() == 1.0 and torch.isfinite(fp8.dequantize()).all()
    with torch.device("meta"):
        offloaded = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(ValueError, match="offloaded by the device_map"):
        quantize_model_fp8(offloaded)
    # the training guards' NaN screen reads e4m3 tensors too (torch has no isinf for them)
    from swiftune.training.loading import first_nonfinite_tensor

    assert first_nonfinite_tensor(fp8.named_parameters()) is None
    fp8.weight.data[0, 0] = float("nan")
    assert first_nonfinite_tensor(fp8.named_parameters()) == ("weight", "1 NaN of 32 values")


def _write_block_fp8_checkpoint(src: str, dst, block: int = 32) -> dict[str, torch.Tensor]:
    """``src`` rewritten in transformers' fine-grained FP8 format (e4m3 codes, float32
    ``weight_scale_inv`` per ``block`` x ``block`` block); returns each projection's dequantised weight."""
    from safetensors.torch import load_file, save_file

    build_tokenizer().save_pretrained(dst)
    state = load_file(f"{src}/model.safetensors")
    out, dequantised = {}, {}
    for key, w in state.items():
        if "layers" in key and key.endswith("proj.weight"):
            o, i = w.shape
            blocks = w.reshape(o // block, block, i // block, block)
            scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
            q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
            out[key], out[key.replace("weight", "weight_scale_inv")] = q.reshape(o, i), scale.contiguous()
            dequantised[key.removesuffix(".weight")] = (q.float() * scale[:, None, :, None]).reshape(o, i)
        else:
            out[key] = w
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(open(f"{src}/config.json").read())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
    return dequantised


def test_checkpoints_in_transformers_block_fp8_format_load(checkpoints, tmp_path):
    dequantised = _write_block_fp8_checkpoint(checkpoints["qwen3"], tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, _ = FastModel.from_pretrained(str(tmp_path), dtype=torch.float32, device_map="cpu", patch=False)
        fp8, _ = FastModel.from_pretrained(str(tmp_path), dtype=torch.float32, device_map="cpu", load_in_fp8=True)
    for name, w in dequantised.items():
        module = plain.get_submodule(name)
        assert type(module) is nn.Linear and torch.equal(module.weight, w), name  # the checkpoint's own values
        layer = fp8.get_submodule(name)
        assert isinstance(layer, FP8Linear)
        q, s = _quantize(w)  # block scales re-rounded per row: measured ~2.6e-2 relative
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)), name
        assert rel_err(_dequantized(layer), w) < 5e-2


def _block_formula(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """transformers' fine-grained FP8 dequantisation written out: W[o, i] = Q[o, i] * S[o // bo, i // bi]
    (float32), indexing the scales of each element (partial last blocks included)."""
    rows = torch.arange(q.shape[0]) // block[0]
    cols = torch.arange(q.shape[1]) // block[1]
    return q.float() * scale_inv.float()[rows[:, None], cols[None, :]]


def test_block_fp8_checkpoints_keep_their_codes_and_block_scales(checkpoints, tmp_path):
    """A checkpoint in transformers' fine-grained FP8 format (32 x 32 blocks), loaded dequantised by
    transformers, then given its own codes: every FP8 projection dequantises to the block formula
    bit for bit (transformers' own dequantised weights too), and the model's logits are those of
    transformers' dequantised model."""
    from safetensors.torch import load_file
    from transformers import FineGrainedFP8Config

    dequantised = _write_block_fp8_checkpoint(checkpoints["qwen3"], tmp_path)
    stored = load_file(f"{tmp_path}/model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = dict(dtype=torch.float32, attn_implementation="eager",
                      quantization_config=FineGrainedFP8Config(weight_block_size=[32, 32], dequantize=True))
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), **kwargs)
    assert quantize_model_fp8(model, checkpoint=str(tmp_path)) == 7 * model.config.num_hidden_layers
    layers = _fp8_layers(model)
    assert set(layers) == set(dequantised)
    for name, layer in layers.items():
        q, s = stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"]
        want = _block_formula(q, s, (32, 32))
        assert torch.equal(want, dequantised[name]) and torch.equal(plain.get_submodule(name).weight, want), name
        assert torch.equal(layer.dequantize(torch.float32), want), name
        # random weights: each row's blocks have their own scales, so the blocks stay
        assert layer.block_size == (32, 32) and torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert "32x32 block scales" in repr(next(iter(layers.values())))
    ids = torch.randint(0, model.config.vocab_size - 1, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, plain(input_ids=ids).logits) < 1e-6
    with pytest.raises(ValueError, match="no fine-grained FP8 quantization_config"):
        quantize_model_fp8(plain, checkpoint=checkpoints["qwen3"])


def test_block_scales_become_per_row_only_where_exact(monkeypatch):
    from swiftune.models.fp8_linear import block_scales_to_layer_scales, block_size_of

    g = torch.Generator().manual_seed(0)
    q = (torch.randn(80, 96, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    # 32 x 32 blocks on 80 rows: the last block row is partial (16 rows)
    random_s = torch.rand(3, 3, generator=g) + 0.1
    q_out, s_out = block_scales_to_layer_scales(q, random_s, (32, 32))
    assert s_out.shape == (5, 3) and block_size_of(q_out, s_out) == (16, 32)  # gcd(32, 80) = 16 rows a block
    assert torch.equal(dequantize(q_out, s_out), _block_formula(q, random_s, (32, 32)))
    # every block of a row with one scale: per row, the codes as they are
    shared = random_s[:, :1].expand(3, 3).contiguous()
    q_out, s_out = block_scales_to_layer_scales(q, shared, (32, 32))
    assert s_out.shape == (80, 1) and torch.equal(q_out.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dequantize(q_out, s_out), _block_formula(q, shared, (32, 32)))
    # scales a power of two apart, codes with a spare mantissa bit (x 0.5 loses none): re-encoded exactly
    even = (q.float() / 2).round().mul(2).clamp(-448, 448).to(torch.float8_e4m3fn)
    even = torch.where(even.float().abs() >= 2 ** -5, even.float(), torch.zeros(())).to(torch.float8_e4m3fn)
    halves = shared.clone()
    halves[:, 1] /= 2
    q_out, s_out = block_scales_to_layer_scales(even, halves, (32, 32))
    assert s_out.shape == (80, 1) and torch.equal(dequantize(q_out, s_out), _block_formula(even, halves, (32, 32)))
    with pytest.raises(ValueError, match="does not match a weight of shape"):
        block_scales_to_layer_scales(q, torch.ones(2, 3), (32, 32))
    # a block-scaled layer computes on the dequantising path, also where _scaled_mm is allowed
    linear = nn.Linear(96, 80, bias=True)
    layer = FP8Linear.from_block_fp8(linear, q, random_s, (32, 32), scaled_mm=True)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("block scales vary along the summed axis"))
    x = torch.randn(4, 96, generator=g).to(torch.bfloat16)
    want = (x.double() @ _block_formula(q, random_s, (32, 32)).double().t() + linear.bias.double())
    assert rel_err(layer(x), want) < 1e-2


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A layer's codes and scales (per row, or equal blocks tiling the weight) by the block formula."""
    return _block_formula(q, s, (q.shape[0] // s.shape[0], q.shape[1] // s.shape[1]))


def test_bad_fp8_requests_are_refused_before_loading(tmp_path, checkpoints, monkeypatch):
    from transformers import BitsAndBytesConfig

    from swiftune.training import FastLanguageModel

    empty = tmp_path / "empty"
    empty.mkdir()  # no config.json: any attempt to load would fail differently
    for other in ({"load_in_4bit": True}, {"load_in_8bit": True},
                  {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)}):
        with pytest.raises(ConfigError, match="load_in_fp8=True and .* are exclusive"):
            FastModel.from_pretrained(str(empty), load_in_fp8=True, **other)
    with pytest.raises(ConfigError, match="full_finetuning=True with load_in_fp8=True"):
        FastLanguageModel.from_pretrained(str(empty), load_in_fp8=True, full_finetuning=True)
    model, _ = FastModel.from_pretrained(checkpoints["qwen3"], load_in_fp8=True, dtype=torch.float32, device_map="cpu")
    with pytest.raises(ConfigError, match="full fine-tuning of an FP8 model"):
        FastModel.for_training(model)
    import swiftune

    with pytest.raises(ConfigError, match="full fine-tuning of an FP8 model"):
        swiftune.SFTTrainer(model=model, args=swiftune.SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True),
                            train_dataset=[{"prompt": "a", "completion": "b"}], processing_class=build_tokenizer())
    # a GPU without FP8 tensor cores: a warning (the load goes on; the reference path will run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.warns(UserWarning, match="no FP8 tensor cores"):
        check_fp8_request(True, False, False, None)


def test_cli_refuses_fp8_full_finetuning_and_mixed_quantisation():
    from swiftune.cli.arguments import ModelArguments, check_model_args

    with pytest.raises(ConfigError, match="cannot be fully fine-tuned"):
        check_model_args(ModelArguments(model_name_or_path="some/model", load_in_fp8=True, use_lora=False))
    with pytest.raises(ConfigError, match="exclusive"):
        check_model_args(ModelArguments(model_name_or_path="some/model", load_in_fp8=True, load_in_4bit=True))
    check_model_args(ModelArguments(load_in_fp8=True))  # the built-in tiny model: quantised after its warm-up


def test_builtin_model_is_quantised_after_its_warm_up(tmp_path):
    """``swiftune grpo --load_in_fp8 true`` on the built-in task (the FP8 reward curve of issue 26):
    the warm-up trains the bf16 model, then every decoder linear layer becomes FP8 and LoRA trains
    on top of it (a bare built-in run fine-tunes the whole model)."""
    from swiftune.cli.arguments import ModelArguments
    from swiftune.cli.runs import build_model
    from swiftune.models.fp8_linear import FP8Linear
    from swiftune.sft import SFTConfig

    seen = {}

    def warm_up(model, tokenizer):
        seen["fp8_during_warm_up"] = any(isinstance(m, FP8Linear) for m in model.modules())
        seen["trainable_during_warm_up"] = all(p.requires_grad for p in model.parameters())

    config = SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    model, _, use_lora = build_model(ModelArguments(load_in_fp8=True), config, builtin=True, prepare_builtin=warm_up)
    assert seen == {"fp8_during_warm_up": False, "trainable_during_warm_up": True}
    assert use_lora
    fp8 = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == 2 * 7  # q, k, v, o, gate, up, down in each of the two layers
    assert all(m.weight.dtype == torch.float8_e4m3fn and not m.weight.requires_grad
               for m in model.modules() if isinstance(m, FP8Linear))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_planner_counts_fp8_weights(capsys):
    from swiftune.cli.plan import main_plan

    full = plan_memory("qwen3-8b", 4096)
    q = plan_memory("qwen3-8b", 4096, weight_quantization="fp8")
    shape = model_shape("qwen3-8b")
    # embeddings and LM head stay bf16 (2 x 151,936 x 4,096 x 2 bytes); projections 1 byte each, plus
    # a float32 scale per output row: 36 x (4096 + 2 x 1024 + 4096 + 2 x 12288 + 4096) x 4 bytes
    embed = 2 * 151936 * 4096 * 2
    rows = 36 * (4096 + 2 * 1024 + 4096 + 2 * 12288 + 4096)
    assert fp8_scale_bytes(shape) == 4 * rows
    linear = linear_weight_count(shape)
    assert (param_count(shape) - linear) * 2 - embed < 1e6  # besides the projections: embeddings, head, norms
    assert q.weights == (param_count(shape) - linear) * 2 + linear + 4 * rows
    assert abs(q.weights / 1e9 - 9.44) < 0.01 and abs(full.weights / 1e9 - 16.38) < 0.01
    assert q.allocated < full.allocated
    with pytest.raises(ValueError, match="needs LoRA"):
        plan_memory("qwen3-8b", 4096, full_finetune=True, weight_quantization="fp8")
    assert main_plan(["--model", "qwen3-8b", "--tokens", "4096", "--load_in_fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["weights"] == q.weights
    assert main_plan(["--model", "qwen3-8b", "--load_in_fp8", "--load_in_4bit"]) == 2


def test_rollout_engine_generates_from_fp8_weights(checkpoints):
    """The engine decodes through the FP8 projections (adapters applied at run time): the same
    greedy tokens as transformers' generate on the same model."""
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams

    model, tokenizer = FastModel.from_pretrained(checkpoints["qwen3"], load_in_fp8=True, dtype=torch.float32,
                                                 device_map="cpu")
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("Reverse: abc\n", "Hi\n")]
    # adapters are never merged into e4m3 weights (not representable): "merge" is refused, "auto" runs them
    from swiftune.rl.rollout.lora_merge import merge_lora

    with pytest.raises(ValueError, match="FP8"):
        merge_lora(model, "merge")
    assert merge_lora(model, "auto") is None
    engine = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, kv_bucket=4, check_every=3, lora="auto")
    out = engine.generate(prompts, 1, SamplingParams(max_tokens=6, temperature=0))
    assert _fp8_layers(model)
    for prompt, got in zip(prompts, out.completion_ids):
        ref = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
        assert got == ref[0, len(prompt):].tolist()


def test_fp8_scaled_mm_training_step_within_measured_error(checkpoints, device, monkeypatch):
    """The ``torch._scaled_mm`` path through a whole LoRA step (bf16, activations and gradients
    quantised on the fly, q/k/v and gate/up sharing their input's quantisation) against the float32
    reference on the same dequantised weights, and bit for bit (CPU; within 1e-6 / 1e-2 on CUDA) the step
    whose projections each quantise their own input. On an FP8 GPU the path is chosen at load; on CPU it
    is switched on (CPU torch has ``_scaled_mm`` too)."""
    from swiftune.models.lora_linear import is_fused_lora

    if device == "cpu":
        _require_cpu_scaled_mm()
    path = checkpoints["qwen3"]
    model, _ = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.bfloat16, device_map=device)
    layers = _fp8_layers(model)
    if device == "cuda":
        assert all(m.scaled_mm for m in layers.values()) == (torch.cuda.get_device_capability() >= (8, 9))
    for m in layers.values():
        m.scaled_mm = True
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                     use_gradient_checkpointing=False, init_lora_weights=False)
    assert all(is_fused_lora(m) for m in model.modules() if hasattr(m, "lora_A"))  # the fused node's FP8 branch
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0, init_lora_weights=False)
    reference = peft.get_peft_model(_plain_with_weights(path, model), config).to(device).train()
    copy_lora_tensors(reference, model)
    ref_loss, ref_grads = _reference_step(reference, _examples())
    import swiftune.models.fp8_linear as fl
    import swiftune.models.lora_linear as ll

    calls, quantised = [], []
    scaled_mm, quantise = torch._scaled_mm, fl.quantize_activation
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))
    monkeypatch.setattr(fl, "quantize_activation", lambda *a, **k: quantised.append(1) or quantise(*a, **k))
    loss, grads = _swiftune_step(model.train(), _examples(), "padding_free")
    # every forward, and every input gradient but layer 0's q/k/v (their input, the embedding, is frozen)
    assert len(calls) == 2 * len(layers) - 3, "forward and input gradients of the projections on _scaled_mm"
    # the forward quantises each layer's inputs 4 times, not 7 (q/k/v share one, gate/up one; o and down
    # their own); each input gradient is quantised for its own product
    n_layers = len(layers) // 7
    assert len(quantised) == 4 * n_layers + (len(layers) - 3)
    with monkeypatch.context() as unshared:  # each projection quantising its own input: the same bits
        unshared.setattr(ll, "quantize_shared_input", lambda x, projections: None)
        quantised.clear()
        own_loss, own_grads = _swiftune_step(model.train(), _examples(), "padding_free")
        assert len(quantised) == 7 * n_layers + (len(layers) - 3)
    assert own_grads.keys() == grads.keys()
    if device == "cpu":
        assert torch.equal(loss, own_loss) and all(torch.equal(grads[name], own_grads[name]) for name in grads)
    else:  # the flash attention backward's atomic adds make two CUDA backwards differ in the last bits
        assert rel_err(loss, own_loss) < 1e-6
        assert_gradients_match(own_grads, grads, list(grads), 1e-2)
    # measured on CPU: loss 8e-5; LoRA gradients 6.5e-2 (median tensor) to 1.2e-1 (worst), where the
    # dequantising path in bf16 gives 1.5e-2 to 3e-2: e4m3 activations and gradients (3 mantissa
    # bits) on a model of width 64, whose sums average few roundings
    assert rel_err(loss, ref_loss) < 1e-3, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, _trainable(reference), 0.25)


def test_shared_fp8_codes_are_not_held_through_the_attention(checkpoints, monkeypatch):
    """The q/k/v input's shared e4m3 codes (a byte per input element: 0.3 GB at a 300K-token row of
    Qwen3-8B) are freed before RoPE and the attention run, in the training forward, not kept alive by
    the forward's locals or by the projections' autograd nodes."""
    import gc
    import weakref

    import swiftune.models.forwards as fw
    import swiftune.models.lora_linear as ll

    _require_cpu_scaled_mm()
    model, _ = FastModel.from_pretrained(checkpoints["qwen3"], load_in_fp8=True, dtype=torch.bfloat16,
                                         device_map="cpu")
    for m in _fp8_layers(model).values():
        m.scaled_mm = True
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                     use_gradient_checkpointing=False)
    made: list[weakref.ref] = []
    share = ll.quantize_shared_input

    def recording(x, layers):
        shared = share(x, layers)
        if shared is not None:
            made.append(weakref.ref(shared.codes))
        return shared

    alive_at_rope: list[int] = []
    rope = fw.rope_qk

    def checking(*args, **kwargs):
        gc.collect()
        alive_at_rope.append(sum(ref() is not None for ref in made))
        return rope(*args, **kwargs)

    monkeypatch.setattr(ll, "quantize_shared_input", recording)
    monkeypatch.setattr(fw, "rope_qk", checking)
    loss, _ = _swiftune_step(model.train(), _examples(), "padding_free")
    n_layers = model.config.num_hidden_layers
    assert len(made) == 2 * n_layers and len(alive_at_rope) == n_layers  # q/k/v and gate/up shared per layer
    assert alive_at_rope == [0] * n_layers and torch.isfinite(loss)
