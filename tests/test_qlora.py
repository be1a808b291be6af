"""QLoRA: 4-bit NF4 base weights (bitsandbytes, its CPU backend here) under swiftune's fast paths.

Reference: the plain libraries, unpatched: transformers' ``from_pretrained`` with a bitsandbytes
``BitsAndBytesConfig`` (eager attention) and PEFT's own LoRA on top, run on each document alone.
Both sides quantise the same float32 checkpoint, so they hold the same NF4 weights; compared: the
loss and every LoRA tensor's gradient (non-zero where the reference's is), for padded,
padding-free and packed batches, with gradient checkpointing off, on and offloaded.
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from transformers import AutoModelForCausalLM  # noqa: E402

from swiftune.data.builtin import build_tokenizer  # noqa: E402
from swiftune.errors import ConfigError  # noqa: E402
from swiftune.memory.planner import QUANTIZED_WEIGHT_BYTES, plan_memory  # noqa: E402
from swiftune.training import FastModel  # noqa: E402
from swiftune.training.quantization import is_quantized_4bit, nf4_config  # noqa: E402
from tests.helpers import (assert_gradients_match, copy_lora_tensors, lora_tensors, rel_err,  # noqa: E402
                           save_tiny_checkpoints, train_adapters_two_sft_steps)
from tests.test_gradient_parity import PROJECTIONS, _examples, _reference_step, _swiftune_step, _trainable  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return save_tiny_checkpoints(tmp_path_factory)


def _reference(path: str, dtype: torch.dtype = torch.float32):
    """transformers + bitsandbytes + PEFT, unpatched (eager attention)."""
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=nf4_config(dtype), dtype=dtype,
                                                attn_implementation="eager", device_map="cpu")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, config)


def _swiftune(path: str, reference, checkpointing, dtype: torch.dtype = torch.float32):
    model, _ = FastModel.from_pretrained(path, load_in_4bit=True, dtype=dtype, device_map="cpu")
    budget = {"offload_gpu_budget_bytes": 0} if checkpointing == "offload" else {}
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                     use_gradient_checkpointing=checkpointing, init_lora_weights=False, **budget)
    copy_lora_tensors(reference, model)  # the same adapters on both sides
    return model.train()


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    """Per family and compute dtype: the reference model and its loss and gradients (computed once)."""
    cache: dict = {}

    def get(family: str, dtype: torch.dtype = torch.float32):
        if (family, dtype) not in cache:
            reference = _reference(checkpoints[family], dtype)
            assert is_quantized_4bit(reference)
            cache[family, dtype] = (reference, *_reference_step(reference.train(), _examples()))
        return cache[family, dtype]

    return get


# every layout and every checkpointing mode on each family, without the full product (each case
# loads and quantises its own model: the full product would add minutes to the suite)
CASES = [("llama", "padded", False), ("llama", "packed", "offload"), ("qwen3", "padding_free", True),
         ("qwen3", "packed", "offload"), ("qwen3", "padded", True)]


@pytest.mark.parametrize("family,layout,checkpointing", CASES, ids=[f"{a}-{b}-{c}" for a, b, c in CASES])
def test_qlora_gradients_equal_peft_bitsandbytes(checkpoints, references, family, layout, checkpointing):
    reference, ref_loss, ref_grads = references(family)
    model = _swiftune(checkpoints[family], reference, checkpointing)
    assert is_quantized_4bit(model)
    for (n1, p1), (n2, p2) in zip(reference.named_parameters(), model.named_parameters()):
        if type(p1).__name__ == "Params4bit":  # the same checkpoint quantised the same way
            assert n1 == n2 and torch.equal(p1.data, p2.data), n1
    loss, grads = _swiftune_step(model, _examples(), layout)
    assert rel_err(loss, ref_loss) < 1e-5, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, _trainable(reference), 1e-4)
    assert set(ref_grads) == set(_trainable(reference)), "every adapter gets a gradient"


def test_qlora_with_derived_layer_inputs_equals_peft_bitsandbytes(checkpoints, references):
    """Offloaded checkpointing with the host too short for every layer input, so every second one is
    derived: rerun in backward from the layer before, without grad (where PEFT's and bitsandbytes' own
    4-bit forward run instead of the fused LoRA node). Loss and every LoRA gradient equal transformers +
    bitsandbytes + PEFT per document, and the reruns happened."""
    from swiftune.data import make_collator
    from swiftune.training.checkpointing import enable_offloaded_checkpointing, offload_stats
    from tests.test_gradient_parity import PAD_ID

    reference, ref_loss, ref_grads = references("qwen3")
    model = _swiftune(checkpoints["qwen3"], reference, "offload")
    layers = model.get_base_model().config.num_hidden_layers
    tokens = make_collator("packed", max_length=24, pad_token_id=PAD_ID)(_examples())["input_ids"].numel()
    page = 1024
    per_layer = -(-tokens * model.get_base_model().config.hidden_size * 4 // page) * page
    stored = layers - layers // 2  # the host holds these; the others (every second) are derived
    enable_offloaded_checkpointing(model, 0, stored * per_layer, page_bytes=page)
    loss, grads = _swiftune_step(model, _examples(), "packed")
    stats = offload_stats(model)
    assert len(stats["derived"]) == layers // 2 >= 1 and stats["derived_recomputed"] == layers // 2, stats
    assert rel_err(loss, ref_loss) < 1e-5, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, _trainable(reference), 1e-4)


def test_graphed_layers_on_a_4bit_base_equal_peft_bitsandbytes(checkpoints, references):
    """CUDA-graphed decoder layers (closures in place of replays off CUDA) on NF4 base weights: a
    padding-free step's loss and every LoRA gradient equal transformers + bitsandbytes + PEFT per
    document, and every layer took the graphed path (none fell back)."""
    from swiftune.training.layer_graphs import enable_graphed_layers, graphed_layer_stats

    reference, ref_loss, ref_grads = references("qwen3")
    model = _swiftune(checkpoints["qwen3"], reference, True)
    enable_graphed_layers(model, min_bucket_tokens=16)  # the interpreted kernels run on the padded bucket
    loss, grads = _swiftune_step(model, _examples(), "padding_free")
    stats = graphed_layer_stats(model)
    assert stats["graphed_forwards"] == 1 and stats["fallback_forwards"] == 0, stats
    assert stats["captures"] == model.get_base_model().config.num_hidden_layers, stats
    assert rel_err(loss, ref_loss) < 1e-5, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, _trainable(reference), 1e-4)


def test_qlora_bf16_compute_gradients_equal_peft_bitsandbytes(checkpoints, references):
    """bf16 compute against the float32 truth (the same NF4 checkpoint): within the plain libraries'
    own bf16 error on each tensor (three times it, at least 2e-2)."""
    _, want_loss, want = references("qwen3")
    _, plain_loss, plain = references("qwen3", torch.bfloat16)
    reference = references("qwen3", torch.bfloat16)[0]
    model = _swiftune(checkpoints["qwen3"], reference, True, torch.bfloat16)
    loss, grads = _swiftune_step(model, _examples(), "packed")
    assert rel_err(loss, want_loss) < max(2e-2, 3 * rel_err(plain_loss, want_loss))
    allowed = {name: max(2e-2, 3 * rel_err(plain[name], g)) for name, g in want.items()}
    assert_gradients_match(want, grads, _trainable(reference), allowed)


def test_sft_trains_the_adapters_of_a_4bit_model_and_saves_plain_peft_adapters(checkpoints, tmp_path):
    # the reference kernel backend: PEFT's own lora.Linear over Linear4bit trains here (the fused LoRA node and
    # the interpreted kernels on NF4 projections are the parity tests')
    model, tokenizer = FastModel.from_pretrained(checkpoints["qwen3"], load_in_4bit=True, dtype=torch.float32,
                                                 device_map="cpu", kernel_backend="reference")
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    frozen = {n: p.data.clone() for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    train_adapters_two_sft_steps(model, tokenizer, str(tmp_path / "run"))
    after = lora_tensors(model)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(frozen[n], p.data), f"{n}: a 4-bit weight changed"

    model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([tokenizer("Reverse: abc\n")["input_ids"]])
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    # plain PEFT on the 4-bit base: the same model
    base4 = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], quantization_config=nf4_config(torch.float32),
                                                 dtype=torch.float32, device_map="cpu")
    # in train mode (no dropout here): bitsandbytes' CPU layer repacks itself for a bf16 kernel the first time it
    # runs in eval mode without gradients, which swiftune's loader switches off (keep_4bit_layout_on_cpu), so the
    # float32 reference is the layer as it was quantised
    loaded4 = peft.PeftModel.from_pretrained(base4, tmp_path / "adapter").train()
    with torch.no_grad():
        assert rel_err(loaded4(input_ids=ids).logits, want) < 1e-5
    # plain PEFT on the unquantised base: the same adapters, the base without its NF4 rounding
    base16 = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.bfloat16)
    loaded16 = peft.PeftModel.from_pretrained(base16, tmp_path / "adapter")
    for name, p in lora_tensors(loaded16).items():
        assert torch.allclose(p.float(), after[name].detach().float(), atol=1e-2, rtol=1e-2), name


def test_qlora_run_killed_and_resumed_ends_as_the_uninterrupted_run(checkpoints, tmp_path, caplog):
    """SFT on a 4-bit base killed after its checkpoint and resumed (other adapter init: the state comes from
    the checkpoint) ends with the uninterrupted run's adapters and losses; the checkpoint's adapters load in
    plain PEFT. The marker records the 4-bit base: resuming its adapters onto an unquantised base (which
    loads without an error, training on another base) says so."""
    import json
    import logging

    import swiftune
    from tests.helpers import KillAt

    rows = [{"prompt": f"Reverse: {w}\n", "completion": w[::-1]} for w in ("abc", "garden", "river", "stone", "moon")]

    def run(out, resume=None, callbacks=(), seed=1, load_in_4bit=True):
        model, tokenizer = FastModel.from_pretrained(checkpoints["qwen3"], load_in_4bit=load_in_4bit,
                                                     dtype=torch.float32, device_map="cpu", kernel_backend="reference")
        torch.manual_seed(seed)
        model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                         init_lora_weights=False)
        args = swiftune.SFTConfig(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2,
                                  lr_scheduler_type="cosine", logging_steps=1, save_strategy="steps", save_steps=2,
                                  report_to="none", use_cpu=True, kernel_backend="reference", plot_loss=False)
        trainer = swiftune.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                                      callbacks=list(callbacks))
        trainer.train(resume_from_checkpoint=resume)
        return ({h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
                {n: p.detach().clone() for n, p in lora_tensors(model).items()})

    full_losses, full_lora = run(tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "run", callbacks=[KillAt(3)])
    marker = json.load(open(tmp_path / "run" / "checkpoint-2" / "swiftune_checkpoint.json"))
    assert marker["settings"]["model.quantization"] == "4bit"
    base16 = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.bfloat16)
    assert lora_tensors(peft.PeftModel.from_pretrained(base16, tmp_path / "run" / "checkpoint-2"))
    losses, lora = run(tmp_path / "run", resume=True, seed=7)
    assert losses == full_losses
    assert all(torch.equal(lora[n], full_lora[n]) for n in full_lora)

    with caplog.at_level(logging.WARNING, logger="swiftune"):
        run(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-2"), load_in_4bit=False)
    assert "model.quantization: checkpoint '4bit', this run 'none'" in caplog.text


def test_rollout_engine_generates_from_4bit_weights(checkpoints, monkeypatch):
    """Greedy tokens equal transformers' generate on the same 4-bit + LoRA model, for three engines on one model:
    with ``nf4_decode_kernel=False`` no product goes through swiftune's NF4 kernel; by default the decode steps'
    base products do (counted), up to 16 rows, and only during the call; with ``nf4_decode_max_rows=32`` an
    18-row decode step (two prompts, G=9) takes the kernel too, which the default's 16 would send to
    bitsandbytes. A fourth, ``nf4_dense=True``, decodes from copies of the weights dequantised for the call (no
    kernel product), whose products equal bitsandbytes' own layer's."""
    import swiftune.models.nf4_decode as nf4_decode
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams

    calls = []
    kernel = nf4_decode.nf4_weight_only_matmul
    monkeypatch.setattr(nf4_decode, "nf4_weight_only_matmul",
                        lambda x, *a, **k: calls.append(x.numel() // x.shape[-1]) or kernel(x, *a, **k))

    model, tokenizer = FastModel.from_pretrained(checkpoints["qwen3"], load_in_4bit=True, dtype=torch.float32,
                                                 device_map="cpu")
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("Reverse: abc\n", "Hi\n")]
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                             pad_token_id=tokenizer.pad_token_id)
        refs.append(ref[0, len(prompt):].tolist())
    # (kernel choice, rows bound, G, new tokens: the kernel is interpreted on CPU, 18 rows a step cost)
    for nf4_kernel, max_rows, group, new in ((False, None, 1, 10), (None, None, 1, 10), (None, 32, 9, 5)):
        calls.clear()
        choice = {} if nf4_kernel is None else {"nf4_decode_kernel": nf4_kernel}
        if max_rows is not None:
            choice["nf4_decode_max_rows"] = max_rows
        out = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, kv_bucket=4, check_every=3,
                                **choice).generate(prompts, group, SamplingParams(max_tokens=new, temperature=0))
        assert bool(calls) == (nf4_kernel is not False), choice
        assert (max(calls, default=0) == 2 * group) == (max_rows is not None), choice  # 18 rows: only up to 32
        assert max(calls, default=0) <= (max_rows or 16), choice
        assert not any("swiftune_nf4_decode" in vars(m) for m in model.modules())  # unbound after the call
        for i in range(0, len(out.completion_ids), group):  # greedy: a group's completions are one
            got = out.completion_ids[i]
            assert all(c == got for c in out.completion_ids[i:i + group])
            assert got == refs[i // group][:new], choice  # greedy: the shorter run is the longer one's prefix
    # nf4_dense=True: every NF4 layer multiplies by a copy dequantised for the call (no kernel product), the
    # same greedy tokens; afterwards the layers have their own forwards back and no copy is left
    calls.clear()
    engine = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, kv_bucket=4, check_every=3, nf4_dense=True)
    out = engine.generate(prompts, 9, SamplingParams(max_tokens=5, temperature=0))
    assert calls == [] and engine.stats["nf4_dense_layers"] == 7 * model.config.num_hidden_layers
    assert not any("swiftune_nf4_dense" in vars(m) or "forward" in vars(m) for m in model.modules()
                   if type(m).__name__ == "Linear4bit" and not hasattr(m, "lora_A"))
    for i in range(0, len(out.completion_ids), 9):
        assert all(c == refs[i // 9][:5] for c in out.completion_ids[i:i + 9]), "nf4_dense"
    with pytest.raises(ValueError, match="nf4_dense must be True, False or 'auto'"):
        FastRolloutEngine(model, nf4_dense="yes")
    assert not FastRolloutEngine(model)._uses_nf4_dense()  # auto: CUDA only
    # the copy's products are bitsandbytes' own for several rows (it multiplies its dequantised weight too)
    from swiftune.models.nf4_dense import nf4_dense_bytes, nf4_dense_layers

    base = model.get_base_model().model.layers[0].mlp.down_proj.base_layer
    x = torch.randn(3, base.in_features)
    with torch.no_grad():
        want = base(x)
        with nf4_dense_layers(model) as bound:
            got = base(x)
    assert bound == 7 * model.config.num_hidden_layers and rel_err(got, want) < 1e-6
    assert nf4_dense_bytes(model) == 4 * sum(m.in_features * m.out_features for m in model.modules()
                                             if type(m).__name__ == "Linear4bit" and not hasattr(m, "lora_A"))
    with pytest.raises(ValueError, match="nf4_decode_max_rows must be an int from 2 to 64"):
        FastRolloutEngine(model, nf4_decode_max_rows=65)
    with pytest.raises(ValueError, match="runtime"):
        FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, lora="merge").generate(
            prompts, 1, SamplingParams(max_tokens=2, temperature=0))


def test_bad_quantization_requests_are_refused_before_loading(tmp_path, checkpoints):
    empty = tmp_path / "empty"
    empty.mkdir()  # no config.json: any attempt to load would fail differently
    with pytest.raises(ConfigError, match="exclusive"):
        FastModel.from_pretrained(str(empty), load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ConfigError, match="8-bit base weights are not supported"):
        FastModel.from_pretrained(str(empty), load_in_8bit=True)
    with pytest.raises(ConfigError, match="load_in_4bit=True"):
        from transformers import BitsAndBytesConfig

        FastModel.from_pretrained(str(empty), quantization_config=BitsAndBytesConfig(load_in_4bit=False))
    model, _ = FastModel.from_pretrained(checkpoints["qwen3"], load_in_4bit=True, dtype=torch.float32, device_map="cpu")
    with pytest.raises(ConfigError, match="full fine-tuning of a 4-bit model"):
        FastModel.for_training(model)
    import swiftune

    with pytest.raises(ConfigError, match="full fine-tuning of a 4-bit model"):
        swiftune.SFTTrainer(model=model, args=swiftune.SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True),
                            train_dataset=[{"prompt": "a", "completion": "b"}], processing_class=build_tokenizer())


def test_missing_bitsandbytes_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_bitsandbytes(name, *args, **kwargs):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bitsandbytes)
    with pytest.raises(ConfigError, match=r"pip install 'swiftune\[qlora\]'"):
        FastModel.from_pretrained(str(tmp_path), load_in_4bit=True)


def test_a_gpu_bitsandbytes_cannot_use_is_refused(tmp_path, monkeypatch):
    from bitsandbytes import cextension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (6, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla P100")
    monkeypatch.setattr(cextension, "lib", object())  # the CPU library, not a CUDA one
    with pytest.raises(ConfigError, match="no CUDA library for this GPU"):
        FastModel.from_pretrained(str(tmp_path), load_in_4bit=True, dtype=torch.bfloat16)


def test_cli_refuses_4bit_full_finetuning():
    from swiftune.cli.arguments import ModelArguments, check_model_args

    with pytest.raises(ConfigError, match="cannot be fully fine-tuned"):
        check_model_args(ModelArguments(model_name_or_path="some/model", load_in_4bit=True, use_lora=False))
    with pytest.raises(ConfigError, match="needs --model_name_or_path"):
        check_model_args(ModelArguments(load_in_4bit=True))


def test_planner_counts_4bit_weights():
    full = plan_memory("qwen3-8b", 4096)
    q = plan_memory("qwen3-8b", 4096, weight_quantization="nf4_double_quant")
    # embeddings and LM head stay bf16: 2 x 151,936 x 4,096 x 2 bytes; the projections ~0.516 bytes each
    embed = 2 * 151936 * 4096 * 2
    linear = 36 * (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 12288)
    assert abs(q.weights - (embed + linear * QUANTIZED_WEIGHT_BYTES["nf4_double_quant"])) < 1e7
    assert q.weights < 0.4 * full.weights
    assert q.allocated < full.allocated
    with pytest.raises(ValueError, match="needs LoRA"):
        plan_memory("qwen3-8b", 4096, full_finetune=True, weight_quantization="nf4")


def test_qlora_layers_run_the_fused_lora_node(checkpoints, references, monkeypatch):
    """The QLoRA projections train through the fused LoRA linear (W dequantised in forward and
    backward), and what it computes is PEFT + bitsandbytes' own (the parity tests above)."""
    from swiftune.models.lora_linear import LoRALinearFunction, is_fused_lora

    reference = references("qwen3")[0]
    model = _swiftune(checkpoints["qwen3"], reference, False)
    lora_layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert lora_layers and all(is_fused_lora(m) for m in lora_layers)
    calls = []
    apply = LoRALinearFunction.apply
    monkeypatch.setattr(LoRALinearFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    _swiftune_step(model, _examples(), "packed")
    assert len(calls) == len(lora_layers)


def test_an_eval_forward_on_cpu_keeps_the_nf4_layout_and_the_compute_dtype(checkpoints):
    """bitsandbytes' CPU Linear4bit repacks its weight for a bf16 kernel, in place and for good, the first time it
    runs in eval mode without gradients (on CPUs with AVX512-BF16): a float32 QLoRA run would train in bf16 after
    its first evaluation. swiftune's loader keeps the layout: the NF4 bytes are the same after an eval forward,
    and the train-mode logits after it equal plain bitsandbytes' float32 layer (train mode, never repacked)."""
    model, tokenizer = FastModel.from_pretrained(checkpoints["qwen3"], load_in_4bit=True, dtype=torch.float32,
                                                 device_map="cpu")
    before = {n: p.data.clone() for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    ids = torch.tensor([tokenizer("Reverse: abc\n")["input_ids"]])
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    for n, p in model.named_parameters():
        if n in before:
            assert p.data.shape == before[n].shape and torch.equal(p.data, before[n]), f"{n}: repacked"
    plain = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], quantization_config=nf4_config(torch.float32),
                                                 dtype=torch.float32, device_map="cpu").train()
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, plain(input_ids=ids).logits) < 1e-5
