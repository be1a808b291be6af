"""FastLanguageModel: Unsloth's loader names and arguments over FastModel, each one supported with
Unsloth's meaning, ignored with one warning, or refused with a ConfigError that says what to use.

References are the plain libraries (transformers, PEFT) on the same saved tiny model, or FastModel
where the claim is "the same model as FastModel loads".
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import swiftune
from swiftune.data.builtin import build_tokenizer
from swiftune.errors import ConfigError
from swiftune.training import FastLanguageModel, FastModel
from swiftune.training.checkpointing import is_offloaded_checkpointing
from tests.helpers import VOCAB, rel_err, tiny_model

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

# CPU, fp32, the plain-PyTorch kernels: exact comparisons, fast.
CPU = dict(dtype=torch.float32, device_map="cpu", kernel_backend="reference")


def save_tiny(path, family: str = "llama", with_pad_token: bool = True) -> transformers.PreTrainedModel:
    """A random tiny model and the built-in byte tokenizer, saved where from_pretrained reads them."""
    model = tiny_model(family)
    model.save_pretrained(path)
    build_tokenizer(with_pad_token=with_pad_token).save_pretrained(path)
    return model


def ids(n: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def test_exported_from_swiftune_and_training():
    assert swiftune.FastLanguageModel is FastLanguageModel
    assert "FastLanguageModel" in swiftune.__all__ and "FastLanguageModel" in swiftune.training.__all__


def test_model_name_loads_what_fast_model_loads(tmp_path):
    reference = save_tiny(tmp_path)
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(tmp_path), max_seq_length=64, **CPU)
    same, _ = FastModel.from_pretrained(str(tmp_path), max_seq_length=64, **CPU)
    alias, _ = FastModel.from_pretrained(model_name=str(tmp_path), max_seq_length=64, **CPU)
    x = ids()
    got = logits(model, x)
    assert torch.equal(got, logits(same, x)) and torch.equal(got, logits(alias, x))
    assert rel_err(got, logits(reference, x)) < 1e-5  # and it is the saved model
    assert model.max_seq_length == 64 == tokenizer.model_max_length
    assert not model.training  # as transformers loads it: nothing is trainable-set-up before get_peft_model
    with pytest.raises(ConfigError, match="both of model_name_or_path and model_name"):
        FastModel.from_pretrained(str(tmp_path), model_name=str(tmp_path))
    with pytest.raises(ConfigError, match="neither of model_name_or_path and model_name"):
        FastModel.from_pretrained()


def test_token_device_map_and_trust_remote_code_reach_transformers(tmp_path, monkeypatch):
    save_tiny(tmp_path)
    seen: dict[str, dict] = {}

    def recording(name, real):
        def call(*args, **kwargs):
            seen[name] = kwargs
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        recording("model", transformers.AutoModelForCausalLM.from_pretrained))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        recording("tokenizer", transformers.AutoTokenizer.from_pretrained))
    FastLanguageModel.from_pretrained(str(tmp_path), token="hf_test_token", trust_remote_code=True, **CPU)
    for name in ("model", "tokenizer"):
        assert seen[name]["token"] == "hf_test_token" and seen[name]["trust_remote_code"] is True, name
    assert seen["model"]["device_map"] == "cpu"


def test_rope_scaling_reaches_the_config_and_the_rotary_embedding(tmp_path):
    save_tiny(tmp_path)
    plain_config = transformers.AutoConfig.from_pretrained(tmp_path)
    theta = plain_config.rope_parameters["rope_theta"]
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path), rope_scaling={"type": "linear", "factor": 2.0}, **CPU)
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "linear" and rope["factor"] == 2.0 and rope["rope_theta"] == theta
    unscaled, _ = FastModel.from_pretrained(str(tmp_path), **CPU)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, unscaled.model.rotary_emb.inv_freq / 2)
    # the plain transformers model under the same scaling gives the same logits
    scaled_config = transformers.AutoConfig.from_pretrained(tmp_path)
    scaled_config.rope_parameters = {**scaled_config.rope_parameters, "rope_type": "linear", "factor": 2.0}
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, config=scaled_config).eval()
    x = ids()
    assert rel_err(logits(model, x), logits(plain, x)) < 1e-5
    assert rel_err(logits(model, x), logits(unscaled, x)) > 1e-3  # the scaling changes the model
    with pytest.raises(ConfigError, match="rope_type must be one of"):
        FastLanguageModel.from_pretrained(str(tmp_path), rope_scaling={"type": "squeeze", "factor": 2.0}, **CPU)
    with pytest.raises(ConfigError, match="not valid"):
        FastLanguageModel.from_pretrained(str(tmp_path), rope_scaling={"rope_type": "linear"}, **CPU)  # no factor


def test_full_finetuning_sets_up_every_weight_for_training(tmp_path):
    save_tiny(tmp_path)
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path), full_finetuning=True, **CPU)
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert is_offloaded_checkpointing(model)  # Unsloth's default use_gradient_checkpointing="unsloth"
    x = ids(12)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    plain, _ = FastLanguageModel.from_pretrained(str(tmp_path), full_finetuning=True, use_gradient_checkpointing=True,
                                                 **CPU)
    assert plain.model.layers[0].gradient_checkpointing and not is_offloaded_checkpointing(plain)
    untouched, _ = FastLanguageModel.from_pretrained(str(tmp_path), **CPU)
    assert not untouched.training and not untouched.model.layers[0].gradient_checkpointing
    with pytest.raises(ConfigError, match="full_finetuning=True with 4-bit"):
        FastLanguageModel.from_pretrained(str(tmp_path), full_finetuning=True, load_in_4bit=True, **CPU)


def test_get_peft_model_with_unsloths_defaults_matches_plain_peft(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    save_tiny(tmp_path)
    base, _ = FastLanguageModel.from_pretrained(str(tmp_path), **CPU)
    model = FastLanguageModel.get_peft_model(base, max_seq_length=128)
    assert isinstance(model, PeftModel)
    config = model.peft_config["default"]
    assert config.r == 16 and config.lora_alpha == 16 and config.lora_dropout == 0 and config.bias == "none"
    assert set(config.target_modules) == PROJECTIONS
    assert {n.split(".")[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")} == PROJECTIONS
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert is_offloaded_checkpointing(model) and model.max_seq_length == 128

    # the plain libraries with the same LoRA and seed (random_state=3407)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.manual_seed(3407)
    plain = get_peft_model(plain, LoraConfig(r=16, lora_alpha=16, target_modules=sorted(PROJECTIONS),
                                             task_type="CAUSAL_LM"))
    x = ids(12)
    losses = []
    for m in (model.train(), plain.train()):
        loss = m(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
    assert rel_err(losses[0], losses[1]) < 1e-6
    want = dict(plain.named_parameters())
    lora_b = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert rel_err(p.grad, want[name].grad) < 1e-5, name
        if "lora_B" in name:  # B starts at 0, so A's gradient is 0 in the first step; B's is not
            assert p.grad.abs().sum() > 0, name
            lora_b += 1
    assert lora_b == len(PROJECTIONS) * model.config.num_hidden_layers


def test_for_inference_and_for_training_switch_modes(tmp_path):
    save_tiny(tmp_path)
    base, _ = FastLanguageModel.from_pretrained(str(tmp_path), **CPU)
    model = FastLanguageModel.get_peft_model(base).train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}

    assert FastLanguageModel.for_inference(model) is model
    assert not any(m.training for m in model.modules()) and model.config.use_cache
    out = model.generate(ids(4), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)

    assert FastLanguageModel.for_training(model) is model
    assert all(m.training for m in model.modules()) and not model.config.use_cache
    assert is_offloaded_checkpointing(model)  # True keeps the checkpointing get_peft_model set up
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # not full fine-tuning

    FastLanguageModel.for_training(model, use_gradient_checkpointing=False)
    layer = model.get_base_model().model.layers[0]
    assert not is_offloaded_checkpointing(model) and not layer.gradient_checkpointing
    FastLanguageModel.for_training(model, use_gradient_checkpointing=True)
    assert layer.gradient_checkpointing and not is_offloaded_checkpointing(model)
    FastLanguageModel.for_training(model, use_gradient_checkpointing="unsloth")
    assert is_offloaded_checkpointing(model)
    x = ids(12)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_fix_tokenizer(tmp_path):
    save_tiny(tmp_path, with_pad_token=False)
    with pytest.warns(UserWarning, match="no pad token"):
        _, fixed = FastLanguageModel.from_pretrained(str(tmp_path), **CPU)
    assert fixed.pad_token is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no pad-token warning either
        _, as_loaded = FastLanguageModel.from_pretrained(str(tmp_path), fix_tokenizer=False, **CPU)
    assert as_loaded.pad_token is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(fast_inference=True), r"vLLM engine, which swiftune does not have.*swiftune\.rl\.rollout\.FastRolloutEngine"),
    (dict(load_in_8bit=True), "8-bit base weights are not supported"),
    (dict(use_gradient_checkpointing="sometimes"), r"True, False, 'offload' or 'unsloth'"),
])
def test_refused_loading_arguments(tmp_path, kwargs, match):
    save_tiny(tmp_path)
    with pytest.raises(ConfigError, match=match):
        FastLanguageModel.from_pretrained(str(tmp_path), **CPU, **kwargs)


def test_refused_adapter_arguments(tmp_path):
    save_tiny(tmp_path)
    base, _ = FastLanguageModel.from_pretrained(str(tmp_path), **CPU)
    with pytest.raises(ConfigError, match="loftq_config is not supported"):
        FastLanguageModel.get_peft_model(base, loftq_config={"loftq_bits": 4})
    for bad in ("sometimes", 2, "Offload"):
        for call in (FastLanguageModel.get_peft_model, FastModel.get_peft_model, FastModel.for_training):
            with pytest.raises(ConfigError, match=r"must be True, False, 'offload' or 'unsloth'"):
                call(base, use_gradient_checkpointing=bad)
        with pytest.raises(ConfigError, match=r"must be True, False, 'offload' or 'unsloth'"):
            FastLanguageModel.for_training(base, use_gradient_checkpointing=bad)
    # Unsloth's own default loftq_config={} means none
    assert FastLanguageModel.get_peft_model(base, loftq_config={}, use_gradient_checkpointing=False) is not None


def test_vllm_settings_are_ignored_with_one_warning(tmp_path):
    save_tiny(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = FastLanguageModel.from_pretrained(str(tmp_path), gpu_memory_utilization=0.6, max_lora_rank=32,
                                                     float8_kv_cache=False, random_state=1, **CPU)
    ignored = [w for w in caught if "ignores" in str(w.message)]
    assert len(ignored) == 1 and ignored[0].filename == __file__  # one warning, pointing at the caller
    text = str(ignored[0].message)
    for setting in ("gpu_memory_utilization=0.6", "max_lora_rank=32", "float8_kv_cache=False", "random_state=1",
                    "fast_inference"):
        assert setting in text
    assert rel_err(logits(model, ids()), logits(FastModel.from_pretrained(str(tmp_path), **CPU)[0], ids())) == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FastLanguageModel.from_pretrained(str(tmp_path), fast_inference=False, **CPU)
    assert not [w for w in caught if "ignores" in str(w.message)]


def test_trainers_take_unsloths_tokenizer_keyword(tmp_path):
    """Unsloth's notebooks pass ``tokenizer=tokenizer`` to the trainer (its patched TRL takes it): swiftune's
    trainers take it as ``processing_class``; both, as different objects, is refused."""
    from swiftune.rl import GRPOConfig, GRPOTrainer
    from swiftune.sft import SFTConfig, SFTTrainer

    tok = build_tokenizer()
    rows = [{"prompt": "Reverse: abc\n", "completion": "cba"}] * 4
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, per_device_train_batch_size=2, report_to=[])
    trainer = SFTTrainer(model=tiny_model("qwen3"), args=args, train_dataset=rows, tokenizer=tok)
    assert trainer.processing_class is tok
    with pytest.raises(ConfigError, match="tokenizer= and processing_class= name different objects"):
        SFTTrainer(model=tiny_model("qwen3"), args=args, train_dataset=rows, tokenizer=tok,
                   processing_class=build_tokenizer())
    grpo_args = GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=1, per_device_train_batch_size=2,
                           num_generations=2, max_completion_length=4, report_to=[])
    grpo = GRPOTrainer(tiny_model("qwen3"), [lambda completions, **kw: [0.0] * len(completions)], args=grpo_args,
                       train_dataset=[{"prompt": "Hi"}] * 4, tokenizer=tok)
    assert grpo.processing_class is tok
