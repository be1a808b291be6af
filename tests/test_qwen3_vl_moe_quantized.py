"""QLoRA on Qwen3-VL-MoE: the NF4 text projections, the vision tower, LM head, router and fused
expert stacks unquantised, against bitsandbytes + PEFT's own QLoRA.

The reference is transformers' ``AutoModelForImageTextToText.from_pretrained`` of the same saved
float32 checkpoint with bitsandbytes' ``BitsAndBytesConfig`` (NF4, double quantisation, the vision
tower and LM head skipped, eager attention) and PEFT's own LoRA, run on each image-text example
alone (tests/test_qwen3_vl.py's per-example loss). What is quantised is what transformers' quantiser
replaces: the ``nn.Linear`` projections (attention everywhere, the dense layer's MLP); the 3-D
expert stacks and the router stay float32 on both sides
(:func:`swiftune.models.qwen3_vl.unquantized_expert_stacks` says why). Compared: the loss and every
trainable tensor's gradient (non-zero where the reference's is) of a padding-free row of three
examples, two with images; adapters on the text projections, on the vision tower too (checkpointed),
and on the expert stacks (PEFT's ``target_parameters``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
pytest.importorskip("PIL")

import transformers  # noqa: E402
from transformers import AutoModelForImageTextToText, BitsAndBytesConfig  # noqa: E402

import swiftune  # noqa: E402
from swiftune.data.multimodal import prepare_multimodal_dataset  # noqa: E402
from swiftune.models.qwen3_vl import unquantized_expert_stacks  # noqa: E402
from swiftune.training.quantization import is_quantized_4bit  # noqa: E402
from tests.test_qwen3_vl import SEVEN, VISION_LINEARS, _check_parity, _model, _processor, _rows, tiny_vl_moe  # noqa: E402
from tests.helpers import copy_lora_tensors  # noqa: E402
from tests.test_qwen3_vl_quantized import LOAD, LORA, _assert_vision_tower_unquantized  # noqa: E402

if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
    pytest.skip("this transformers has no Qwen3-VL-MoE", allow_module_level=True)

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT target_parameters on the fused stacks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(folder, processor, data, float32 model)``: the tiny Qwen3-VL-MoE (layer 0 sparse, layer 1
    dense) and its processor saved, the rows prepared."""
    proc = _processor()
    moe = tiny_vl_moe(_model(proc), scale=0.05)
    path = tmp_path_factory.mktemp("vl_moe")
    moe.save_pretrained(path)
    proc.tokenizer.save_pretrained(path)
    proc.image_processor.save_pretrained(path)
    return str(path), proc, prepare_multimodal_dataset(_rows(), proc), moe


def _bnb_reference(path: str, targets: list[str], target_parameters: list[str] | None, device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers + bitsandbytes + PEFT, unpatched (train mode: see tests/test_qwen3_vl_quantized.py)."""
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["model.visual", "lm_head"])
    base = AutoModelForImageTextToText.from_pretrained(path, quantization_config=config, dtype=dtype,
                                                       attn_implementation="eager", device_map=device)
    torch.manual_seed(1)
    lora = peft.LoraConfig(target_modules=targets, target_parameters=target_parameters, **LORA)
    return peft.get_peft_model(base, lora).train()


def _assert_moe_layout(model: nn.Module, plain: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """The sparse layer's expert stacks and router unquantised in ``dtype`` and equal to the saved
    ones; the dense layer's MLP and every attention projection NF4."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    sparse = hf.model.language_model.layers[0].mlp
    experts = getattr(sparse.experts, "base_layer", sparse.experts)
    while hasattr(experts, "base_layer"):  # nested PEFT ParamWrappers (one per target parameter)
        experts = experts.base_layer
    want = plain.model.language_model.layers[0].mlp
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        assert type(p).__name__ != "Params4bit" and p.dim() == 3 and p.dtype == dtype, name
        assert torch.equal(p.detach().cpu().to(want.experts.gate_up_proj.dtype), getattr(want.experts, name)), name
    assert type(sparse.gate.weight).__name__ != "Params4bit" and sparse.gate.weight.dtype == dtype
    dense = hf.model.language_model.layers[1].mlp
    assert all(type(getattr(getattr(dense, n), "base_layer", getattr(dense, n))).__name__ == "Linear4bit"
               for n in ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("targets,target_parameters,checkpointing", [
    (SEVEN, None, False), (SEVEN + VISION_LINEARS, None, True), (SEVEN, EXPERTS, False)],
    ids=["text-lora", "text-and-vision-lora-checkpointed", "text-and-expert-lora"])
def test_qlora_loss_and_gradients_equal_bitsandbytes_peft(saved, targets, target_parameters, checkpointing, caplog):
    path, proc, data, plain = saved
    reference = _bnb_reference(path, targets, target_parameters)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swiftune.models.qwen3_vl"):
        model, _ = swiftune.FastModel.from_pretrained(path, load_in_4bit=True, **LOAD)
    # the load says that the expert stacks stayed unquantised (two stacks of the one sparse layer)
    assert unquantized_expert_stacks(model) == {
        "model.language_model.layers.0.mlp.experts.gate_up_proj": 4 * 64 * 64,
        "model.language_model.layers.0.mlp.experts.down_proj": 4 * 64 * 32}
    assert any("2 fused expert stacks" in r.getMessage() for r in caplog.records), caplog.text
    model = swiftune.FastModel.get_peft_model(model, target_modules=targets, target_parameters=target_parameters,
                                              use_gradient_checkpointing=checkpointing, **LORA)
    assert is_quantized_4bit(model) and is_quantized_4bit(reference)
    for m in (model, reference):
        _assert_vision_tower_unquantized(m)
        _assert_moe_layout(m, plain)
    ref_params = dict(reference.named_parameters())
    quantized = [(n, p) for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"]
    assert len(quantized) == 4 * 2 + 3  # q/k/v/o of both layers, the dense layer's MLP
    assert {n for n, _ in quantized} == {n for n, p in ref_params.items() if type(p).__name__ == "Params4bit"}
    for name, p in quantized:  # the same checkpoint quantised the same way
        assert torch.equal(p.data, ref_params[name].data), name
    copy_lora_tensors(reference, model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if target_parameters:
        assert sum("mlp.experts" in n for n in trainable) == 4  # A and B of both stacks
    _check_parity(reference, model.train(), proc, data.examples)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_qlora_parity(saved):
    """On CUDA, fp32 (TF32 off): FastModel's 4-bit VL-MoE with its defaults (compiled kernels, the
    automatic packed attention, checkpointing, swiftune's grouped experts) and LoRA on the text
    projections and the expert stacks, against bitsandbytes + PEFT on each example alone: loss to
    1e-4 and every LoRA gradient to 1e-3."""
    from tests.test_qwen3_vl import _collator, _grads, _patched_loss, _reference_loss, _rel

    path, proc, data, plain = saved
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        reference = _bnb_reference(path, SEVEN, EXPERTS, device="cuda")
        ref_loss = _reference_loss(reference, proc, data.examples)
        ref_loss.backward()
        ref_grads = _grads(reference)
        model, _ = swiftune.FastModel.from_pretrained(path, load_in_4bit=True, dtype=torch.float32)
        model = swiftune.FastModel.get_peft_model(model, target_modules=SEVEN, target_parameters=EXPERTS,
                                                  **LORA).train()
        _assert_moe_layout(model, plain)
        copy_lora_tensors(reference, model)
        batch = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in _collator(reference, proc)(data.examples).items()}
        loss = _patched_loss(model, batch)
        loss.backward()
        grads = _grads(model)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert torch.isfinite(loss) and _rel(loss.detach(), ref_loss.detach()) < 1e-4, (float(loss), float(ref_loss))
    assert ref_grads.keys() == grads.keys() and ref_grads
    for name, ref in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        if ref.abs().max() > 0:
            assert grads[name].abs().max() > 0, name
        assert _rel(grads[name], ref) < 1e-3, (name, _rel(grads[name], ref))
