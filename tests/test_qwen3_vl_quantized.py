"""Qwen3-VL on quantised bases: QLoRA (bitsandbytes NF4) and FP8 text decoders, the vision tower unquantised.

References, the plain libraries unpatched, run on each image-text example alone (tests/test_qwen3_vl.py's
per-example loss and its tiny model and processor, saved to a folder that both sides load):

* QLoRA: transformers' ``AutoModelForImageTextToText.from_pretrained`` with bitsandbytes'
  ``BitsAndBytesConfig`` (NF4, double quantisation, the vision tower and the LM head in its skip list,
  eager attention) and PEFT's own LoRA with the same adapter weights. Both sides quantise the same
  float32 checkpoint, so they hold the same NF4 codes (checked).
* FP8: transformers' unquantised model with each text projection's weight replaced by the dequantised
  FP8 weight ``Q * s`` (the codes checked against this file's own per-row e4m3 quantisation), PEFT's
  own LoRA on top.

Compared: the loss and every LoRA tensor's gradient (non-zero where the reference's is) of a
padding-free row of three examples, two with images (three images); also GRPO's completion log-probs
with and without the adapters (the reference policy of a LoRA model), a GRPOTrainer step and two
SFTTrainer steps on the 4-bit model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
pytest.importorskip("PIL")  # the saved folder needs transformers' image processor (Pillow)

from transformers import AutoModelForImageTextToText, BitsAndBytesConfig  # noqa: E402

import swiftune  # noqa: E402
from swiftune.data.multimodal import prepare_multimodal_dataset  # noqa: E402
from swiftune.models.fp8_linear import FP8Linear  # noqa: E402
from swiftune.training.quantization import is_quantized_4bit, is_quantized_fp8  # noqa: E402
from tests.helpers import copy_lora_tensors  # noqa: E402
from tests.test_qwen3_vl import SEVEN, VISION_LINEARS, _check_parity, _model, _processor, _rows  # noqa: E402

E4M3_MAX = 448.0
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)
LOAD = dict(dtype=torch.float32, kernel_backend="reference", attn_implementation="reference", device_map={"": "cpu"})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(folder, processor, data)``: the tiny Qwen3-VL and its processor saved, the rows prepared."""
    proc = _processor()
    path = tmp_path_factory.mktemp("vl")
    _model(proc).save_pretrained(path)
    proc.tokenizer.save_pretrained(path)
    proc.image_processor.save_pretrained(path)
    return str(path), proc, prepare_multimodal_dataset(_rows(), proc)


def _bnb_reference(path: str, targets: list[str], device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers + bitsandbytes + PEFT, unpatched: the text decoder NF4, the vision tower and the
    LM head skipped (bitsandbytes' own option; without it the tower's linears would be 4-bit too)."""
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["model.visual", "lm_head"])
    base = AutoModelForImageTextToText.from_pretrained(path, quantization_config=config, dtype=dtype,
                                                       attn_implementation="eager", device_map=device)
    torch.manual_seed(1)
    # train mode (no dropout here): in eval mode without gradients, bitsandbytes' CPU backend repacks
    # the weights for its bf16 (AVX512-BF16) kernel, another rounding than the float32 compute asked for
    return peft.get_peft_model(base, peft.LoraConfig(target_modules=targets, **LORA)).train()


def _assert_vision_tower_unquantized(model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Every linear of the vision tower and its mergers (and the LM head) a plain layer in the load
    ``dtype``; every text projection quantised."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    tower = [m for m in hf.model.visual.modules() if isinstance(m, nn.Linear)]
    assert tower and all(type(m).__name__ not in ("Linear4bit", "FP8Linear") for m in tower)
    assert all(p.dtype == dtype for n, p in hf.model.visual.named_parameters() if "lora_" not in n)
    assert type(hf.lm_head) is nn.Linear and hf.lm_head.weight.dtype == dtype
    projections = [m for n, m in hf.model.language_model.named_modules() if n.rsplit(".", 1)[-1] in SEVEN]
    assert projections and all(type(getattr(m, "base_layer", m)).__name__ in ("Linear4bit", "FP8Linear")
                               for m in projections)


def _swiftune_4bit(path: str, targets: list[str], checkpointing=False) -> nn.Module:
    model, _ = swiftune.FastModel.from_pretrained(path, load_in_4bit=True, **LOAD)
    return swiftune.FastModel.get_peft_model(model, target_modules=targets, use_gradient_checkpointing=checkpointing,
                                             **LORA)


@pytest.mark.parametrize("targets,checkpointing", [(SEVEN, False), (SEVEN + VISION_LINEARS, True)],
                         ids=["text-lora", "text-and-vision-lora-checkpointed"])
def test_qlora_loss_and_gradients_equal_bitsandbytes_peft(saved, targets, checkpointing):
    """LoRA over the 4-bit text decoder (and over the unquantised vision tower and mergers)."""
    path, proc, data = saved
    reference = _bnb_reference(path, targets)
    model = _swiftune_4bit(path, targets, checkpointing)
    assert is_quantized_4bit(model) and is_quantized_4bit(reference)
    _assert_vision_tower_unquantized(model)
    _assert_vision_tower_unquantized(reference)
    ref_params = dict(reference.named_parameters())
    quantized = [(n, p) for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"]
    assert len(quantized) == 7 * 2
    for name, p in quantized:  # the same checkpoint quantised the same way
        assert torch.equal(p.data, ref_params[name].data), name
    copy_lora_tensors(reference, model)
    assert sum(e.get("pixel_values") is not None for e in data.examples) == 2
    _check_parity(reference, model.train(), proc, data.examples)


def _own_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This file's per-row e4m3 quantisation: s = max|row| / 448, Q = e4m3(W / s)."""
    amax = w.double().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).float()
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def test_fp8_loss_and_gradients_equal_transformers_peft_on_dequantised_weights(saved):
    path, proc, data = saved
    model, _ = swiftune.FastModel.from_pretrained(path, load_in_fp8=True, **LOAD)
    plain = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    assert is_quantized_fp8(model)
    _assert_vision_tower_unquantized(model)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert len(layers) == 7 * 2 and all(n.startswith("model.language_model.") for n in layers)
    for name, p in model.model.visual.state_dict().items():  # the vision tower exactly as saved
        assert torch.equal(p, plain.model.visual.state_dict()[name]), name
    with torch.no_grad():
        for name, layer in layers.items():
            want_q, want_s = _own_fp8(plain.get_submodule(name).weight)
            assert torch.equal(layer.weight.view(torch.uint8), want_q.view(torch.uint8)), name
            assert torch.allclose(layer.weight_scale, want_s, rtol=1e-6, atol=0), name
            plain.get_submodule(name).weight.copy_(layer.weight.float() * layer.weight_scale)
    targets = SEVEN + VISION_LINEARS
    model = swiftune.FastModel.get_peft_model(model, target_modules=targets, use_gradient_checkpointing=False, **LORA)
    torch.manual_seed(1)
    reference = peft.get_peft_model(plain, peft.LoraConfig(target_modules=targets, **LORA))
    copy_lora_tensors(reference, model)
    _check_parity(reference, model.train(), proc, data.examples)


def test_grpo_logprobs_and_trainer_step_on_a_4bit_policy(saved, tmp_path):
    """GRPO's policy row of image prompts through the 4-bit LoRA policy: the completion log-probs and
    the reference policy's (adapters disabled) equal bitsandbytes + PEFT on each sample alone; one
    GRPOTrainer step with beta > 0 moves every adapter and leaves the NF4 weights as they were."""
    from swiftune import GRPOConfig, GRPOTrainer
    from swiftune.rl.multimodal import VisionGRPO
    from swiftune.rl.policy import completion_logprobs
    from tests.test_qwen3_vl_grpo import FAST, _prompt_rows, _reference_logps
    from tests.test_qwen3_vl import _rel

    path, proc, _ = saved
    reference = _bnb_reference(path, SEVEN)
    model = _swiftune_4bit(path, SEVEN)
    copy_lora_tensors(reference, model)
    frozen = {n: p.data.clone() for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    model.eval()  # as in a rollout; FastModel keeps the NF4 layout (no bf16 repacking: see _bnb_reference)
    vision = VisionGRPO(model, proc)
    prompts = [vision.encode(row) for row in _prompt_rows()]
    samples = [p for p in prompts for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    completions = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (5, 3, 6, 1, 4, 7)]
    with torch.no_grad():
        want = torch.cat([_reference_logps(reference, proc, p, c) for p, c in zip(samples, completions)])
        with reference.disable_adapter():
            want_ref = torch.cat([_reference_logps(reference, proc, p, c) for p, c in zip(samples, completions)])
        assert _rel(want_ref, want) > 1e-3  # the adapters matter
        for share in (False, True):
            row = vision.policy_row(samples, completions, share_prompt=share,
                                    group_ids=[i // 2 for i in range(len(samples))], attention_backend="reference")
            got = completion_logprobs(model, row, kernel_backend="reference")[0]
            assert _rel(got, want) < 1e-5, (share, _rel(got, want))
            with model.disable_adapter():
                got_ref = completion_logprobs(model, row, kernel_backend="reference")[0]
            assert _rel(got_ref, want_ref) < 1e-5, (share, _rel(got_ref, want_ref))

    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, learning_rate=1e-2, beta=0.05, **FAST)
    rewards = lambda prompts, completions, size, **kw: [s / 400.0 + 0.1 * len(c[0]["content"])  # noqa: E731
                                                        for s, c in zip(size, completions)]
    trainer = GRPOTrainer(model, rewards, args=args, train_dataset=_prompt_rows()[:2], processing_class=proc)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 1 and torch.isfinite(torch.tensor(losses[0]))
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p.data, frozen[name]), f"{name}: a 4-bit weight changed"
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), before[n])]
    assert moved and all("lora_" in n for n in moved)


def test_sft_trainer_two_steps_on_a_4bit_model(saved, tmp_path):
    """SFTTrainer (MultimodalCollator's padding-free rows) on the 4-bit model from FastModel, with the
    processor FastModel loaded: its first step's loss is bitsandbytes + PEFT's per-example loss, and
    two steps move the adapters and leave the NF4 weights and the vision tower as they were."""
    import json

    from swiftune import SFTConfig, SFTTrainer
    from tests.test_qwen3_vl import _reference_loss

    path, proc, data = saved
    reference = _bnb_reference(path, SEVEN)
    base, processor = swiftune.FastModel.from_pretrained(path, load_in_4bit=True, **LOAD)
    model = swiftune.FastModel.get_peft_model(base, target_modules=SEVEN, use_gradient_checkpointing=False, **LORA)
    copy_lora_tensors(reference, model)
    with torch.no_grad():
        want = float(_reference_loss(reference, proc, data.examples))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=3,
                     learning_rate=1e-2, max_length=128, kernel_backend="reference",
                     attention_backend="reference", report_to="none", save_strategy="no", logging_steps=1, seed=1,
                     dataloader_pin_memory=False, disable_tqdm=True, use_cpu=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=_rows(), processing_class=processor)
    trainer.train()
    with open(tmp_path / "sft" / "metrics.jsonl") as f:  # the unrounded logged losses
        losses = [json.loads(line)["loss"] for line in f if "loss" in json.loads(line)]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert abs(losses[0] - want) / want < 1e-5, (losses[0], want)
    after = dict(model.named_parameters())
    for name, p in frozen.items():
        assert torch.equal(after[name].detach(), p), f"{name}: a frozen weight changed"
    assert all(not torch.equal(after[n].detach(), p) for n, p in before.items())


def test_a_given_bitsandbytes_config_keeps_its_skips_and_gains_the_tower(saved):
    """A caller's ``quantization_config`` with its own skip list: both its modules and the tower stay
    unquantised, and the caller's config object is left as it was."""
    path, _, _ = saved
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32,
                                llm_int8_skip_modules=["model.language_model.layers.1.mlp"])
    model, _ = swiftune.FastModel.from_pretrained(path, quantization_config=config, **LOAD)
    assert config.llm_int8_skip_modules == ["model.language_model.layers.1.mlp"]
    assert type(model.model.language_model.layers[1].mlp.up_proj) is nn.Linear
    assert type(model.model.language_model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    assert type(model.model.visual.blocks[0].mlp.linear_fc1) is nn.Linear and type(model.lm_head) is nn.Linear


def test_unquantized_vision_tower_check_names_a_quantised_tower(saved):
    """The load refuses a vision tower that ended up quantised (what a renamed module would do)."""
    from swiftune.models.qwen3_vl import check_vision_tower_unquantized

    path, _, _ = saved
    model = AutoModelForImageTextToText.from_pretrained(path, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32), dtype=torch.float32, device_map="cpu")
    assert type(model.model.visual.blocks[0].attn.qkv).__name__ == "Linear4bit"  # bitsandbytes' default: all of it
    with pytest.raises(RuntimeError, match="vision tower was quantised"):
        check_vision_tower_unquantized(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qlora_parity(saved, dtype):
    """On CUDA: FastModel's 4-bit model with its defaults (compiled kernels, the automatic packed
    attention, checkpointing) and LoRA on the text and vision linears (and, by the name "proj", the
    patch embedding's Conv3d) against bitsandbytes + PEFT in float32 on each example alone (TF32 off):
    loss and every LoRA gradient; fp32 to 1e-4 and 1e-3; bf16 compute within three times the plain
    libraries' own bf16 error on each tensor (bitsandbytes + PEFT in bf16 against the same float32
    truth), at least 2e-2."""
    from tests.test_qwen3_vl import _collator, _grads, _patched_loss, _reference_loss, _rel

    path, proc, data = saved
    targets = SEVEN + VISION_LINEARS

    def reference_step(compute: torch.dtype, adapters_of: nn.Module | None = None):
        reference = _bnb_reference(path, targets, device="cuda", dtype=compute)
        if adapters_of is not None:
            copy_lora_tensors(adapters_of, reference)
        loss = _reference_loss(reference, proc, data.examples)
        loss.backward()
        return reference, loss.detach(), _grads(reference)

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        reference, ref_loss, ref_grads = reference_step(torch.float32)
        model, _ = swiftune.FastModel.from_pretrained(path, load_in_4bit=True, dtype=dtype)
        model = swiftune.FastModel.get_peft_model(model, target_modules=targets, **LORA).train()
        _assert_vision_tower_unquantized(model, dtype)
        copy_lora_tensors(reference, model)
        batch = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in _collator(reference, proc)(data.examples).items()}
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
        loss = _patched_loss(model, batch)
        loss.backward()
        grads = _grads(model)
        if dtype == torch.bfloat16:
            plain = reference_step(dtype, adapters_of=reference)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if dtype == torch.float32:
        loss_tol, tols = 1e-4, dict.fromkeys(ref_grads, 1e-3)
    else:
        loss_tol = max(2e-2, 3 * _rel(plain[1], ref_loss))
        tols = {n: max(2e-2, 3 * _rel(plain[2][n], g)) for n, g in ref_grads.items()}
    assert torch.isfinite(loss) and _rel(loss.detach(), ref_loss) < loss_tol, (float(loss), float(ref_loss))
    assert ref_grads.keys() == grads.keys() and ref_grads
    for name, ref in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        if ref.abs().max() > 0:
            assert grads[name].abs().max() > 0, name
        assert _rel(grads[name], ref) < tols[name], (name, _rel(grads[name], ref), tols[name])
