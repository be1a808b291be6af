"""The memory planner on Qwen3-VL: the vision tower's weights, LoRA adapters and activations.

References: transformers' own Qwen3-VL built on the meta device (parameter counts, which linears
4-bit loading quantises), PEFT's own LoRA (adapter counts), autograd's saved-tensor hooks on one real
vision block (what a block saves per patch), and swiftune's data pipeline on real images (how many
patches the tower sees for the image tokens of a row).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3VLForConditionalGeneration"):
    pytest.skip("this transformers has no Qwen3-VL", allow_module_level=True)

from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration  # noqa: E402

from swiftune.cli.plan import main_plan  # noqa: E402
from swiftune.memory import KNOWN_MODELS, lora_param_count, max_tokens, model_shape, param_count, plan_memory  # noqa: E402
from swiftune.memory.planner import (QUANTIZED_WEIGHT_BYTES, TrainSetup, _vision_saved_per_patch,  # noqa: E402
                                     vision_activation_bytes)
from swiftune.memory.shapes import linear_weight_count, vision_param_count  # noqa: E402

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VISION_LINEARS = ["qkv", "proj", "linear_fc1", "linear_fc2"]
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def _config(tie: bool | None = False, deepstack=(0, 1), **vision) -> Qwen3VLConfig:
    sizes = dict(depth=2, hidden_size=32, intermediate_size=72, num_heads=2, out_hidden_size=64, patch_size=4,
                 num_position_embeddings=64, deepstack_visual_indexes=list(deepstack))
    sizes.update(vision)
    return Qwen3VLConfig(text_config=dict(TEXT), vision_config=sizes,
                         **({} if tie is None else {"tie_word_embeddings": tie}))


def _meta_model(config) -> nn.Module:
    with torch.device("meta"):
        return Qwen3VLForConditionalGeneration(config)


@pytest.mark.parametrize("tie,deepstack", [(False, (0, 1)), (True, ()), (None, (1,))])
def test_param_count_equals_transformers_qwen3_vl(tmp_path, tie, deepstack):
    config = _config(tie, deepstack)
    model = _meta_model(config)
    shape = model_shape(config)
    assert shape.vision is not None and shape.qk_norm and shape.vision.deepstack == len(deepstack)
    config.save_pretrained(tmp_path)
    assert model_shape(str(tmp_path)) == model_shape(config.to_dict()) == shape
    assert param_count(shape) == sum(p.numel() for p in model.parameters())
    assert vision_param_count(shape.vision) == sum(p.numel() for p in model.model.visual.parameters())


def test_qwen3_vl_8b_shape_is_the_released_model():
    """The known shape builds the released parameter count (8.77B: Qwen3-VL-8B-Instruct's model card),
    its tower is transformers' Qwen3VLVisionConfig defaults but for the projection to the text's
    width, and its text decoder is Qwen3-8B's."""
    fields = KNOWN_MODELS["qwen3-vl-8b"]
    config = Qwen3VLConfig(text_config=fields["text_config"], vision_config=fields["vision_config"],
                           tie_word_embeddings=fields["tie_word_embeddings"])
    model = _meta_model(config)
    assert param_count(model_shape("qwen3-vl-8b")) == sum(p.numel() for p in model.parameters()) == 8_767_123_696
    defaults = transformers.Qwen3VLConfig().vision_config
    for key, value in fields["vision_config"].items():
        if key != "out_hidden_size":
            assert list(getattr(defaults, key)) == value if isinstance(value, list) else getattr(defaults, key) == value
    text = model_shape("qwen3-vl-8b")
    qwen3 = model_shape("qwen3-8b")
    assert (text.hidden, text.intermediate, text.layers, text.heads, text.kv_heads, text.head_dim, text.vocab,
            text.tied) == (qwen3.hidden, qwen3.intermediate, qwen3.layers, qwen3.heads, qwen3.kv_heads,
                           qwen3.head_dim, qwen3.vocab, qwen3.tied)


# (explicit vision names would also match the patch embedding's Conv3d, "proj", which PEFT adapts too)
@pytest.mark.parametrize("targets", ["all-linear", SEVEN], ids=["all-linear", "text-projections"])
def test_lora_param_count_equals_peft(targets):
    from peft import LoraConfig, get_peft_model

    config = _config()
    torch.manual_seed(0)
    model = get_peft_model(Qwen3VLForConditionalGeneration(config), LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(model_shape(config), 8, vision=targets != SEVEN) == trainable
    plan = plan_memory(config, 512, 8, train_vision=targets != SEVEN)
    assert plan.trainable_params == trainable


def test_quantised_weights_are_the_text_projections_only():
    """4-bit and FP8 loads quantise the text decoder's projections (tests/test_qwen3_vl_quantized.py):
    the planner's quantised count is exactly those linears' weights; the vision tower, mergers,
    embeddings and head stay in the load dtype."""
    config = _config()
    model = _meta_model(config)
    shape = model_shape(config)
    text_linears = [m for n, m in model.model.language_model.named_modules() if isinstance(m, nn.Linear)]
    assert linear_weight_count(shape) == sum(m.weight.numel() for m in text_linears)
    P, linear = param_count(shape), linear_weight_count(shape)
    for quantization in ("nf4_double_quant", "fp8"):
        plan = plan_memory(config, 512, weight_quantization=quantization)
        expected = (P - linear) * 2 + int(linear * QUANTIZED_WEIGHT_BYTES[quantization])
        assert plan.weights - expected == (0 if quantization != "fp8" else 4 * sum(m.out_features for m in text_linears))
    big = plan_memory("qwen3-vl-8b", 4096, weight_quantization="nf4_double_quant")
    # the bf16 tower (576M parameters) is part of the 4-bit model's weights
    assert big.weights > 2 * vision_param_count(model_shape("qwen3-vl-8b").vision) > 1e9


def _saved_bytes_per_patch(dtype: torch.dtype, lora: bool, patches: int = 96) -> float:
    """What one real vision block saves for backward, per patch (autograd's saved-tensor hooks; each
    storage counted once, the block's parameters and its input left out)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = _config(depth=1, hidden_size=64, intermediate_size=160, num_heads=4, deepstack=())
    config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).to(dtype)
    if lora:
        for p in model.parameters():
            p.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=4, target_modules=VISION_LINEARS, lora_dropout=0.0), model)
        for name, p in model.named_parameters():  # float32 adapters, as get_peft_model makes them
            if "lora_" in name:
                p.data = p.data.float()
    block = model.model.visual.blocks[0]
    x = torch.randn(patches, 64, dtype=dtype, requires_grad=True)
    half = patches // 3  # two images
    cu_seqlens = torch.tensor([0, half, patches], dtype=torch.int32)
    cos, sin = torch.randn(patches, 16, dtype=dtype), torch.randn(patches, 16, dtype=dtype)
    storages: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin)).sum().backward()
    return sum(storages.values()) / patches


@pytest.mark.parametrize("dtype,lora", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
                         ids=["fp32-full", "fp32-lora", "bf16-lora-fp32-adapters"])
def test_vision_block_saved_bytes_equal_autograd(dtype, lora):
    config = _config(depth=1, hidden_size=64, intermediate_size=160, num_heads=4, deepstack=())
    b = 2 if dtype == torch.bfloat16 else 4
    setup = TrainSetup(lora_rank=4, full_finetune=not lora, dtype_bytes=b, lora_dtype_bytes=4)
    assert setup.lora_copies_input == (lora and b == 2)
    want = _vision_saved_per_patch(model_shape(config).vision, setup)
    # the CPU LayerNorm keeps its mean and rstd in the input dtype (CUDA: float32, the formula's)
    cpu_norm_stats = 2 * 2 * (4 - b)
    assert _saved_bytes_per_patch(dtype, lora) == want - cpu_norm_stats


def test_image_tokens_are_the_patches_the_data_pipeline_gives_the_tower():
    """``image_tokens x merge^2`` patches of ``C t p^2`` values: what swiftune's multimodal data gives
    the tower for the image tokens of its rows (tests/test_qwen3_vl.py's processor and rows)."""
    pytest.importorskip("PIL")
    from swiftune.data.multimodal import IMAGE_TOKEN, prepare_multimodal_dataset
    from tests.test_qwen3_vl import _model, _processor, _rows

    proc = _processor()
    shape = model_shape(_model(proc).config)
    for example in prepare_multimodal_dataset(_rows(), proc).examples:
        image_tokens = example["input_ids"].count(proc.token_id(IMAGE_TOKEN))
        if "pixel_values" not in example:
            assert image_tokens == 0
            continue
        assert tuple(example["pixel_values"].shape) == (image_tokens * shape.vision.patches_per_token,
                                                        shape.vision.patch_values)


def test_vision_activations_scale_with_the_image_tokens():
    base = plan_memory("qwen3-vl-8b", 8192, gpu_bytes=int(80e9))
    assert base.vision == base.vision_working_set == 0
    plans = {k: plan_memory("qwen3-vl-8b", 8192, gpu_bytes=int(80e9), image_tokens=k) for k in (1000, 2000)}
    assert plans[2000].vision == 2 * plans[1000].vision > 0
    assert plans[2000].vision_working_set == 2 * plans[1000].vision_working_set > 0
    assert plans[1000].weights == base.weights and plans[1000].checkpoints == base.checkpoints
    assert plans[1000].activations == base.activations - max(base.layer_working_set, base.loss) + max(
        base.layer_working_set, base.loss, plans[1000].vision_working_set) + plans[1000].vision
    shape, v = model_shape("qwen3-vl-8b"), model_shape("qwen3-vl-8b").vision
    setup = TrainSetup()
    # checkpointed per block: each block's input, the float32 pixels, the mergers' outputs and saved tensors
    patches = 1000 * 4
    want = (v.depth * patches * v.hidden * 2 + patches * v.patch_values * 4 + 4 * 1000 * v.out_hidden * 2
            + 4 * 1000 * 4 * v.merged_hidden * 2)
    assert vision_activation_bytes(shape, 1000, setup, True)[0] == want
    saved_frozen, _ = vision_activation_bytes(shape, 1000, TrainSetup(train_vision=False))
    saved_unckpt, _ = vision_activation_bytes(shape, 1000, setup, False)
    assert saved_frozen < want < saved_unckpt
    frozen = plan_memory("qwen3-vl-8b", 8192, image_tokens=1000, train_vision=False)
    assert frozen.trainable_params == lora_param_count(shape, 16, vision=False) < plans[1000].trainable_params


def test_max_tokens_keeps_the_image_tokens():
    kw = dict(weight_quantization="nf4_double_quant", gradient_checkpointing="offload", image_tokens=2048)
    best = max_tokens("qwen3-vl-8b", int(24e9), **kw)
    assert best > 2048
    assert plan_memory("qwen3-vl-8b", best, gpu_bytes=int(24e9), **kw).fits
    assert not plan_memory("qwen3-vl-8b", best + 1, gpu_bytes=int(24e9), **kw).fits
    assert best < max_tokens("qwen3-vl-8b", int(24e9), weight_quantization="nf4_double_quant",
                             gradient_checkpointing="offload")
    assert max_tokens("qwen3-vl-8b", int(8e9), **kw) == 0  # the weights alone take most of it


def test_bad_image_token_counts_are_refused():
    with pytest.raises(ValueError, match="image_tokens must be between 0 and tokens"):
        plan_memory("qwen3-vl-8b", 100, image_tokens=101)
    with pytest.raises(ValueError, match="image_tokens must be between 0 and tokens"):
        plan_memory("qwen3-vl-8b", 100, image_tokens=-1)
    with pytest.raises(ValueError, match="needs a vision-language model"):
        plan_memory("qwen3-8b", 100, image_tokens=10)


def test_cli_plans_qwen3_vl_8b_qlora(capsys):
    argv = ["--model", "qwen3-vl-8b", "--load_in_4bit", "--tokens", "32768", "--gpu_gb", "24",
            "--gradient_checkpointing", "offload"]
    assert main_plan(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = plan_memory("qwen3-vl-8b", 32768, gpu_bytes=int(24e9), gradient_checkpointing="offload",
                       weight_quantization="nf4_double_quant")
    assert data["plan"]["params"] == 8_767_123_696 and data["plan"]["weights"] == want.weights
    assert data["max_tokens"] == max_tokens("qwen3-vl-8b", int(24e9), gradient_checkpointing="offload",
                                            weight_quantization="nf4_double_quant")
    assert main_plan(argv) == 0
    assert "8,767,123,696 params" in capsys.readouterr().out


def test_cli_image_tokens_reach_the_plan(capsys):
    """``swiftune plan --image_tokens N`` plans the vision tower's activations for N image tokens (as
    plan_memory(image_tokens=N)); on a text-only model it ends in one line naming a vision model."""
    argv = ["--model", "qwen3-vl-8b", "--load_in_4bit", "--tokens", "32768", "--gpu_gb", "24", "--json"]
    assert main_plan(argv + ["--image_tokens", "1024"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = plan_memory("qwen3-vl-8b", 32768, gpu_bytes=int(24e9), weight_quantization="nf4_double_quant",
                       image_tokens=1024)
    assert data["plan"]["vision"] == want.vision > 0 and data["plan"]["image_tokens"] == 1024
    assert main_plan(argv) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["vision"] == 0
    assert main_plan(["--model", "qwen3-8b", "--tokens", "100", "--image_tokens", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a vision-language model" in err[0]
