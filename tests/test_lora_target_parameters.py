"""LoRA on parameters (PEFT's ``target_parameters``: mixture-of-experts weights stored as 3-D parameters, such as
gpt-oss's experts, which ``"all-linear"`` does not reach): ``FastModel.get_peft_model`` adapts exactly what PEFT's
own ``get_peft_model`` adapts, refuses a name that adapts nothing (PEFT skips it without a word), warns about
``target_modules`` names that adapt nothing, and the command line takes TRL's ``--lora_target_parameters``;
Unsloth's ``FastLanguageModel.get_peft_model`` adapts the experts for the MLP names of its target list, as
Unsloth does."""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from swiftune import FastModel
from swiftune.cli import main
from swiftune.cli.sft import parse_sft_args
from swiftune.errors import ConfigError
from tests.helpers import VOCAB, tiny_model

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _tiny_gpt_oss() -> transformers.PreTrainedModel:
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_local_experts=4,
                                       num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, sliding_window=8, tie_word_embeddings=False,
                                       max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def _trainable(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def test_target_parameters_adapt_what_peft_adapts():
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", target_parameters=EXPERTS)
    reference = _trainable(peft.get_peft_model(_tiny_gpt_oss(), config))
    ours = _trainable(FastModel.get_peft_model(_tiny_gpt_oss(), r=4, lora_alpha=8, target_parameters=EXPERTS,
                                               use_gradient_checkpointing=False))
    assert ours == reference
    # both expert stacks of every layer carry an adapter (not only the attention projections)
    assert sum("experts" in n and "lora_A" in n for n in ours) == 2 * 2
    suffix = FastModel.get_peft_model(_tiny_gpt_oss(), r=4, lora_alpha=8, target_parameters=["gate_up_proj"],
                                      use_gradient_checkpointing=False)
    assert sum("experts" in n and "lora_A" in n for n in _trainable(suffix)) == 2  # a name's suffix, as PEFT


def test_a_target_parameter_that_adapts_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"mlp\.experts\.gate_proj: adapted no parameter.*"
                                          r"mlp\.experts\.down_proj, mlp\.experts\.gate_up_proj"):
        FastModel.get_peft_model(_tiny_gpt_oss(), r=4, target_parameters=["mlp.experts.gate_proj", EXPERTS[1]],
                                 use_gradient_checkpointing=False)
    with pytest.raises(ConfigError, match="no expert weights stored as parameters"):
        FastModel.get_peft_model(tiny_model("qwen3"), r=4, target_parameters=EXPERTS, use_gradient_checkpointing=False)


def test_command_line_refuses_target_parameters_it_cannot_use(capsys):
    for argv, says in ((["--lora_target_parameters", "all-linear"], "is a --lora_target_modules value"),
                       (["--lora_target_parameters", ","], "expected at least one argument"),
                       (["--lora_target_parameters", EXPERTS[0], "--lora_dropout", "0.1"], "take no dropout")):
        assert main(["sft", "--use_lora", "true", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], (argv, err)
    model_args, _, _ = parse_sft_args(["--lora_target_parameters", f"{EXPERTS[0]},{EXPERTS[1]}", "--use_lora"])
    assert model_args.lora_target_parameters == EXPERTS


def test_sft_command_trains_and_saves_the_expert_adapters(tmp_path, capsys):
    from swiftune.data import build_tokenizer

    model_dir, out = tmp_path / "oss", tmp_path / "out"
    _tiny_gpt_oss().save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    common = ["sft", "--model_name_or_path", str(model_dir), "--max_steps", "2", "--per_device_train_batch_size", "2",
              "--max_length", "64", "--logging_steps", "1", "--report_to", "none", "--dtype", "fp32"]
    assert main([*common, "--output_dir", str(out), "--lora_target_parameters", ",".join(EXPERTS)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(EXPERTS)
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    experts = [k for k in saved if ".experts." in k]
    assert len(experts) == 2 * 2 * 2  # lora_A and lora_B of both stacks in both layers
    assert all(saved[k].abs().sum() > 0 for k in experts if "lora_A" in k)
    capsys.readouterr()
    assert main([*common, "--output_dir", str(tmp_path / "bad"), "--lora_target_parameters", "mlp.experts.gate_proj"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("swiftune sft: error: target_parameters") and "Traceback" not in "".join(err), err
    assert "mlp.experts.gate_proj: adapted no parameter" in err[-1] and not (tmp_path / "bad" / "adapter_config.json").exists()


def _tiny_qwen3_moe() -> transformers.PreTrainedModel:
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


@pytest.mark.parametrize("build", [_tiny_gpt_oss, _tiny_qwen3_moe, lambda: tiny_model("qwen3")],
                         ids=["gpt-oss", "qwen3-moe", "dense"])
def test_unsloth_names_adapt_the_experts_as_unsloth_does(build):
    """Unsloth's ``get_peft_model`` (2026.10) turns the MLP names of its target list into ``target_parameters``
    for experts stored as parameters ("Enabling LoRA on MoE parameters"). ``FastLanguageModel.get_peft_model``
    with Unsloth's default list adapts what PEFT's own ``get_peft_model`` adapts with those parameters added:
    gpt-oss's experts (PEFT alone adapts only its attention), Qwen3-MoE's (PEFT already maps the names there:
    unchanged), nothing more on a dense model. Attention-only lists add nothing."""
    import peft

    from swiftune import FastLanguageModel
    from swiftune.training.loading import LORA_PROJECTIONS

    experts = {"gpt-oss": EXPERTS, "qwen3-moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    kind = {_tiny_gpt_oss: "gpt-oss", _tiny_qwen3_moe: "qwen3-moe"}.get(build, "dense")
    targets = dict(target_parameters=experts[kind]) if kind in experts else {}
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_PROJECTIONS), **targets)
    reference = _trainable(peft.get_peft_model(build(), config))
    ours = _trainable(FastLanguageModel.get_peft_model(build(), r=4, lora_alpha=8, use_gradient_checkpointing=False))
    assert ours == reference
    assert any(".experts." in n for n in ours) == (kind != "dense")
    if kind == "gpt-oss":  # PEFT's get_peft_model with the same list alone: the attention only
        plain = _trainable(peft.get_peft_model(build(), peft.LoraConfig(r=4, target_modules=list(LORA_PROJECTIONS))))
        assert not any(".experts." in n for n in plain)
    if kind == "qwen3-moe":  # PEFT's own mapping of the names gives the same adapters
        plain = _trainable(peft.get_peft_model(build(), peft.LoraConfig(r=4, lora_alpha=8,
                                                                         target_modules=list(LORA_PROJECTIONS))))
        assert plain == ours
    attention = _trainable(FastLanguageModel.get_peft_model(build(), r=4, target_modules=["q_proj", "v_proj"],
                                                            use_gradient_checkpointing=False))
    assert not any(".experts." in n for n in attention)


def test_unsloth_names_refuse_dropout_on_the_experts_parameter_adapters():
    from swiftune import FastLanguageModel

    with pytest.raises(ConfigError, match="lora_dropout=0.1 with the MLP projections.*leave gate_proj"):
        FastLanguageModel.get_peft_model(_tiny_gpt_oss(), r=4, lora_dropout=0.1, use_gradient_checkpointing=False)


def test_target_modules_that_match_nothing_are_named_in_a_warning():
    """A dense recipe's gate/up/down names on gpt-oss match no module (its experts are parameters): PEFT trains
    the attention alone without a word; swiftune's warning names them and the expert stacks. No warning where
    every name matched, where PEFT mapped the MLP names onto expert stacks (Qwen3-MoE), or for all-linear."""
    import warnings

    from swiftune.training.loading import LORA_PROJECTIONS

    def warned(build, targets, **kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            FastModel.get_peft_model(build(), r=4, target_modules=targets, use_gradient_checkpointing=False, **kw)
        return [str(w.message) for w in caught if "matched no module" in str(w.message)]

    (message,) = warned(_tiny_gpt_oss, list(LORA_PROJECTIONS))
    assert message.startswith("swiftune: target_modules gate_proj, up_proj, down_proj matched no module")
    assert "['mlp.experts.down_proj', 'mlp.experts.gate_up_proj']" in message
    (typo,) = warned(lambda: tiny_model("qwen3"), ["q_proj", "v_prj"])
    assert "target_modules v_prj matched no module" in typo and "experts" not in typo
    assert not warned(_tiny_gpt_oss, list(LORA_PROJECTIONS), target_parameters=EXPERTS)
    assert not warned(_tiny_qwen3_moe, list(LORA_PROJECTIONS))
    assert not warned(lambda: tiny_model("qwen3"), list(LORA_PROJECTIONS))
    assert not warned(_tiny_gpt_oss, "all-linear")
