"""``model.save_pretrained_merged`` / ``push_to_hub_merged`` (Unsloth's names; swiftune.training.merged_save).

The reference is PEFT's own ``merge_and_unload()`` on a plain transformers model holding the base weights
(the checkpoint's, bitsandbytes' ``dequantize_4bit`` of the NF4 codes, or ``Q * s`` of the FP8 codes in plain
torch) with the adapter PEFT saved; the merged folder is loaded with plain ``AutoModelForCausalLM``.
"""

import json
import os
import warnings

import peft
import pytest
import torch
import transformers

import swiftune
from swiftune.errors import ConfigError
from tests.helpers import VOCAB, rel_err, tiny_model

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 1]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny fp32 folders with the built-in tokenizer: Qwen3, and Llama with tied embeddings."""
    from swiftune.data import build_tokenizer

    out = {}
    for name, family, extra in (("qwen3", "qwen3", {}), ("llama_tied", "llama", {"tie_word_embeddings": True})):
        path = tmp_path_factory.mktemp(name)
        tiny_model(family, **extra).save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        out[name] = str(path)
    return out


def _lora_model(path: str, modules_to_save=None, **load):
    """FastModel + LoRA (r=4) with every adapter tensor drawn non-zero (PEFT starts B at zero, which would
    make every merge a no-op and every comparison pass)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = swiftune.FastModel.from_pretrained(path, **load)
        model = swiftune.FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                                  modules_to_save=modules_to_save)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.2)
    return model, tokenizer


def _peft_merged(path: str, adapter_dir: str, dtype: torch.dtype, base_weights: dict | None = None):
    """PEFT's merge_and_unload on the plain transformers model (``base_weights`` replacing some weights first)."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if base_weights:
        state = plain.state_dict()
        with torch.no_grad():
            for name, w in base_weights.items():
                state[name].copy_(w)
    return peft.PeftModel.from_pretrained(plain, adapter_dir).merge_and_unload().eval()


def _load_plain(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _assert_same_weights(loaded, reference, exact: bool = True) -> None:
    got, want = loaded.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        if exact:
            assert torch.equal(got[name], w), f"{name}: differs from PEFT's merge"
        else:
            assert rel_err(got[name], w) < 1e-6, name


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _projection_names(model) -> list[str]:
    from peft.tuners.lora import LoraLayer

    hf = model.get_base_model()
    return [f"{n}.weight" for n, m in hf.named_modules() if isinstance(m, LoraLayer)]


def test_bf16_base_merged_16bit_equals_peft_merge_exactly_and_leaves_the_model_as_it_was(checkpoints, tmp_path):
    path = checkpoints["qwen3"]
    model, tokenizer = _lora_model(path, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "adapter")  # PEFT's own adapter save: the reference's input
    before, logits_before = _snapshot(model), _logits(model)

    model.save_pretrained_merged(str(tmp_path / "merged"), tokenizer, save_method="merged_16bit")

    reference = _peft_merged(path, str(tmp_path / "adapter"), torch.bfloat16)
    loaded = _load_plain(str(tmp_path / "merged"))
    assert loaded.dtype == torch.bfloat16
    _assert_same_weights(loaded, reference)
    assert torch.equal(_logits(loaded), _logits(reference))
    # the merge did something: the merged projections are not the checkpoint's
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    assert not torch.equal(loaded.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    config = json.load(open(tmp_path / "merged" / "config.json"))
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert not os.path.exists(tmp_path / "merged" / "adapter_config.json")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "merged").vocab_size == tokenizer.vocab_size
    # the training model is untouched: same tensors, adapters unmerged, same outputs, still trainable
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[n], t) for n, t in before.items())
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert torch.equal(_logits(model), logits_before)
    assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_fp32_base_saved_in_bf16_with_modules_to_save_equals_peft_merge_then_cast(checkpoints, tmp_path):
    path = checkpoints["qwen3"]
    model, tokenizer = _lora_model(path, modules_to_save=["lm_head"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "adapter")
    model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_16bit", dtype="bfloat16")
    reference = _peft_merged(path, str(tmp_path / "adapter"), torch.float32).to(torch.bfloat16)
    loaded = _load_plain(str(tmp_path / "merged"))
    _assert_same_weights(loaded, reference)
    # the trained lm_head copy was written, not the original
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert not torch.equal(loaded.lm_head.weight, plain.lm_head.weight)


def _assert_merged_save_is_peft_merge_on(model, tokenizer, path, tmp_path, dtype, dequantised) -> None:
    """``merged_16bit`` of a quantised base, loaded in plain transformers: the weights and logits of PEFT's own
    merge into the plain model whose projections hold ``dequantised`` (the reference's dequantisation)."""
    model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_16bit")
    reference = _peft_merged(path, str(tmp_path / "adapter"), dtype, dequantised)
    loaded = _load_plain(str(tmp_path / "merged"))
    assert loaded.dtype == dtype
    _assert_same_weights(loaded, reference)
    assert torch.equal(_logits(loaded), _logits(reference))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_base_merged_16bit_equals_peft_merge_on_bitsandbytes_dequantised_weights(checkpoints, tmp_path, dtype):
    import bitsandbytes.functional as bnbf

    path = checkpoints["qwen3"]
    model, tokenizer = _lora_model(path, load_in_4bit=True, dtype=dtype)
    model.save_pretrained(tmp_path / "adapter")
    hf = model.get_base_model()
    dequantised = {}
    for name, module in hf.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(weight, "quant_state", None) is not None:  # bitsandbytes' Linear4bit
            key = name.removesuffix(".base_layer") + ".weight"
            dequantised[key] = bnbf.dequantize_4bit(weight.data, weight.quant_state)
    assert len(dequantised) == 14  # 2 layers x 7 projections really were NF4
    _assert_merged_save_is_peft_merge_on(model, tokenizer, path, tmp_path, dtype, dequantised)
    assert "quantization_config" not in json.load(open(tmp_path / "merged" / "config.json"))
    # still the 4-bit training model
    assert all(getattr(getattr(hf.get_submodule(n.removesuffix(".weight")), "base_layer").weight, "quant_state", None)
               is not None for n in dequantised)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_base_merged_16bit_equals_peft_merge_on_q_times_s(checkpoints, tmp_path, dtype):
    path = checkpoints["qwen3"]
    model, tokenizer = _lora_model(path, load_in_fp8=True, dtype=dtype)
    model.save_pretrained(tmp_path / "adapter")
    hf = model.get_base_model()
    dequantised = {}
    for name, module in hf.named_modules():
        weight = getattr(module, "weight", None)
        if "weight_scale" in module._buffers and weight.dtype == torch.float8_e4m3fn:  # the FP8 layer itself
            # the formula of docs/fp8.md in plain torch: Q * s in float32, rounded once to the load dtype
            dequantised[name.removesuffix(".base_layer") + ".weight"] = (
                weight.to(torch.float32) * module.weight_scale).to(dtype)
    assert len(dequantised) == 14
    # PEFT itself cannot merge into the e4m3 codes (what the docs promise this replaces)
    _assert_merged_save_is_peft_merge_on(model, tokenizer, path, tmp_path, dtype, dequantised)
    # the FP8 model keeps its codes
    assert hf.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.float8_e4m3fn


def test_shards_tied_embeddings_and_a_second_save_over_the_first(checkpoints, tmp_path):
    path = checkpoints["llama_tied"]
    model, tokenizer = _lora_model(path, dtype=torch.float32)
    model.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "merged"
    model.save_pretrained_merged(out, tokenizer)  # one file first
    assert os.path.isfile(out / "model.safetensors")
    model.save_pretrained_merged(out, tokenizer, max_shard_size="60KB")  # then sharded into the same folder
    assert not os.path.exists(out / "model.safetensors"), "the first save's file would shadow the shards"
    index = json.load(open(out / "model.safetensors.index.json"))
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all(os.path.isfile(out / f) for f in files)
    for layer in range(2):  # a decoder layer is never split over two files
        assert len({f for k, f in index["weight_map"].items() if k.startswith(f"model.layers.{layer}.")}) == 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as transformers stores it
    reference = _peft_merged(path, str(tmp_path / "adapter"), torch.float32)
    loaded = _load_plain(str(out))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    _assert_same_weights(loaded, reference)
    assert torch.equal(_logits(loaded), _logits(reference))


def test_moe_expert_adapters_merge_and_the_experts_are_written_in_the_checkpoint_layout(tmp_path):
    """Qwen3-MoE with LoRA on the attention and on the fused expert stacks (PEFT's target_parameters); transformers
    fuses the per-expert checkpoint tensors at load and the saved folder must have them per expert again."""
    from tests.test_moe_parity import ATTENTION, EXPERT_PARAMETERS, tiny_qwen3_moe
    from swiftune.data import build_tokenizer

    path = str(tmp_path / "moe")
    tiny_qwen3_moe().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = swiftune.FastModel.from_pretrained(path)
        model = swiftune.FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                                  target_modules=ATTENTION, target_parameters=EXPERT_PARAMETERS)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(tmp_path / "adapter")
    model.save_pretrained_merged(tmp_path / "merged", tokenizer, max_shard_size="100KB")
    index = json.load(open(tmp_path / "merged" / "model.safetensors.index.json"))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in index["weight_map"]
    reference = _peft_merged(path, str(tmp_path / "adapter"), torch.float32)
    loaded = _load_plain(str(tmp_path / "merged"))
    _assert_same_weights(loaded, reference)
    assert torch.equal(_logits(loaded), _logits(reference))
    base = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(loaded.state_dict()[experts], base[experts]), "the expert adapters were merged"


def test_lora_save_method_writes_the_adapter_folder_that_peft_loads(checkpoints, tmp_path):
    path = checkpoints["qwen3"]
    model, tokenizer = _lora_model(path, dtype=torch.float32)
    model.save_pretrained_merged(tmp_path / "lora", tokenizer, save_method="lora")
    assert os.path.isfile(tmp_path / "lora" / "adapter_config.json")
    assert not os.path.exists(tmp_path / "lora" / "config.json")
    assert os.path.isfile(tmp_path / "lora" / "tokenizer_config.json")
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(plain, str(tmp_path / "lora")).eval()
    ours = {n: p for n, p in model.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_unsloth_call_signature_on_fast_language_model(checkpoints, tmp_path):
    from swiftune import FastLanguageModel

    path = checkpoints["qwen3"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=64, dtype=None,
                                                             load_in_4bit=False)
        model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=4, random_state=3407)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)
    with pytest.warns(UserWarning, match="maximum_memory_usage"):
        model.save_pretrained_merged("%s" % (tmp_path / "model"), tokenizer, save_method="merged_16bit",
                                     maximum_memory_usage=0.5)
    loaded = _load_plain(str(tmp_path / "model"))
    want = _logits(model.eval())  # the adapters at run time, fp32: the merge changes only the rounding
    assert rel_err(_logits(loaded), want) < 1e-5
    assert rel_err(_logits(loaded), _logits(transformers.AutoModelForCausalLM.from_pretrained(path))) > 1e-3


def test_refusals_say_what_to_do(checkpoints, tmp_path):
    path = checkpoints["qwen3"]
    model, tokenizer = _lora_model(path, dtype=torch.float32)
    with pytest.raises(ConfigError, match="save_method='gguf'.*'merged_16bit'"):
        model.save_pretrained_merged(tmp_path / "x", tokenizer, save_method="gguf")
    for method in ("merged_4bit", "merged_4bit_forced"):
        with pytest.raises(ConfigError, match="rounded away.*merged_16bit.*load_in_4bit=True"):
            model.save_pretrained_merged(tmp_path / "x", tokenizer, save_method=method)
    with pytest.raises(ConfigError, match="push_to_hub_merged"):
        model.save_pretrained_merged(tmp_path / "x", tokenizer, push_to_hub=True)
    with pytest.raises(ConfigError, match="dtype="):
        model.save_pretrained_merged(tmp_path / "x", tokenizer, dtype="int8")
    with pytest.raises(ConfigError, match="save_pretrained"):
        model.save_pretrained_merged(tmp_path / "x", "not a tokenizer")
    assert not os.path.exists(tmp_path / "x"), "a refused call writes nothing"
    model.save_pretrained_merged(tmp_path / "lora", save_method="lora")
    with pytest.raises(ConfigError, match="adapter_config.json"):
        model.save_pretrained_merged(tmp_path / "lora", save_method="merged_16bit")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare, _ = swiftune.FastModel.from_pretrained(path)
    with pytest.raises(ConfigError, match="no LoRA adapters.*get_peft_model"):
        bare.save_pretrained_merged(tmp_path / "y", tokenizer)

    plain = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path),
                                peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert not hasattr(plain, "save_pretrained_merged")
    from swiftune.training.merged_save import save_pretrained_merged

    with pytest.raises(ConfigError, match="not made by swiftune's FastModel.*merge_and_unload"):
        save_pretrained_merged(plain, tmp_path / "z", tokenizer)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base, _ = swiftune.FastModel.from_pretrained(path)
        dora = swiftune.FastModel.get_peft_model(base, r=4, use_dora=True, use_gradient_checkpointing=False)
    with pytest.raises(ConfigError, match="DoRA"):
        dora.save_pretrained_merged(tmp_path / "d", tokenizer)


def test_push_to_hub_merged_uploads_the_merged_folder(checkpoints, tmp_path, monkeypatch):
    import huggingface_hub

    calls = {}

    class FakeApi:  # no network here: record what would be sent
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False, repo_type=None):
            calls["create"] = (repo_id, private, exist_ok)
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(self, repo_id, folder_path, **kwargs):
            calls["upload"] = (repo_id, sorted(os.listdir(folder_path)), kwargs)
            calls["config"] = json.load(open(os.path.join(folder_path, "config.json")))
            return "https://huggingface.co/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    model, tokenizer = _lora_model(checkpoints["qwen3"], dtype=torch.float32)
    url = model.push_to_hub_merged("me/tiny-merged", tokenizer, save_method="merged_16bit", token="hf_x", private=True)
    assert url == "https://huggingface.co/commit/1"
    assert calls["token"] == "hf_x" and calls["create"] == ("me/tiny-merged", True, True)
    repo, files, kwargs = calls["upload"]
    assert repo == "me/tiny-merged" and {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(files)
    assert kwargs["commit_message"] and calls["config"]["architectures"] == ["Qwen3ForCausalLM"]
    assert VOCAB == calls["config"]["vocab_size"]


def test_the_methods_hold_no_reference_to_the_model_and_follow_a_deep_copy(checkpoints, tmp_path):
    import copy
    import gc
    import weakref

    model, tokenizer = _lora_model(checkpoints["qwen3"], dtype=torch.float32)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(1.0)
    clone.save_pretrained_merged(tmp_path / "clone", tokenizer)
    model.save_pretrained_merged(tmp_path / "model", tokenizer)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(_load_plain(str(tmp_path / "clone")).state_dict()[key],
                           _load_plain(str(tmp_path / "model")).state_dict()[key]), "the copy saved its own weights"
    gc.disable()
    try:
        ref = weakref.ref(model)
        del model
        assert ref() is None, "a method kept in the model's __dict__ must not keep the model alive"
    finally:
        gc.enable()
