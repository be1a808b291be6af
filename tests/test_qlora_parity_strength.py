"""QLoRA cases tests/test_qlora.py leaves open: a 4-bit base with biases, a compute dtype other than the load
dtype, the NF4 dequantised-copy forward with a bias, 4-bit layers without adapters in a merged save, and the
planner's 4-bit byte counts.

References, never swiftune: transformers + bitsandbytes (``BitsAndBytesConfig`` built here) + PEFT, unpatched,
run document by document; bitsandbytes' own ``Linear4bit`` / ``dequantize_4bit`` and its quantised tensors'
sizes; PEFT's ``merge_and_unload`` on a plain model holding bitsandbytes' dequantised weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from swiftune.data import build_tokenizer  # noqa: E402
from swiftune.training import FastModel  # noqa: E402
from tests.helpers import assert_gradients_match, copy_lora_tensors, lora_tensors, rel_err, tiny_model  # noqa: E402
from tests.test_gradient_parity import PROJECTIONS, _examples, _reference_step, _swiftune_step, _trainable  # noqa: E402
from tests.test_nf4_matmul import _layer as nf4_layer  # noqa: E402


def _bnb_config(compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    """The QLoRA recipe as PEFT users write it (NF4, double quantisation): what load_in_4bit=True promises."""
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


@pytest.fixture(scope="module")
def qwen2_with_biases(tmp_path_factory) -> str:
    """A tiny Qwen2 (q/k/v projections with biases), its biases drawn non-zero (transformers starts them at 0,
    which would hide a dropped bias)."""
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        biases = [p for n, p in model.named_parameters() if n.endswith("proj.bias")]
        assert biases
        for p in biases:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    path = tmp_path_factory.mktemp("qwen2_bias")
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def _reference(path: str, compute_dtype: torch.dtype):
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=_bnb_config(compute_dtype),
                                                dtype=torch.float32, attn_implementation="eager", device_map="cpu")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, config).train()


def _swiftune(model, reference, checkpointing):
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                     use_gradient_checkpointing=checkpointing, init_lora_weights=False)
    copy_lora_tensors(reference, model)
    return model.train()


def _assert_same_nf4(reference, model) -> None:
    """Both sides hold bitsandbytes NF4 with double quantisation, the same codes and the same absmax codes."""
    ref = {n: m for n, m in reference.named_modules() if type(m).__name__ == "Linear4bit" and not hasattr(m, "lora_A")}
    got = {n: m for n, m in model.named_modules() if type(m).__name__ == "Linear4bit" and not hasattr(m, "lora_A")}
    assert ref.keys() == got.keys() and len(ref) == 14
    for name, r in ref.items():
        a, b = r.weight.quant_state, got[name].weight.quant_state
        assert b.quant_type == "nf4" and b.nested and a.nested, name
        assert torch.equal(r.weight.data, got[name].weight.data), name
        assert b.absmax.dtype == a.absmax.dtype and torch.equal(a.absmax, b.absmax), name
        assert torch.equal(a.state2.absmax, b.state2.absmax), name


@pytest.mark.parametrize("layout,checkpointing", [("padding_free", False), ("packed", True)])
def test_qlora_with_projection_biases_equals_peft_bitsandbytes(qwen2_with_biases, layout, checkpointing):
    """Qwen2's q/k/v biases under NF4 (load_in_4bit=True, swiftune's fused LoRA node): loss and every LoRA
    gradient equal transformers + bitsandbytes (double-quantised NF4, configured here) + PEFT per document."""
    reference = _reference(qwen2_with_biases, torch.float32)
    ref_loss, ref_grads = _reference_step(reference, _examples())
    model, _ = FastModel.from_pretrained(qwen2_with_biases, load_in_4bit=True, dtype=torch.float32, device_map="cpu")
    model = _swiftune(model, reference, checkpointing)
    _assert_same_nf4(reference, model)
    biases = [m.base_layer.bias for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")
              and m.base_layer.bias is not None]
    assert len(biases) == 6 and all(b.abs().max() > 0 for b in biases)  # 2 layers x q, k, v
    loss, grads = _swiftune_step(model, _examples(), layout)
    assert rel_err(loss, ref_loss) < 1e-5, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, _trainable(reference), 1e-4)
    assert set(ref_grads) == set(_trainable(reference))


def test_qlora_with_a_bf16_compute_dtype_under_float32_weights_equals_peft_bitsandbytes(qwen2_with_biases):
    """A quantization_config whose compute dtype (bf16) is not the load dtype (float32): bitsandbytes multiplies
    the base in bf16, so must swiftune. Loss and every LoRA gradient equal the plain libraries' per document.
    Bounds: here the two sides differ by ~1e-8 (loss) and <= 7e-5 (gradients, the bf16 products amplifying
    float32 summation order); a float32 base product instead of bitsandbytes' bf16 one gives 1e-5 and 2e-3..8e-3."""
    config = _bnb_config(torch.bfloat16)
    reference = _reference(qwen2_with_biases, torch.bfloat16)
    ref_loss, ref_grads = _reference_step(reference, _examples())
    model, _ = FastModel.from_pretrained(qwen2_with_biases, quantization_config=config, dtype=torch.float32,
                                         device_map="cpu")
    model = _swiftune(model, reference, False)
    loss, grads = _swiftune_step(model, _examples(), "padding_free")
    assert rel_err(loss, ref_loss) < 1e-6, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, _trainable(reference), 1e-3)


def test_nf4_dense_copy_keeps_the_bias():
    """The rollout engine's dequantised-copy forward (nf4_dense) on an NF4 layer with a bias: bitsandbytes'
    own layer's output, and the plain formula x dequantize_4bit(W)^T + b."""
    from swiftune.models.nf4_dense import nf4_dense_layers

    layer = nf4_layer(128, 64, torch.float32, nested=True, bias=True, device="cpu")
    model = nn.Sequential(layer)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = layer(x)
        w = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        formula = x @ w.t() + layer.bias
        with nf4_dense_layers(model) as bound:
            got = layer(x)
    assert bound == 1
    assert rel_err(got, want) < 1e-6 and rel_err(got, formula) < 1e-6


def test_merged_save_of_a_4bit_base_with_unadapted_projections_equals_peft_merge(tmp_path):
    """LoRA on q_proj and v_proj only, over a 4-bit base: the other five NF4 projections of each layer have no
    adapter and must still be written dequantised. The merged folder, loaded in plain transformers, holds PEFT's
    merge into the plain model whose 14 projections are bitsandbytes' dequantize_4bit of the NF4 codes."""
    import bitsandbytes.functional as bnbf

    path = tmp_path / "qwen3"
    tiny_model("qwen3").save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    model, tokenizer = FastModel.from_pretrained(str(path), load_in_4bit=True, dtype=torch.float32, device_map="cpu")
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                     use_gradient_checkpointing=False)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in lora_tensors(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(tmp_path / "adapter")
    dequantised = {}
    for name, module in model.get_base_model().named_modules():
        weight = getattr(module, "weight", None)
        if getattr(weight, "quant_state", None) is not None:
            dequantised[name.removesuffix(".base_layer") + ".weight"] = bnbf.dequantize_4bit(weight.data,
                                                                                             weight.quant_state)
    assert len(dequantised) == 14
    model.save_pretrained_merged(str(tmp_path / "merged"), tokenizer, save_method="merged_16bit")

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        state = plain.state_dict()
        for name, w in dequantised.items():
            state[name].copy_(w)
    reference = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").merge_and_unload().eval()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    got, want = loaded.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), f"{name}: differs from PEFT's merge"
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)


def _bnb_bytes_per_weight(nested: bool) -> float:
    """Bytes a bitsandbytes NF4 weight takes per element, its quantisation constants included (the 16- and
    256-value code tables and the offset, once per layer, left out), measured on a quantised weight."""
    n, k = 256, 1024
    p = bnb.nn.Params4bit(torch.randn(n, k), requires_grad=False, compress_statistics=nested, quant_type="nf4")
    p = p.to("cpu")  # quantises
    state = p.quant_state
    size = p.data.numel() * p.data.element_size() + state.absmax.numel() * state.absmax.element_size()
    if nested:
        size += state.state2.absmax.numel() * state.state2.absmax.element_size()
    assert state.nested == nested
    return size / (n * k)


def test_planner_4bit_weight_bytes_are_bitsandbytes_sizes():
    """QUANTIZED_WEIGHT_BYTES is what bitsandbytes stores per NF4 weight (codes, absmax, and with double
    quantisation the absmax codes and their float32 scales), and the plan's weights are exactly the
    projections at that size plus everything else at bf16."""
    from swiftune.memory.planner import QUANTIZED_WEIGHT_BYTES, plan_memory

    full = plan_memory("qwen3-8b", 4096)
    linear = 36 * (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 12288)
    for name, nested in (("nf4", False), ("nf4_double_quant", True)):
        measured = _bnb_bytes_per_weight(nested)
        assert abs(QUANTIZED_WEIGHT_BYTES[name] - measured) < 1e-12, (name, QUANTIZED_WEIGHT_BYTES[name], measured)
        q = plan_memory("qwen3-8b", 4096, weight_quantization=name)
        assert abs(q.weights - (full.weights - 2 * linear + linear * measured)) <= 1, name


def test_planner_counts_the_dequantised_weight_of_a_4bit_matmul():
    """bitsandbytes multiplies by a dequantised copy of the weight ([out, in] in the compute dtype,
    dequantize_4bit's output): with checkpointing, a 4-bit plan's working set is the unquantised plan's plus the
    widest projection's copy in bf16, with its layer inputs kept on the GPU, offloaded, or with no checkpointing
    at all (where the working set is the last layer's backward, which makes the copy too)."""
    from swiftune.memory.planner import plan_memory

    layer = nf4_layer(64, 192, torch.float32, nested=True, bias=False, device="cpu")
    copy = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(torch.bfloat16)
    assert copy.shape == (192, 64)  # one element per weight, in the compute dtype
    for checkpointing in (False, True, "offload"):
        full = plan_memory("qwen3-8b", 4096, gradient_checkpointing=checkpointing)
        q = plan_memory("qwen3-8b", 4096, weight_quantization="nf4_double_quant", gradient_checkpointing=checkpointing)
        assert q.layer_working_set - full.layer_working_set == 12288 * 4096 * copy.element_size(), checkpointing
