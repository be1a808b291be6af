"""FastModel: loading through transformers, pad tokens, LoRA through PEFT, plain checkpoints."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

from swiftune.attention import ATTENTION_NAME
from swiftune.data.builtin import EOS_TOKEN, PAD_TOKEN, build_tokenizer
from swiftune.models import is_patched
from swiftune.training import FastModel
from tests.helpers import rel_err
from tests.test_patching import VOCAB, tiny_model


def _save(path, family="qwen3", with_pad_token=True, window=False):
    model = tiny_model(family, window=window)
    model.save_pretrained(path)
    build_tokenizer(with_pad_token=with_pad_token).save_pretrained(path)
    return model


def _load(path, **kwargs):
    """FastModel.from_pretrained on CPU in fp32 (exact comparisons on the GPU machine too)."""
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("device_map", "cpu")
    return FastModel.from_pretrained(str(path), **kwargs)


def _ids(n=16, seed=0):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_from_pretrained_loads_patches_and_matches_transformers(tmp_path):
    reference = _save(tmp_path, "gemma2", window=True)
    model, tokenizer = FastModel.from_pretrained(str(tmp_path))  # defaults: bf16 on CUDA, fp32 on CPU
    assert is_patched(model) and model.config._attn_implementation == ATTENTION_NAME
    assert model.dtype == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    assert model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert tokenizer.pad_token == PAD_TOKEN and model.config.pad_token_id == tokenizer.pad_token_id
    assert model.max_seq_length == model.config.max_position_embeddings
    ids = _ids()
    with torch.no_grad():
        got = model(ids.to(model.device), use_cache=False).logits
        want = reference.to(model.device)(ids.to(model.device), use_cache=False).logits
    assert rel_err(got, want) < (1e-5 if model.dtype == torch.float32 else 2e-2)


def test_missing_pad_token_is_set_and_announced(tmp_path):
    _save(tmp_path, "llama", with_pad_token=False)
    with pytest.warns(UserWarning, match="no pad token"):
        model, tokenizer = _load(tmp_path, max_seq_length=64, dtype="bfloat16", patch=False)
    assert tokenizer.pad_token == EOS_TOKEN  # the byte tokenizer has no spare special token
    assert model.config.pad_token_id == tokenizer.pad_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.dtype == torch.bfloat16 and tokenizer.model_max_length == 64 and model.max_seq_length == 64
    assert not is_patched(model)


def test_not_a_causal_lm_is_a_clear_error(tmp_path):
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal language model"):
        FastModel.from_pretrained(str(tmp_path))


def test_an_adapter_folder_loads_on_its_base_as_peft_does_and_trains_on(tmp_path, capsys):
    """A LoRA run's output folder given as the model (Unsloth's reload of "lora_model"): its recorded base,
    then the adapter, trainable. Logits and every adapter gradient equal plain PEFT's PeftModel on the
    unpatched base (transformers said: Unrecognized model ... model_type)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from swiftune.cli import main
    from swiftune.errors import ConfigError

    _save(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    torch.manual_seed(3)
    trained = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    trained.save_pretrained(str(tmp_path / "adapter"))
    build_tokenizer().save_pretrained(str(tmp_path / "adapter"))
    reference = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")),
                                          str(tmp_path / "adapter"), is_trainable=True)
    model, tokenizer = _load(tmp_path / "adapter")
    assert isinstance(model, PeftModel) and is_patched(model.get_base_model())
    assert tokenizer.pad_token == PAD_TOKEN
    ids = _ids()
    got, want = model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits
    assert rel_err(got, want) < 1e-5
    got.float().square().mean().backward()
    want.float().square().mean().backward()
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    theirs = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys() and len(ours) == 8  # 2 layers x 2 targets x (A, B)
    for name, grad in theirs.items():
        assert grad.abs().sum() > 0 and rel_err(ours[name], grad) < 1e-4, name
    with pytest.warns(UserWarning, match="already has LoRA adapters"):  # Unsloth's notebooks call it again
        assert FastModel.get_peft_model(model, r=16, use_gradient_checkpointing=False) is model
    # the command trains it on: its base loads, the adapter trains, no second adapter is added
    assert main(["sft", "--model_name_or_path", str(tmp_path / "adapter"), "--max_steps", "1", "--report_to", "none",
                 "--output_dir", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    saved = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert saved["r"] == 2 and sorted(saved["target_modules"]) == ["down_proj", "q_proj"]
    # an adapter that records no base: what to load instead
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": None}))
    with pytest.raises(ConfigError, match=r"is a LoRA adapter folder that records no base model"):
        _load(tmp_path / "adapter")
    # a copy cut short: one message from the library and the generate command alike
    from swiftune.cli.generate import checked_adapter_config

    config_path.write_text('{"peft_type": "LORA", ')
    for load in (lambda: _load(tmp_path / "adapter"), lambda: checked_adapter_config(str(tmp_path / "adapter"))):
        with pytest.raises(ConfigError, match=r"its adapter_config.json is not readable JSON .*copy the folder"):
            load()


def test_save_pretrained_gives_a_plain_transformers_checkpoint(tmp_path):
    reference = _save(tmp_path / "src", "qwen3")
    model, tokenizer = _load(tmp_path / "src")
    model.save_pretrained(tmp_path / "out")
    config_text = (tmp_path / "out" / "config.json").read_text()
    assert "swiftune" not in config_text and "_attn_implementation" not in json.loads(config_text)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert plain.config._attn_implementation != ATTENTION_NAME
    assert set(plain.state_dict()) == set(reference.state_dict())
    ids = _ids()
    with torch.no_grad():
        assert rel_err(plain(ids).logits, model(ids, use_cache=False).logits) < 1e-5


def _checkpoint_kwargs(model) -> dict:
    layer = model.get_base_model().model.layers[0]
    assert layer.gradient_checkpointing
    return getattr(layer._gradient_checkpointing_func, "keywords", {})


def test_get_peft_model_trains_and_its_adapter_loads_in_plain_peft(tmp_path):
    from peft import PeftModel

    _save(tmp_path / "base", "llama")
    model, _ = _load(tmp_path / "base", kernel_backend="reference")
    peft_model = FastModel.get_peft_model(model, r=4, lora_alpha=8, init_lora_weights=False)
    assert isinstance(peft_model, PeftModel)
    assert _checkpoint_kwargs(peft_model).get("use_reentrant") is False
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("gate_proj" in n for n in trainable) and not any("lm_head" in n for n in trainable)

    # one checkpointed training step on a packed row
    peft_model.train()
    ids = _ids(18)
    pos = torch.cat([torch.arange(7), torch.arange(11)])[None]
    peft_model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trained)

    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    plain_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    plain = PeftModel.from_pretrained(plain_base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert rel_err(plain(ids).logits, peft_model(input_ids=ids, use_cache=False).logits) < 1e-5


def test_lora_dropout_bias_and_offload_flag(tmp_path):
    _save(tmp_path, "qwen2")
    model, _ = _load(tmp_path, kernel_backend="reference")
    peft_model = FastModel.get_peft_model(
        model, r=4, lora_dropout=0.1, bias="lora_only", use_gradient_checkpointing="offload"
    )
    assert peft_model.get_base_model()._swiftune_offload_checkpointing is True
    peft_model.train()
    ids = _ids(12)
    peft_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    with pytest.raises(ValueError, match="use_gradient_checkpointing"):
        FastModel.get_peft_model(model, use_gradient_checkpointing="sometimes")


def test_offload_gpu_budget_reaches_the_layers(tmp_path):
    """offload_gpu_budget_bytes=0 puts every layer input in host memory (the least GPU memory); the
    loss and gradients equal those of plain checkpointing; the option needs "offload"."""
    from swiftune.training.checkpointing import offload_stats

    _save(tmp_path, "qwen2")
    ids = _ids(12)
    results = {}
    for mode, budget in ((True, None), ("offload", 0)):
        model, _ = _load(tmp_path, kernel_backend="reference")
        peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=mode,
                                              offload_gpu_budget_bytes=budget).train()
        loss = peft_model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None}
        results[mode] = (loss.detach(), grads)
        if mode == "offload":
            stats = offload_stats(peft_model)
            assert stats["keep"] == () and len(stats["offload"]) == model.config.num_hidden_layers
    assert rel_err(results["offload"][0], results[True][0]) < 1e-6
    assert results["offload"][1].keys() == results[True][1].keys()
    for name, g in results[True][1].items():
        assert rel_err(results["offload"][1][name], g) < 1e-5, name
    model, _ = _load(tmp_path, kernel_backend="reference")
    with pytest.raises(ValueError, match="offload"):
        FastModel.get_peft_model(model, use_gradient_checkpointing=True, offload_gpu_budget_bytes=0)
    with pytest.raises(ValueError, match=">= 0"):
        FastModel.get_peft_model(model, use_gradient_checkpointing="offload", offload_gpu_budget_bytes=-1)


def test_offload_host_budget_caps_the_pinned_inputs(tmp_path):
    """offload_host_budget_bytes caps the host memory of offloaded layer inputs: a cap that holds them
    gives plain checkpointing's loss and gradients; one that holds none of them (every input sent to
    the host, no GPU budget) stops the step with CheckpointBudgetError naming the host budget; the
    option needs "offload" and a non-negative size."""
    from swiftune.training.checkpointing import offload_stats
    from swiftune.training.offload_memory import CheckpointBudgetError

    _save(tmp_path, "llama")
    ids = _ids(12)
    model, _ = _load(tmp_path, kernel_backend="reference")
    reference = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=True).train()
    ref_loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    layer_bytes = ids.numel() * model.config.hidden_size * 4  # float32 layer inputs on CPU
    n_layers = model.config.num_hidden_layers
    model, _ = _load(tmp_path, kernel_backend="reference")
    capped = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="offload", offload_gpu_budget_bytes=0,
                                      offload_host_budget_bytes=n_layers * layer_bytes * 4).train()
    loss = capped(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert len(offload_stats(capped)["offload"]) == n_layers
    assert rel_err(loss.detach(), ref_loss.detach()) < 1e-6
    for name, g in ref_grads.items():
        assert rel_err(dict(capped.named_parameters())[name].grad, g) < 1e-5, name
    model, _ = _load(tmp_path, kernel_backend="reference")
    starved = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="offload", offload_gpu_budget_bytes=0,
                                       offload_host_budget_bytes=layer_bytes // 2).train()
    with pytest.raises(CheckpointBudgetError, match="host"):
        starved(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model, _ = _load(tmp_path, kernel_backend="reference")
    with pytest.raises(ValueError, match="offload_host_budget_bytes needs"):
        FastModel.get_peft_model(model, use_gradient_checkpointing=True, offload_host_budget_bytes=2**30)
    with pytest.raises(ValueError, match="offload_host_budget_bytes must be >= 0"):
        FastModel.get_peft_model(model, use_gradient_checkpointing="offload", offload_host_budget_bytes=-1)
    with pytest.raises(ValueError, match="offload_host_budget_bytes needs"):  # full fine-tuning: the same checks
        FastModel.for_training(model, use_gradient_checkpointing=True, offload_host_budget_bytes=2**30)
    FastModel.for_training(model, use_gradient_checkpointing="offload", offload_host_budget_bytes=2**30)
    from swiftune.training.checkpointing import _STATE, causal_lm_of

    assert getattr(causal_lm_of(model), _STATE).host_budget_bytes == 2**30


def test_full_finetuning_gradients_match_transformers():
    """Every parameter's gradient through the fused kernels (Triton interpreter) vs eager transformers."""
    reference = tiny_model("gemma")
    model = tiny_model("gemma")
    from swiftune.models import patch_model

    patch_model(model)
    FastModel.for_training(model, use_gradient_checkpointing=False)
    reference.train()
    ids = _ids(12, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (reference, model):
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert rel_err(p.grad, want[name].grad) < 1e-5, name
