"""Architectures swiftune does not patch (GPT-2) train on padded rows, never on padding-free rows
whose examples would attend to each other; packing=True is refused there; encoders (BERT) are
refused. The reference is plain transformers on right-padded rows."""

import math
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertLMHeadModel, GPT2Config

from swiftune.data import IGNORE_INDEX, build_tokenizer, builtin_instruction_dataset, prepare_dataset, tiny_model_config
from swiftune.models import patch_model
from swiftune.training import FastModel
from swiftune.models.support import PACKED_ATTENTION_IMPLEMENTATIONS, batch_layout_for, require_causal_decoder
from swiftune.rl import GRPOConfig, GRPOTrainer, build_policy_row, completion_logprobs
from swiftune.sft import SFTConfig, SFTTrainer

FAST = dict(kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
            logging_steps=1, seed=1, data_seed=1, dataloader_pin_memory=False, disable_tqdm=True)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tiny_gpt2(tokenizer, seed: int = 0):
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny_bert(tokenizer, **overrides):
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, **overrides)
    return config


def padded_reference_loss(model, examples, pad_id):
    """transformers' own loss on one right-padded row per example, labels as swiftune trains them."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE_INDEX)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[r, :n] = torch.tensor(e["input_ids"])
        labels[r, :n] = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(e["input_ids"], e["completion_mask"])])
        labels[r, 0] = IGNORE_INDEX
        mask[r, :n] = 1
    with torch.no_grad():
        return float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def concatenated_loss(model, examples):
    """What a padding-free row gives through GPT-2's own attention (examples see each other)."""
    ids, labels, pos = [], [], []
    for e in examples:
        ids += e["input_ids"]
        lab = [t if m else IGNORE_INDEX for t, m in zip(e["input_ids"], e["completion_mask"])]
        labels += [IGNORE_INDEX] + lab[1:]
        pos += range(len(e["input_ids"]))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), labels=torch.tensor([labels]))
    return float(out.loss)


def test_gpt2_sft_falls_back_to_padded_rows_with_the_padded_loss(tokenizer, tmp_path):
    rows = builtin_instruction_dataset(num_rows=4, seed=3)
    examples = prepare_dataset(rows, tokenizer, max_length=128).examples
    model = tiny_gpt2(tokenizer)
    want = padded_reference_loss(model, examples, tokenizer.pad_token_id)
    across = concatenated_loss(model, examples)
    assert abs(across - want) > 1e-3  # a padding-free row would train a different loss: the test can fail

    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, max_length=128, **FAST)
    with pytest.warns(UserWarning, match=r"GPT2LMHeadModel \(model_type 'gpt2'\).*padded instead"):
        trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    assert args.batch_mode == "padding_free" and trainer.batch_layout == "padded"  # what the command prints
    seen = []
    compute_loss = trainer.compute_loss

    def spy(*a, **kw):
        loss = compute_loss(*a, **kw)
        seen.append(float(loss.detach()))
        return loss

    trainer.compute_loss = spy
    trainer.train()
    assert len(seen) == 1 and math.isfinite(seen[0])
    assert abs(seen[0] - want) < 1e-5 * want, (seen[0], want, across)


def test_gpt2_packing_is_refused_naming_the_families(tokenizer, tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, packing=True, max_length=64, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # patch_model's own "unsupported family" warning
        with pytest.raises(ValueError, match=r"packing=True.*GPT2LMHeadModel.*gemma.*llama.*qwen3"):
            SFTTrainer(model=tiny_gpt2(tokenizer), args=args, train_dataset=builtin_instruction_dataset(num_rows=4),
                       processing_class=tokenizer)


def test_layout_decision(tokenizer):
    torch.manual_seed(0)
    patched = patch_model(AutoModelForCausalLM.from_config(tiny_model_config("qwen3")), attention="reference",
                          kernel_backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # swiftune's attention runs: no warning, the layout asked for
        assert batch_layout_for(patched, "padding_free") == "padding_free"
        assert batch_layout_for(patched, "packed") == "packed"
    # a supported family whose attention was left to transformers (attn_implementation="sdpa")
    kernels_only = patch_model(AutoModelForCausalLM.from_config(tiny_model_config("qwen3")), attention=None,
                               kernel_backend="reference")
    with pytest.warns(UserWarning, match=r"Qwen3ForCausalLM.*attention implementation is 'sdpa'"):
        assert batch_layout_for(kernels_only, "padding_free") == "padded"
    with pytest.raises(ValueError, match="packing=True"):
        batch_layout_for(kernels_only, "packed")
    assert batch_layout_for(tiny_gpt2(tokenizer), "padded") == "padded"


def test_grpo_attention_name_is_known():
    from swiftune.attention import GRPO_ATTENTION_NAME

    assert GRPO_ATTENTION_NAME in PACKED_ATTENTION_IMPLEMENTATIONS


def test_bert_is_refused(tokenizer, tmp_path):
    config = tiny_bert(tokenizer)
    config.save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match=r"bidirectional encoder.*swiftune trains causal decoders"):
        FastModel.from_pretrained(str(tmp_path / "bert"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = BertLMHeadModel(config)
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"BertLMHeadModel \(model_type 'bert'\).*swiftune trains causal decoders"):
            SFTTrainer(model=bert, args=args, train_dataset=builtin_instruction_dataset(num_rows=4),
                       processing_class=tokenizer)
    require_causal_decoder(tiny_bert(tokenizer, is_decoder=True))  # BERT made a decoder is causal
    bidirectional = tiny_model_config("gemma3", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="bidirectional attention"):
        require_causal_decoder(bidirectional)


def plain_completion_logprobs(model, prompts, completions):
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            logits = model(input_ids=torch.tensor([p + c])).logits[0].float()
            logps = torch.log_softmax(logits, -1)
            out += [logps[len(p) - 1 + k, t] for k, t in enumerate(c)]
    return torch.stack(out)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_gpt2_policy_forward_runs_padded_rows(tokenizer, share_prompt):
    model = tiny_gpt2(tokenizer).eval()
    prompts = [[5, 6, 7]] * 2 + [[8, 9, 10, 11]] * 2
    completions = [[20, 21, 22], [23], [24, 25], [26, 27, 28, 29]]
    row = build_policy_row(prompts, completions, share_prompt=share_prompt, group_ids=[0, 0, 1, 1])
    with torch.no_grad():
        got, _ = completion_logprobs(model, row, kernel_backend="reference")
    want = plain_completion_logprobs(model, prompts, completions)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_gpt2_grpo_trainer_warns_and_trains(tokenizer, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=4, **FAST)
    with pytest.warns(UserWarning, match=r"GPT2LMHeadModel.*policy forward runs the rollouts as padded rows"):
        trainer = GRPOTrainer(tiny_gpt2(tokenizer), lambda prompts, completions, **kw: [float(len(c)) for c in
                              completions], args=args, train_dataset=[{"prompt": "abc"}, {"prompt": "hello"}] * 2,
                              processing_class=tokenizer)
    out = trainer.train()
    assert math.isfinite(out.training_loss)
