"""Qwen3-VL: patched language model on padding-free image-text rows against transformers' own model.

The reference is the unpatched ``Qwen3VLForConditionalGeneration`` run on each example alone (its
own M-RoPE index, its own attention): the loss is the sum of every example's token losses over
the total trained-token count, and every trainable tensor's gradient must match (full fine-tuning
and PEFT LoRA on the language model's seven projections), fp32 on CPU.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import swiftune
from swiftune.attention.packing import build_packed_batch, packed_batch_from_document_ids
from swiftune.data.builtin import build_tokenizer
from swiftune.data.multimodal import (
    IMAGE_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    MultimodalCollator,
    VisionProcessor,
    prepare_multimodal_dataset,
)
from swiftune.data.row_formats import DataFormatError
from swiftune.models.heads import hidden_states_and_head
from swiftune.models.support import controls_attention
from swiftune.models.qwen3_vl import install_vision_language_attention, rope_index_of
from swiftune.models.state import is_bound

transformers = pytest.importorskip("transformers")
try:  # the GPU machine may lack Pillow: then images are random patch tensors (RandomPatches below)
    from PIL import Image
except ImportError:
    Image = None
needs_pil = pytest.mark.skipif(Image is None, reason="needs Pillow (transformers' image processor)")
if not hasattr(transformers, "Qwen3VLForConditionalGeneration"):
    pytest.skip("this transformers has no Qwen3-VL", allow_module_level=True)

# On a CUDA machine Triton kernels need CUDA tensors: the CPU cases use the reference kernels there,
# and test_gpu_parity runs the compiled kernels.
CPU_KERNELS = ["reference"] if torch.cuda.is_available() else ["triton", "reference"]
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _processor() -> VisionProcessor:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_TOKEN,
                                                                "<|video_pad|>"]})
    if Image is None:
        return VisionProcessor(tokenizer, RandomPatches())
    with warnings.catch_warnings():  # no torchvision here: transformers falls back to its PIL processor
        warnings.simplefilter("ignore")
        image_processor = transformers.Qwen2VLImageProcessor(
            patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 64, "longest_edge": 32 * 32})
    return VisionProcessor(tokenizer, image_processor)


class RandomPatches:
    """Without Pillow: an "image" is ``(h, w, seed)`` and its patches random numbers, in the layout of
    transformers' Qwen2-VL image processor (patch 4, temporal patch 2, merge 2, 3 channels)."""

    merge_size = 2

    def __call__(self, images, return_tensors="pt"):
        grids = torch.tensor([[1, h // 4, w // 4] for h, w, _ in images])
        patches = [torch.randn(int(g.prod()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))
                   for g, (_, _, seed) in zip(grids, images)]
        return {"pixel_values": torch.cat(patches), "image_grid_thw": grids}


def _model(proc: VisionProcessor) -> torch.nn.Module:
    ids = proc.tokenizer.convert_tokens_to_ids([VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_TOKEN, "<|video_pad|>"])
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}, tie_word_embeddings=False),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
    )
    torch.manual_seed(0)
    return transformers.Qwen3VLForConditionalGeneration(config).float()


def _image(h: int, w: int, seed: int):
    if Image is None:
        return (h, w, seed)
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def _rows() -> list[dict]:
    image = {"type": "image"}
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": _image(16, 24, 0)},
                                                   {"type": "text", "text": "what is it?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]},
        {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "two:"}, image, image]},
                      {"role": "assistant", "content": [{"type": "text", "text": "dog, bird"}]}],
         "images": [_image(24, 16, 1), _image(16, 16, 2)]},
    ]


@pytest.fixture(scope="module")
def setup():
    proc = _processor()
    data = prepare_multimodal_dataset(_rows(), proc)
    return proc, _model(proc), data


def _collator(model, proc) -> MultimodalCollator:
    return MultimodalCollator(rope_index_of(model), proc.token_id(IMAGE_TOKEN))


def _reference_loss(model, proc, examples) -> torch.Tensor:
    """transformers' model on each example alone: summed token losses / all trained tokens."""
    total, count = 0.0, 0
    image_id = proc.token_id(IMAGE_TOKEN)
    device = next(model.parameters()).device
    for example in examples:
        ids = torch.tensor([example["input_ids"]], device=device)
        inputs = {"input_ids": ids, "mm_token_type_ids": (ids == image_id).int()}
        if "pixel_values" in example:
            inputs.update(pixel_values=example["pixel_values"].to(device),
                          image_grid_thw=example["image_grid_thw"].to(device))
        logits = model(**inputs).logits[0, :-1].double()
        mask = torch.tensor(example["completion_mask"][1:], device=device).bool()
        targets = torch.where(mask, ids[0, 1:], -100)
        total = total + F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    return total / count


def _patched_loss(model, batch) -> torch.Tensor:
    batch = dict(batch)
    labels = batch.pop("labels")
    for key in ("row_tokens", "num_trained_tokens", "num_tokens", "num_padding_tokens"):
        batch.pop(key)
    hidden, head, _ = hidden_states_and_head(model, **batch)
    logits = head(hidden)[0, :-1].double()
    return F.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum") / int((labels != -100).sum())


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _check_parity(reference, patched, proc, examples):
    ref_loss = _reference_loss(reference, proc, examples)
    ref_loss.backward()
    batch = _collator(reference, proc)(examples)
    assert batch["pixel_values"].shape[0] == sum(e["pixel_values"].shape[0] for e in examples if "pixel_values" in e)
    loss = _patched_loss(patched, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert _rel(loss.detach(), ref_loss.detach()) < 1e-5, (float(loss), float(ref_loss))
    ref_grads, grads = _grads(reference), _grads(patched)
    assert ref_grads.keys() == grads.keys() and ref_grads
    for name, ref in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        assert _rel(grads[name], ref) < 1e-5, (name, _rel(grads[name], ref))
        if ref.abs().max() > 0:
            assert grads[name].abs().max() > 0, name
    return batch


def test_patch_binds_text_decoder_only(setup):
    proc, base, _ = setup
    model = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    text = model.model.language_model
    assert all(is_bound(layer.self_attn) and is_bound(layer.mlp) and is_bound(layer.input_layernorm)
               and is_bound(layer.self_attn.q_norm) for layer in text.layers)
    assert is_bound(text.norm)
    assert not any(is_bound(m) for m in model.model.visual.modules())
    assert model.config.text_config._attn_implementation == "swiftune_packed"
    assert model.config.vision_config._attn_implementation == base.config.vision_config._attn_implementation
    assert controls_attention(model)
    swiftune.patch_model(model, attention="reference")  # again: harmless
    assert controls_attention(model)


@pytest.mark.parametrize("kernel_backend", CPU_KERNELS)
def test_full_finetuning_parity(setup, kernel_backend):
    """Loss and every gradient (vision tower and deepstack mergers included) of a padding-free row
    of two image-text examples and one text-only example equal the per-example reference."""
    proc, base, data = setup
    reference = copy.deepcopy(base)
    patched = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend=kernel_backend)
    # the Triton interpreter is slow on CPU: there, one image-text and the text-only example
    examples = data.examples[:2] if kernel_backend == "triton" else data.examples
    batch = _check_parity(reference, patched, proc, examples)
    assert batch["input_ids"].shape[0] == 1 and batch["document_ids"][0].unique().numel() == len(examples)
    assert any("deepstack_merger_list" in n for n in _grads(patched))


VISION_LINEARS = ["qkv", "proj", "linear_fc1", "linear_fc2"]  # vision blocks' attention / MLP and the mergers


@pytest.mark.parametrize("vision", [False, True])
def test_lora_parity(setup, vision):
    """PEFT LoRA on the language model's seven projections (and, optionally, on the vision tower's
    and the mergers' linears as well)."""
    peft = pytest.importorskip("peft")
    proc, base, data = setup
    targets = SEVEN + (VISION_LINEARS if vision else [])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    reference = peft.get_peft_model(copy.deepcopy(base), config)
    patched = copy.deepcopy(reference)
    swiftune.patch_model(patched, attention="reference", kernel_backend="reference")
    names = [n for n, p in patched.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} == set(targets)
    assert all("language_model" in n for n in names) != vision
    _check_parity(reference, patched, proc, data.examples)


def test_document_ids_are_what_keeps_examples_apart(setup):
    """The same row without document_ids (M-RoPE positions only, which cannot say where examples
    start) is one document: the later examples' logits change. So the parity above rests on the
    explicit document ids."""
    proc, base, data = setup
    patched = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    batch = _collator(base, proc)(data.examples)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "document_ids", "pixel_values", "image_grid_thw")}
    with torch.no_grad():
        ref = _reference_loss(base, proc, data.examples)
        assert _rel(_patched_loss(patched, batch), ref) < 1e-5
        separate = patched(**inputs).logits
        inputs.pop("document_ids")
        mixed = patched(**inputs).logits
    first = len(data.examples[0]["input_ids"])
    assert _rel(mixed[:, :first], separate[:, :first]) < 1e-5  # the first example sees nothing before it
    assert _rel(mixed[:, first:], separate[:, first:]) > 1e-2  # the others saw the examples before them


def test_document_ids_refused_without_packed_attention(setup):
    proc, base, data = setup
    model = copy.deepcopy(base)
    install_vision_language_attention(model, "reference")
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": "sdpa"})
    batch = _collator(base, proc)(data.examples[:1])
    with pytest.raises(ValueError, match="patch_model"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"],
              pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])


def test_layout_from_document_ids():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [3, 3, 4, 4, 4, 4]])
    packed = packed_batch_from_document_ids(docs)
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12] and packed.max_seqlen == 4
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    packed = packed_batch_from_document_ids(docs, mask)
    # same as the position rule on the equivalent restarting positions
    expected = build_packed_batch(2, 6, torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]), mask)
    assert packed.cu_seqlens.tolist() == expected.cu_seqlens.tolist() == [0, 3, 5, 7, 9]
    assert packed.indices.tolist() == expected.indices.tolist()
    # a row start always starts a document, even with the same label
    assert packed_batch_from_document_ids(torch.zeros(2, 3, dtype=torch.long)).cu_seqlens.tolist() == [0, 3, 6]


def test_completion_mask_is_the_assistant_text(setup):
    proc, _, data = setup
    image_id = proc.token_id(IMAGE_TOKEN)
    answers = ["a cat", "hi there", "dog, bird"]
    for example, answer in zip(data.examples, answers):
        trained = [t for t, m in zip(example["input_ids"], example["completion_mask"]) if m]
        assert proc.tokenizer.decode(trained) == answer + "<|im_end|>"
        grid = example.get("image_grid_thw")
        n_image = 0 if grid is None else int((grid.prod(-1) // 4).sum())
        assert example["input_ids"].count(image_id) == n_image
    assert data.lengths == [len(e["input_ids"]) for e in data.examples]  # image tokens count in the budget
    assert data.stats.num_examples == 3


def test_packed_rows_parity(setup):
    """max_length packs examples into padded rows: each document still equals its own run."""
    proc, base, data = setup
    reference = copy.deepcopy(base)
    patched = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    collate = MultimodalCollator(rope_index_of(base), proc.token_id(IMAGE_TOKEN),
                                 max_length=max(data.lengths) + 2, pad_token_id=proc.tokenizer.pad_token_id)
    batch = collate(data.examples)
    assert batch["input_ids"].shape[0] >= 2 and batch["num_padding_tokens"] > 0
    with torch.no_grad():
        ref = _reference_loss(reference, proc, data.examples)
        b = dict(batch)
        labels = b.pop("labels")
        for key in ("row_tokens", "num_trained_tokens", "num_tokens", "num_padding_tokens"):
            b.pop(key)
        hidden, head, _ = hidden_states_and_head(patched, **b)
        logits = head(hidden)[:, :-1].double()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                               reduction="sum") / int((labels != -100).sum())
    assert _rel(loss, ref) < 1e-5


@pytest.mark.parametrize("packing", [False, True])
def test_sft_trainer_on_image_text_rows(setup, tmp_path, packing):
    """SFTTrainer takes the model, a VisionProcessor and image-text rows: the evaluation loss and the
    first step's loss are the per-example reference's, and in two steps every trainable tensor with
    a reference gradient moves."""
    import json

    from swiftune import SFTConfig, SFTTrainer

    proc, base, data = setup
    model = copy.deepcopy(base)
    reference = copy.deepcopy(base)
    ref_loss = _reference_loss(reference, proc, data.examples)
    ref_loss.backward()
    ref = float(ref_loss)
    # the last deepstack merger feeds only image tokens after the last decoder layer, whose outputs
    # are never trained: its reference gradient is zero, so it is not expected to move
    moving = {n for n, g in _grads(reference).items() if g.abs().max() > 0}
    assert any(n.startswith("model.visual.") for n in moving)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = SFTConfig(output_dir=str(tmp_path / "vl"), max_steps=2, per_device_train_batch_size=3,
                     per_device_eval_batch_size=3, learning_rate=1e-3,
                     max_length=128, packing=packing, kernel_backend="reference", attention_backend="reference",
                     report_to="none", save_strategy="no", logging_steps=1, seed=1, dataloader_pin_memory=False,
                     disable_tqdm=True, use_cpu=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=_rows(), eval_dataset=_rows(), processing_class=proc)
    assert trainer.train_dataset.lengths == data.lengths  # image tokens count in the token budget
    assert abs(trainer.evaluate()["eval_loss"] - ref) / ref < 1e-5
    trainer.train()
    with open(tmp_path / "vl" / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f if "loss" in json.loads(line)]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert abs(losses[0] - ref) / ref < 1e-4, (losses[0], ref)
    for name, p in model.named_parameters():
        if name in moving:
            assert not torch.equal(p.detach(), before[name]), name


def test_sft_trainer_on_text_rows_of_a_vision_language_model(setup, tmp_path):
    """Text-only rows on a Qwen3-VL model with its processor (they failed: the processor has no chat
    template or eos_token_id of its own): tokenized by its tokenizer, batched padding-free, and the
    evaluation loss, the first step's loss and every trainable tensor's gradient in it are transformers'
    on each example alone."""
    import json

    from transformers import TrainerCallback

    from swiftune import SFTConfig, SFTTrainer

    class FirstGradients(TrainerCallback):  # what the optimizer's first step would apply (no clipping)
        grads: dict[str, torch.Tensor] = {}

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not self.grads:
                self.grads.update(grads_or_zeros(model))

    def grads_or_zeros(module):  # the vision tower sees no text row: no gradient at all
        return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for n, p in module.named_parameters() if p.requires_grad}

    proc, base, _ = setup
    rows = [{"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there"}]},
            {"messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two three"}]},
            {"messages": [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]}]
    model = copy.deepcopy(base)
    args = SFTConfig(output_dir=str(tmp_path / "text"), max_steps=1, per_device_train_batch_size=3,
                     per_device_eval_batch_size=3, learning_rate=1e-3, max_length=128, kernel_backend="reference",
                     attention_backend="reference", report_to="none", save_strategy="no", logging_steps=1, seed=1,
                     dataloader_pin_memory=False, disable_tqdm=True, use_cpu=True, max_grad_norm=0.0)
    captured = FirstGradients()
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, processing_class=proc,
                         callbacks=[captured])
    assert trainer.batch_layout == "padding_free" and trainer.processing_class is proc.tokenizer
    reference = copy.deepcopy(base)
    ref_loss = _reference_loss(reference, proc, trainer.train_dataset.examples)
    ref_loss.backward()
    ref = float(ref_loss)
    assert abs(trainer.evaluate()["eval_loss"] - ref) / ref < 1e-5
    trainer.train()
    with open(tmp_path / "text" / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f if "loss" in json.loads(line)]
    assert abs(losses[0] - ref) / ref < 1e-4, (losses[0], ref)
    ref_grads = grads_or_zeros(reference)
    assert captured.grads.keys() == ref_grads.keys()
    moving = [n for n, g in ref_grads.items() if g.abs().max() > 0]
    assert moving and not any(n.startswith("model.visual.") for n in moving)  # text rows: the tower is idle
    for name, ref_grad in ref_grads.items():
        assert _rel(captured.grads[name], ref_grad) < 1e-4, (name, _rel(captured.grads[name], ref_grad))
        if name in moving:
            assert captured.grads[name].abs().max() > 0, name


@needs_pil
def test_fast_model_loads_and_patches_qwen3_vl(setup, tmp_path):
    """FastModel.from_pretrained loads a saved Qwen3-VL checkpoint as an image-text model, patched,
    with its processor (tokenizer + image processor); its logits equal the saved model's."""
    proc, base, data = setup
    path = tmp_path / "vl"
    base.save_pretrained(path)
    proc.tokenizer.save_pretrained(path)
    proc.image_processor.save_pretrained(path)
    model, processor = swiftune.FastModel.from_pretrained(str(path), dtype=torch.float32, kernel_backend="reference",
                                                          attn_implementation="reference", device_map={"": "cpu"})
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and controls_attention(model)
    assert model.config.vision_config._attn_implementation == "sdpa"  # loaded eager: the vision tower takes sdpa
    loaded = VisionProcessor.of(processor)
    example = prepare_multimodal_dataset(_rows()[:1], loaded).examples[0]
    assert example["input_ids"] == data.examples[0]["input_ids"]
    batch = MultimodalCollator(rope_index_of(model), loaded.token_id(IMAGE_TOKEN))([example])
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "document_ids", "pixel_values", "image_grid_thw")}
    with torch.no_grad():
        got = model(**inputs).logits
        ids = batch["input_ids"]
        want = base(input_ids=ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                    mm_token_type_ids=(ids == loaded.token_id(IMAGE_TOKEN)).int()).logits
    assert _rel(got, want) < 1e-5  # 4-bit and FP8 loads: tests/test_qwen3_vl_quantized.py


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_parity(setup, dtype):
    """On CUDA: compiled Triton kernels and the automatic packed attention (flex in fp32, a varlen /
    flash kernel in bf16) against transformers per example in fp32 (TF32 off), loss and every
    gradient; fp32 to 1e-4, bf16 to 2e-2 (bf16 weights and activations against the fp32 reference)."""
    proc, base, data = setup
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        reference = copy.deepcopy(base).cuda()
        patched = swiftune.patch_model(copy.deepcopy(base).to("cuda", dtype), attention="auto", kernel_backend="auto")
        ref_loss = _reference_loss(reference, proc, data.examples)
        ref_loss.backward()
        batch = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in _collator(base, proc)(data.examples).items()}
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
        loss = _patched_loss(patched, batch)
        loss.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(loss) and _rel(loss.detach(), ref_loss.detach()) < tol
    ref_grads, grads = _grads(reference), _grads(patched)
    for name, ref in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        if ref.abs().max() > 0:
            assert _rel(grads[name], ref) < tol * (5 if dtype == torch.bfloat16 else 1), name


@pytest.mark.parametrize("mode", [True, "offload"])
def test_checkpointed_parity(setup, mode):
    """Gradient checkpointing (and its offloaded form) of the patched model: the same loss and
    gradients (the packed layout travels with the layers' keyword arguments into the recompute)."""
    from swiftune.training.loading import enable_gradient_checkpointing

    proc, base, data = setup
    reference = copy.deepcopy(base)
    patched = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    enable_gradient_checkpointing(patched, mode)
    patched.train()
    _check_parity(reference, patched, proc, data.examples)


def test_generate_matches_transformers(setup):
    """transformers' generate on the patched model (prefill of an image prompt through the packed
    layout, then decoding against the cache) gives the unpatched model's greedy tokens."""
    proc, base, data = setup
    patched = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    example = data.examples[0]
    ids = torch.tensor([example["input_ids"]])
    kwargs = dict(input_ids=ids, pixel_values=example["pixel_values"], image_grid_thw=example["image_grid_thw"],
                  mm_token_type_ids=(ids == proc.token_id(IMAGE_TOKEN)).int(), max_new_tokens=5, do_sample=False)
    assert torch.equal(patched.generate(**kwargs), base.generate(**kwargs))


def tiny_vl_moe(dense: torch.nn.Module, scale: float, **text_fields) -> torch.nn.Module:
    """A Qwen3-VL-MoE with ``dense``'s sizes and vision tower config: the first decoder layer sparse
    (4 experts, top 2), the second dense; router and experts drawn at ``scale`` (transformers'
    initialisation leaves the router at zero). ``text_fields`` go to the text config."""
    config = transformers.Qwen3VLMoeConfig(
        text_config={**dense.config.text_config.to_dict(), "moe_intermediate_size": 32, "num_experts": 4,
                     "num_experts_per_tok": 2, "mlp_only_layers": [1], **text_fields},
        vision_config=dense.config.vision_config.to_dict(),
        **{k: getattr(dense.config, k) for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                                  "video_token_id")})
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "mlp.gate." in name:
                p.normal_(0.0, scale)
    return model


def test_moe_variant_parity(setup):
    """Qwen3-VL-MoE (one sparse layer: transformers' router, experts as swiftune's grouped GEMMs; one
    dense layer): loss and every gradient, router and experts included, against transformers per
    example."""
    if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
        pytest.skip("this transformers has no Qwen3-VL-MoE")
    from swiftune.models.families import family_of

    proc, base, data = setup
    model = tiny_vl_moe(base, scale=0.05)
    assert family_of(model.config).moe
    patched = swiftune.patch_model(copy.deepcopy(model), attention="reference", kernel_backend="reference")
    experts = [m for m in patched.modules() if type(m).__name__ == "Qwen3VLMoeTextExperts"]
    assert experts and all(is_bound(m) for m in experts)
    _check_parity(model, patched, proc, data.examples)


def test_trls_images_column_layout_is_placed_as_trl_places_it(setup):
    """String messages with an 'images' column (TRL's layout): the images go before the first user
    message's text, as trl.data_utils.prepare_multimodal_messages puts them (they were dropped: a
    text-only example); more images than image parts is an error (one was dropped)."""
    proc, _, _ = setup
    image = _image(16, 24, 0)
    column = {"messages": [{"role": "user", "content": "what is it?"}, {"role": "assistant", "content": "a cat"}],
              "images": [image]}
    placed = {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                        {"type": "text", "text": "what is it?"}]},
                           {"role": "assistant", "content": "a cat"}]}
    got, want = (prepare_multimodal_dataset([row], proc).examples[0] for row in (column, placed))
    assert got["input_ids"] == want["input_ids"] and got["completion_mask"] == want["completion_mask"]
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    assert proc.token_id(IMAGE_TOKEN) in got["input_ids"]
    try:
        from trl.data_utils import prepare_multimodal_messages
    except ImportError:
        prepare_multimodal_messages = None
    if prepare_multimodal_messages is not None:  # TRL's own placement of the same row
        trl_user = prepare_multimodal_messages(column["messages"], images=column["images"])[0]["content"]
        assert [p["type"] for p in trl_user] == ["image", "text"]
    extra = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]},
                          {"role": "assistant", "content": "y"}], "images": [image, _image(16, 16, 1)]}
    with pytest.raises(DataFormatError, match="has 2 images but its messages' image parts take 1"):
        prepare_multimodal_dataset([extra], proc)


@needs_pil
def test_the_vision_processor_saves_and_text_rows_use_its_tokenizer(setup, tmp_path):
    """The fallback processor saves like a transformers processor (checkpoints and the commands' final
    save crashed on it); text rows and prompts on a vision-language model use its tokenizer."""
    from swiftune.data import text_tokenizer_of

    proc, _, _ = setup
    proc.save_pretrained(str(tmp_path))
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert reloaded.convert_tokens_to_ids(IMAGE_TOKEN) == proc.token_id(IMAGE_TOKEN)
    assert (tmp_path / "preprocessor_config.json").exists()
    assert text_tokenizer_of(proc) is proc.tokenizer and text_tokenizer_of(proc.tokenizer) is proc.tokenizer


@needs_pil
def test_generate_command_samples_text_prompts_from_a_vision_language_model(setup, tmp_path, capsys):
    """`swiftune generate` on a saved Qwen3-VL folder (it crashed: the processor is not a tokenizer): text
    prompts through transformers' engine, greedy tokens as transformers' own generate; the fast engine,
    which does not run the vision tower, is refused naming the engine to use."""
    import json as json_lib

    from swiftune.cli import main

    proc, base, _ = setup
    base.save_pretrained(tmp_path)
    proc.save_pretrained(str(tmp_path))
    argv = ["generate", "--model", str(tmp_path), "--prompt", "hello", "--max_tokens", "4", "--temperature", "0",
            "--json", "--dtype", "float32", "--engine", "transformers"]
    assert main(argv) == 0
    row = [json_lib.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")][0]
    ids = torch.tensor([proc.tokenizer("hello", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = base.generate(input_ids=ids, do_sample=False, max_new_tokens=4, min_new_tokens=4,
                            pad_token_id=proc.tokenizer.pad_token_id)
    assert row["completion"] == proc.tokenizer.decode(out[0, ids.shape[1]:])
    assert main(argv[:-1] + ["fast"]) == 2
    assert "--engine fast runs" in capsys.readouterr().err
