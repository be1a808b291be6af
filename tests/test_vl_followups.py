"""Qwen3-VL follow-ups (issue 28): offloaded checkpointing on an *unpatched* Qwen3-VL, GRPOConfig's
``max_prefill_tokens``, and LoRA targets that also match vision-tower modules.

Offloaded checkpointing with short host memory *derives* some layer inputs (recomputes them in
backward by rerunning the layer before, :mod:`swiftune.training.checkpointing`). transformers'
Qwen3-VL text model adds its deepstack visual features between the first decoder layers, so on a
model ``patch_model`` did not patch those inputs are not the layer before's output: they must never
be derived. Reference: the unpatched transformers model on each example alone, no checkpointing;
compared: the loss and every gradient (non-zero where the reference's is).
"""

from __future__ import annotations

import copy

import pytest
import torch

from swiftune.memory.planner import pinned_slot_bytes
from swiftune.training.checkpointing import (CheckpointBudgetError, enable_offloaded_checkpointing,
                                             inputs_set_between_layers, offload_stats)

from tests.helpers import assert_gradients_match
from tests.test_qwen3_vl import _grads, _model, _processor, _reference_loss, _rel, _rows, tiny_vl_moe, transformers

pytest.importorskip("PIL")

from swiftune.data.multimodal import prepare_multimodal_dataset  # noqa: E402

PAGE = 4096


@pytest.fixture(scope="module")
def setup():
    proc = _processor()
    return proc, _model(proc), prepare_multimodal_dataset(_rows(), proc)


def _with_text_layers(base: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """``base`` (the tiny Qwen3-VL, two deepstack feature sets) with ``num_layers`` decoder layers."""
    config = transformers.Qwen3VLConfig(
        text_config={**base.config.text_config.to_dict(), "num_hidden_layers": num_layers},
        vision_config=base.config.vision_config.to_dict(),
        **{k: getattr(base.config, k) for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                                 "video_token_id")})
    torch.manual_seed(0)
    return transformers.Qwen3VLForConditionalGeneration(config).float()


def _offloaded_per_example_loss(model, proc, examples, host_layers: int) -> list[dict]:
    """transformers' own forward on each example alone (backward per example, gradients summed), every
    layer's input offloaded and the host budget room for ``host_layers`` of them: the others derived.
    Returns each example's offload stats."""
    counts = [sum(e["completion_mask"][1:]) for e in examples]
    stats = []
    for example, count in zip(examples, counts):
        layer_bytes = len(example["input_ids"]) * model.config.text_config.hidden_size * 4
        enable_offloaded_checkpointing(model, gpu_budget_bytes=0, page_bytes=PAGE,
                                       host_budget_bytes=host_layers * pinned_slot_bytes(layer_bytes, PAGE))
        loss = _reference_loss(model, proc, [example]) * count / sum(counts)
        loss.backward()
        stats.append({**offload_stats(model), "loss": loss.detach()})
    return stats


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_unpatched_qwen3_vl_never_derives_an_input_after_deepstack(setup, variant):
    """Four decoder layers, deepstack after layers 0 and 1 (the inputs of layers 1 and 2 carry visual
    features), host room for three of the four offloaded inputs: one input is derived, and it must be
    layer 3's (layer 1's, what the plan picks otherwise, would miss the features: wrong gradients)."""
    proc, base, data = setup
    model = _with_text_layers(base, 4)
    if variant == "moe":
        if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
            pytest.skip("this transformers has no Qwen3-VL-MoE")
        model = tiny_vl_moe(model, scale=0.05)
    reference, offloaded = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    ref_loss = _reference_loss(reference, proc, data.examples)
    ref_loss.backward()
    stats = _offloaded_per_example_loss(offloaded, proc, data.examples, host_layers=3)
    loss = sum(s["loss"] for s in stats)
    assert _rel(loss, ref_loss.detach()) < 1e-5, (float(loss), float(ref_loss))
    ref_grads, grads = _grads(reference), _grads(offloaded)
    assert ref_grads.keys() == grads.keys() and any(".visual." in n for n in ref_grads)
    assert_gradients_match(ref_grads, grads, trainable=list(grads), tol=1e-5)
    # gradients first (what a wrong rebuild breaks), then where the rebuild went
    assert inputs_set_between_layers(offloaded, offloaded.model.language_model.layers) == {1, 2}
    for s in stats:
        assert s["derived"] == (3,) and s["offload"] == (0, 1, 2) and s["host_in_use_bytes"] == 0, s
    assert stats[-1]["derived_recomputed"] == len(data.examples)  # every example rebuilt layer 3's input


def test_unpatched_qwen3_vl_with_no_layer_left_to_derive_is_refused(setup):
    """Two decoder layers, both followed by deepstack features: the one input a short host budget would
    derive (layer 1's) cannot be rebuilt, and no other layer can take its place: a clear error."""
    proc, base, data = setup
    model = copy.deepcopy(base).train()
    with pytest.raises(CheckpointBudgetError, match=r"Patch the model before enabling the checkpointing"):
        _offloaded_per_example_loss(model, proc, data.examples[:1], host_layers=1)


def test_patched_qwen3_vl_still_derives_after_its_own_deepstack(setup):
    """A patched model's layers add their own features, so no input is underivable."""
    import swiftune

    _, base, _ = setup
    patched = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    assert inputs_set_between_layers(patched, list(patched.model.language_model.layers)) == frozenset()
    assert inputs_set_between_layers(base, list(base.model.language_model.layers)) == {1}


# ------------------------------------------------------------------ GRPOConfig.max_prefill_tokens

GRPO_FAST = dict(kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
                 logging_steps=1, seed=1, dataloader_pin_memory=False, disable_tqdm=True, use_cpu=True,
                 num_generations=2, per_device_train_batch_size=4)


@pytest.mark.parametrize("value", [0, -5, True, 2.5, "lots", [4096]])
def test_max_prefill_tokens_bad_values_are_refused_at_config_time(tmp_path, value):
    from swiftune import GRPOConfig
    from swiftune.errors import ConfigError

    with pytest.raises(ConfigError, match=r"GRPOConfig: max_prefill_tokens=.* is not a positive number of tokens, "
                                          r"'auto' or None; set it to"):
        GRPOConfig(output_dir=str(tmp_path), max_prefill_tokens=value, **GRPO_FAST)


@pytest.mark.parametrize("value, want", [(4096, 4096), ("auto", "auto"), (None, None), ("4096", 4096),
                                         ("none", None), ("AUTO", "auto")])
def test_max_prefill_tokens_good_values_and_command_line_strings(tmp_path, value, want):
    from swiftune import GRPOConfig

    assert GRPOConfig(output_dir=str(tmp_path), max_prefill_tokens=value, **GRPO_FAST).max_prefill_tokens == want


@pytest.mark.parametrize("option, want", [("4096", 4096), ("none", None), ("auto", "auto")])
def test_max_prefill_tokens_on_the_command_line(tmp_path, option, want):
    from swiftune.cli.grpo import parse_grpo_args

    _, args, _ = parse_grpo_args(["--output_dir", str(tmp_path), "--max_prefill_tokens", option, "--use_cpu", "true"])
    assert args.max_prefill_tokens == want


@pytest.mark.parametrize("engine", ["transformers", "fast"])
def test_trainer_passes_max_prefill_tokens_to_the_vision_engine(setup, tmp_path, caplog, engine):
    """A cap of 1 token: the engine the trainer builds prefills every image prompt alone and says so
    (the engines' own behaviour under a cap is tested against transformers in test_vl_fast_rollout /
    test_qwen3_vl_grpo)."""
    import logging

    from swiftune import GRPOConfig, GRPOTrainer
    from swiftune.rl.rollout import SamplingParams
    from tests.test_qwen3_vl_grpo import _prompt_rows

    proc, base, _ = setup
    rows = _prompt_rows()[:2]
    args = GRPOConfig(output_dir=str(tmp_path), rollout_engine=engine, max_prefill_tokens=1, max_steps=1,
                      **GRPO_FAST)
    trainer = GRPOTrainer(copy.deepcopy(base), lambda prompts, completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=rows, processing_class=proc)
    assert trainer.rollout_engine.max_prefill_tokens == 1
    prompts = [trainer.vision.encode(row) for row in rows]
    with caplog.at_level(logging.WARNING, logger="swiftune"):
        out = trainer.vision.generate(trainer.rollout_engine, prompts, 2, SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out.completion_ids) == 4
    alone = [r for r in caplog.records if "above max_prefill_tokens=1: prefilled alone" in r.getMessage()]
    assert len(alone) == len(prompts), [r.getMessage() for r in caplog.records]


def test_max_prefill_tokens_on_a_text_model_warns_that_it_has_no_effect(tmp_path, caplog):
    import logging

    from swiftune import GRPOConfig, GRPOTrainer
    from swiftune.data import build_tokenizer
    from tests.test_grpo import tiny_model

    reward = lambda prompts, completions, **kw: [0.0] * len(completions)  # noqa: E731
    rows = [{"prompt": "abc"}] * 4
    with caplog.at_level(logging.WARNING, logger="swiftune"):
        GRPOTrainer(tiny_model(), reward, GRPOConfig(output_dir=str(tmp_path / "a"), **GRPO_FAST), rows,
                    processing_class=build_tokenizer())
        assert not any("max_prefill_tokens" in r.getMessage() for r in caplog.records)  # the default: silent
        GRPOTrainer(tiny_model(), reward, GRPOConfig(output_dir=str(tmp_path / "b"), max_prefill_tokens=512,
                                                     **GRPO_FAST), rows, processing_class=build_tokenizer())
    assert any("max_prefill_tokens=512 has no effect on Qwen3ForCausalLM, a text model" in r.getMessage()
               for r in caplog.records)


# ------------------------------------------------------------------ LoRA targets reaching the vision tower

def _lora_wrapped(model, target_modules) -> set[str]:
    """Names of the modules PEFT's own get_peft_model adapts for ``target_modules``."""
    import peft

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=target_modules, lora_dropout=0.0)
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    prefix = "base_model.model."
    return {n[len(prefix):] for n, m in wrapped.named_modules() if hasattr(m, "lora_A") and n.startswith(prefix)}


def test_lora_target_proj_warns_about_the_vision_patch_embedding(setup):
    """``"proj"`` (a suffix) adapts the vision blocks' attention output projections and also the patch
    embedding's Conv3d: one warning names the Conv3d and a target list without it, and that list,
    given to PEFT, adapts exactly the other modules."""
    import warnings

    import swiftune
    from tests.test_qwen3_vl import SEVEN, VISION_LINEARS

    _, base, _ = setup
    targets = SEVEN + VISION_LINEARS
    assert "model.visual.patch_embed.proj" in _lora_wrapped(base, targets)  # PEFT's own behaviour
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swiftune.FastModel.get_peft_model(copy.deepcopy(base), r=2, lora_alpha=4, target_modules=targets,
                                          use_gradient_checkpointing=False)
    ours = [w for w in caught if "LoRA target_modules" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "'proj' also matches model.visual.patch_embed.proj (Conv3d)" in message, message
    assert "name them (e.g. 'patch_embed.proj')" in message, message
    suggested = SEVEN + ["qkv", "attn.proj", "linear_fc1", "linear_fc2"]
    assert f"target_modules={suggested!r}" in message, message
    assert _lora_wrapped(base, suggested) == _lora_wrapped(base, targets) - {"model.visual.patch_embed.proj"}


def test_lora_target_regex_reaching_text_and_vision_warns(setup):
    """A regular expression that matches text-decoder and vision-tower modules alike: every vision match
    is named, and the suggested list adapts the text modules only."""
    import ast

    import swiftune

    _, base, _ = setup
    with pytest.warns(UserWarning, match=r"'\.\*proj' also matches model\.visual\.") as record:
        swiftune.FastModel.get_peft_model(copy.deepcopy(base), r=2, lora_alpha=4, target_modules=r".*proj",
                                          use_gradient_checkpointing=False)
    message = next(str(w.message) for w in record if "LoRA target_modules" in str(w.message))
    suggested = ast.literal_eval(message.split("use target_modules=")[1].split("; to adapt")[0])  # as printed
    wanted = {n for n in _lora_wrapped(base, r".*proj") if ".visual." not in f".{n}."}
    assert wanted and _lora_wrapped(base, suggested) == wanted


@pytest.mark.parametrize("targets", [
    "all-linear", ["q_proj", "v_proj"], ["qkv", "attn.proj", "linear_fc1", "linear_fc2"], ["patch_embed.proj"],
    r".*visual.*proj", ["visual.blocks.0.attn.proj"]], ids=str)
def test_lora_targets_meant_for_what_they_match_do_not_warn(setup, targets):
    import warnings

    import swiftune

    _, base, _ = setup
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*LoRA target_modules")
        swiftune.FastModel.get_peft_model(copy.deepcopy(base), r=2, lora_alpha=4, target_modules=targets,
                                          use_gradient_checkpointing=False)
