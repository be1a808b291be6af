"""Qwen3-VL-MoE's router load-balancing loss in SFT, against transformers' own model.

Qwen3-VL-MoE keeps its router settings (``num_experts``, ``num_experts_per_tok``,
``router_aux_loss_coef``, ``output_router_logits``) in ``config.text_config``, and its transformers
forward adds ``text_config.router_aux_loss_coef * aux`` to the loss when asked for the router logits
(transformers 5.24: ``text_config.output_router_logits`` or the argument; 5.17: the argument). The reference is that unpatched model on the right-padded
batch of all examples, image rows included (its own M-RoPE index with the attention mask, its own
mean cross entropy, its own ``load_balancing_loss_func`` over the real tokens); SFTTrainer's
``compute_loss`` on the padding-free row and on packed rows must equal its loss, and every trainable
gradient its gradient, fp32 on CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_qwen3_vl import (IMAGE_TOKEN, _model, _processor, _reference_loss, _rel, _rows, tiny_vl_moe,
                                 transformers)

from swiftune.data.multimodal import MultimodalCollator, prepare_multimodal_dataset
from swiftune.models.moe import moe_config
from swiftune.models.qwen3_vl import rope_index_of

if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
    pytest.skip("this transformers has no Qwen3-VL-MoE", allow_module_level=True)

COEF = 0.5  # large, so that the load-balancing term moves the loss and the router gradients visibly
TOL = 1e-5


def _vl_moe(proc) -> torch.nn.Module:
    """The tiny Qwen3-VL of tests/test_qwen3_vl.py with a sparse first layer (4 experts, top 2)."""
    return tiny_vl_moe(_model(proc), scale=0.3, router_aux_loss_coef=COEF).train()


def _padded(proc, examples) -> dict[str, torch.Tensor]:
    """The examples as one right-padded batch for transformers' forward (labels: the completion)."""
    width = max(len(e["input_ids"]) for e in examples)
    pad = proc.tokenizer.pad_token_id
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[r, :n] = torch.tensor(e["input_ids"])
        mask[r, :n] = 1
        labels[r, :n] = torch.where(torch.tensor(e["completion_mask"]).bool(), ids[r, :n], -100)
    imaged = [e for e in examples if "pixel_values" in e]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "mm_token_type_ids": (ids == proc.token_id(IMAGE_TOKEN)).int(),
            "pixel_values": torch.cat([e["pixel_values"] for e in imaged]),
            "image_grid_thw": torch.cat([e["image_grid_thw"] for e in imaged])}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.fixture(scope="module")
def setup():
    proc = _processor()
    data = prepare_multimodal_dataset(_rows(), proc)
    assert any("pixel_values" in e for e in data.examples) and any("pixel_values" not in e for e in data.examples)
    return proc, _vl_moe(proc), data


def test_moe_config_reads_the_text_config(setup):
    _, base, _ = setup
    assert not hasattr(base.config, "num_experts")  # the composite config has no router settings of its own
    assert moe_config(base) == (4, 2, COEF)


@pytest.mark.parametrize("layout", ["padding_free", "packed"])
def test_sft_trainer_adds_the_router_loss_as_transformers_does(setup, layout, tmp_path):
    """Image-text and text-only rows: SFTTrainer (router_aux_loss_coef None: the text config's
    coefficient, output_router_logits switched on in the text config) gives transformers' loss with
    output_router_logits=True and its gradients, routers included; without the term the loss differs."""
    from swiftune import SFTConfig, SFTTrainer
    from swiftune.training.router_aux import real_token_mask

    proc, base, data = setup
    examples = data.examples
    reference = copy.deepcopy(base)
    reference.config.text_config.output_router_logits = True  # transformers 5.24 reads the config,
    # 5.17 only the forward's argument: given both, each version adds coef * aux to its loss
    out = reference(**_padded(proc, examples), use_cache=False, output_router_logits=True)
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    out.loss.backward()
    want = _grads(reference)
    with torch.no_grad():  # the padded batch's cross entropy is the per-example one: the padding is sound
        ce = _reference_loss(copy.deepcopy(base), proc, examples)
        assert _rel(out.loss - COEF * out.aux_loss, ce) < TOL
        assert _rel(out.loss, ce) > 1e-3  # the term is visible: a trainer that drops it fails below

    model = copy.deepcopy(base)
    args = SFTConfig(output_dir=str(tmp_path), kernel_backend="reference", attention_backend="reference",
                     report_to="none", max_length=128, packing=layout == "packed", save_strategy="no",
                     use_cpu=True, dataloader_pin_memory=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=_rows(), processing_class=proc)
    model = trainer.model
    assert trainer.router_aux.enabled and trainer.router_aux.coef == COEF
    assert model.config.text_config.output_router_logits
    width = max(data.lengths) + 2 if layout == "packed" else None
    batch = MultimodalCollator(rope_index_of(base), proc.token_id(IMAGE_TOKEN), max_length=width,
                               pad_token_id=proc.tokenizer.pad_token_id)(examples)
    if layout == "packed":
        assert batch["input_ids"].shape[0] >= 2 and real_token_mask(batch) is not None  # padding is not counted
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, trainer._prepare_inputs(dict(batch)))  # the mean, as transformers
    loss.backward()
    assert _rel(loss.detach().cpu(), out.loss.detach()) < TOL, (float(loss), float(out.loss))
    got = _grads(model)
    assert want.keys() <= got.keys()
    assert any("mlp.gate." in n for n in want)
    for name, grad in want.items():
        assert _rel(got[name].cpu(), grad) < TOL, (name, _rel(got[name].cpu(), grad))
        assert got[name].abs().sum() > 0 or grad.abs().sum() == 0, name
    trainer.log({"loss": float(loss.detach())})
    assert trainer.state.log_history[-1]["aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-4)
