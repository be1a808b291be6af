"""Offloaded (host) gradient checkpointing on image-text rows (Qwen3-VL, issue 28), on CPU.

swiftune's offloaded checkpointing (:mod:`swiftune.training.checkpointing`) runs on CPU with the
same code path as on a GPU, its "host" pages plain CPU memory: with ``gpu_budget_bytes=0`` every
decoder layer's input is copied out in forward and restored for its recompute in backward; with a
host budget for fewer layers than it offloads, the missing inputs are *derived* (recomputed in
backward from the layer before). Qwen3-VL adds the deepstack visual features to the hidden states
between its first decoder layers, so a derived input must be the layer before's output *plus* its
deepstack features.

Reference: the unpatched transformers ``Qwen3VLForConditionalGeneration`` (and the MoE variant) on
each example alone, no checkpointing (tests/test_qwen3_vl.py's per-example loss). Compared: the loss
and every trainable tensor's gradient (non-zero where the reference's is) of one padding-free row
of three examples, two with images; full fine-tuning (vision tower and deepstack mergers included)
and PEFT LoRA on the text and vision linears.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swiftune
from swiftune.training.checkpointing import enable_offloaded_checkpointing, offload_stats

from tests.helpers import assert_gradients_match, copy_lora_tensors
from tests.test_qwen3_vl import SEVEN, VISION_LINEARS, _check_parity, _model, _processor, _rows, tiny_vl_moe, transformers

peft = pytest.importorskip("peft")
pytest.importorskip("PIL")

from swiftune.data.multimodal import prepare_multimodal_dataset  # noqa: E402

PAGE = 4096


@pytest.fixture(scope="module")
def setup():
    proc = _processor()
    base = _model(proc)
    assert len(base.config.vision_config.deepstack_visual_indexes) == 2  # features after both text layers
    return proc, base, prepare_multimodal_dataset(_rows(), proc)


def _layer_bytes(proc, data, model) -> int:
    tokens = sum(len(e["input_ids"]) for e in data.examples)
    return tokens * model.config.text_config.hidden_size * 4


def _offloaded(model, *, lora: bool, host_layers: int | None, layer_bytes: int):
    """``model`` patched, optionally with LoRA, every layer's input offloaded; ``host_layers``: room for that
    many layers' inputs on the host (None: all), the others derived."""
    patched = swiftune.patch_model(copy.deepcopy(model), attention="reference", kernel_backend="reference")
    if lora:
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN + VISION_LINEARS, lora_dropout=0.0,
                                 init_lora_weights=False)
        patched = peft.get_peft_model(patched, config)
    pages = -(-layer_bytes // PAGE)
    host = None if host_layers is None else host_layers * pages * PAGE
    enable_offloaded_checkpointing(patched, gpu_budget_bytes=0, host_budget_bytes=host, page_bytes=PAGE)
    return patched.train()


def _reference_of(base, patched, lora: bool):
    """The unpatched model with ``patched``'s LoRA weights (PEFT's own), or a plain copy."""
    reference = copy.deepcopy(base)
    if not lora:
        return reference
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN + VISION_LINEARS, lora_dropout=0.0,
                             init_lora_weights=False)
    reference = peft.get_peft_model(reference, config)
    copy_lora_tensors(patched, reference)  # the same adapter names on both sides, at least one
    return reference


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("host_layers", [None, 1], ids=["all-offloaded", "one-derived"])
def test_offloaded_checkpointing_on_image_rows_equals_transformers(setup, lora, host_layers):
    proc, base, data = setup
    layer_bytes = _layer_bytes(proc, data, base)
    patched = _offloaded(base, lora=lora, host_layers=host_layers, layer_bytes=layer_bytes)
    reference = _reference_of(base, patched, lora)
    _check_parity(reference, patched, proc, data.examples)
    stats = offload_stats(patched)
    assert stats["layer_bytes"] == layer_bytes  # the one padding-free row's hidden states
    if host_layers is None:
        assert stats["offload"] == (0, 1) and stats["derived"] == () and stats["restored"] == 2
    else:  # layer 1's input (layer 0's output + deepstack features) recomputed in backward
        assert stats["offload"] == (0,) and stats["derived"] == (1,)
        assert stats["restored"] == 1 and stats["derived_recomputed"] == 1
    assert stats["host_in_use_bytes"] == 0  # every page back in the pool after backward


def test_offloaded_checkpointing_on_image_rows_of_the_moe_variant(setup):
    """Qwen3-VL-MoE (a sparse layer: swiftune's grouped experts; a dense one), full fine-tuning, one
    input derived: the experts' and router's gradients too."""
    if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
        pytest.skip("this transformers has no Qwen3-VL-MoE")
    proc, base, data = setup
    moe = tiny_vl_moe(base, scale=0.05)
    patched = _offloaded(moe, lora=False, host_layers=1, layer_bytes=_layer_bytes(proc, data, moe))
    _check_parity(copy.deepcopy(moe), patched, proc, data.examples)
    stats = offload_stats(patched)
    assert stats["derived"] == (1,) and stats["derived_recomputed"] == 1
    assert any("experts" in n for n, p in patched.named_parameters() if p.grad is not None and p.grad.abs().max() > 0)


def test_patching_after_offloaded_checkpointing_is_refused(setup):
    """Offloaded checkpointing on the unpatched model, then patch_model: the deepstack features would
    be added outside the offloaded layer's recompute, so the patch refuses with what to do."""
    proc, base, data = setup
    model = copy.deepcopy(base)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    with pytest.raises(RuntimeError, match="patch the model first, then enable the checkpointing"):
        swiftune.patch_model(model, attention="reference", kernel_backend="reference")


@pytest.mark.parametrize("share", [False, True], ids=["unshared", "shared-prompt"])
def test_offloaded_checkpointing_on_a_grpo_policy_row_of_image_prompts(setup, share):
    """GRPO's policy forward on image prompts (three prompts with 0, 1 and 2 images, G=2) with every
    layer's input offloaded and one derived, LoRA on the text and vision linears: the completion
    log-probs and the gradients of a weighted sum of them equal the unpatched PEFT model's on each
    sample alone."""
    from swiftune.rl.multimodal import VisionGRPO
    from swiftune.rl.policy import completion_logprobs
    from tests.test_qwen3_vl import _grads, _rel
    from tests.test_qwen3_vl_grpo import _prompt_rows, _reference_logps

    proc, base, _ = setup
    vision = VisionGRPO(swiftune.patch_model(copy.deepcopy(base), attention="reference"), proc)
    prompts = [vision.encode(row) for row in _prompt_rows()]
    samples = [p for p in prompts for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    completions = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (5, 3, 6, 1, 4, 7)]
    row = vision.policy_row(samples, completions, share_prompt=share, group_ids=[i // 2 for i in range(6)],
                            attention_backend="reference")
    layer_bytes = row.num_tokens * base.config.text_config.hidden_size * 4
    policy = _offloaded(base, lora=True, host_layers=1, layer_bytes=layer_bytes)
    reference = _reference_of(base, policy, lora=True)
    weights = torch.rand(sum(len(c) for c in completions), generator=gen, dtype=torch.float64)

    want = torch.cat([_reference_logps(reference, proc, p, c) for p, c in zip(samples, completions)])
    (want * weights).sum().backward()
    got, _ = completion_logprobs(policy, row, kernel_backend="reference")
    assert _rel(got.detach(), want.detach()) < 1e-5
    (got.double() * weights).sum().backward()
    stats = offload_stats(policy)
    assert stats["derived"] == (1,) and stats["derived_recomputed"] == 1 and stats["restored"] == 1
    ref_grads, grads = _grads(reference), _grads(policy)
    assert ref_grads.keys() == grads.keys() and any(".visual." in n for n in ref_grads)
    assert_gradients_match(ref_grads, grads, trainable=list(grads), tol=1e-5)
