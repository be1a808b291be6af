"""`swiftune generate`: both engines, greedy, agree with transformers' generate on the built-in model;
a LoRA adapter folder (``--model ADAPTER_DIR`` or ``--model BASE --adapter ADAPTER_DIR``) generates
what PEFT's own model generates, and adapter folders that cannot work end in one line."""

import json
import math
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftune.cli import main
from swiftune.data import build_tokenizer, tiny_model_config
from swiftune.cli.generate import main_generate


def run(capsys, *argv) -> list[dict]:
    assert main_generate(list(argv)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_generate_greedy_engines_agree_with_transformers(capsys):
    prompts = ["Reverse: abc\n", "Uppercase: dog\n"]
    args = ["--temperature", "0", "--max_tokens", "6", "--json", "--seed", "5"]
    for p in prompts:
        args += ["--prompt", p]
    fast = run(capsys, *args, "--engine", "fast")
    slow = run(capsys, *args, "--engine", "transformers")
    assert [r["completion"] for r in fast] == [r["completion"] for r in slow]
    # the same built-in model (seed 5) through transformers' own greedy generate
    torch.manual_seed(5)
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3")).eval()
    for p, row, slow_row in zip(prompts, fast, slow):
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=tok.pad_token_id,
                             output_logits=True, return_dict_in_generate=True)
        assert tok.decode(out.sequences[0, ids.shape[1]:]) == row["completion"]
        # greedy records each token's log-prob at temperature 1 (it was 0.0: greedy ran as top_k=1)
        new = out.sequences[0, ids.shape[1]:]
        logps = [torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(out.logits, new)]
        want = float(torch.stack(logps).mean())
        assert want < -0.01
        assert row["tokens"] == 6 and row["mean_logprob"] == pytest.approx(want, abs=1e-4)
        assert slow_row["mean_logprob"] == pytest.approx(want, abs=1e-4)


def test_generate_tokenizes_and_stops_chat_and_plain_prompts_as_grpo_does(capsys):
    from swiftune.rl import GRPOConfig, GRPOTrainer

    tok = build_tokenizer()
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    # a chat prompt through the chat template (transformers 5 returns a BatchEncoding when tokenizing: it crashed)
    chat = run(capsys, "--chat", "--prompt", "Reverse: abc", "--max_tokens", "3", "--json", "--temperature", "0")
    assert len(chat) == 1 and chat[0]["tokens"] >= 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"))
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=GRPOConfig(output_dir="unused", report_to="none", num_generations=2,
                                          per_device_train_batch_size=2, use_cpu=True),
                          train_dataset=[{"prompt": "x"}], processing_class=tok)
    from swiftune.rl.batching import generation_stop_ids, prompt_token_ids

    message = [{"role": "user", "content": "Reverse: abc"}]
    assert prompt_token_ids(tok, message) == trainer.tokenize_prompt(message)
    assert generation_stop_ids(tok, model, True) == trainer.stop_token_ids(True)
    assert generation_stop_ids(tok, model, False) == trainer.stop_token_ids(False)
    assert end_of_turn in trainer.stop_token_ids(True) and end_of_turn not in trainer.stop_token_ids(False)


def test_generate_fused_layers_gives_the_same_samples(capsys):
    args = ["--max_tokens", "8", "--json", "--seed", "3", "--num_generations", "3", "--prompt", "Sort: cab\n"]
    plain = run(capsys, *args, "--engine", "fast", "--no_fused_layers")
    fused = run(capsys, *args, "--engine", "fast")
    # the same samples; log-probs within float32 rounding (the fused run also patches the model's kernels)
    assert len(fused) == 3 and [r["completion"] for r in fused] == [r["completion"] for r in plain]
    assert all(abs(a["mean_logprob"] - b["mean_logprob"]) < 1e-5 for a, b in zip(fused, plain))


def test_generate_kv_cache_dtype_reaches_the_fast_engine(capsys, monkeypatch):
    """--kv_cache_dtype fp8: the fast engine decodes from an FP8 cache (its workspace holds e4m3 codes);
    without --engine fast it is refused before the model loads."""
    import swiftune.rl.rollout as rollout

    engines = []

    class Recorded(rollout.FastRolloutEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(rollout, "FastRolloutEngine", Recorded)
    out = run(capsys, "--max_tokens", "6", "--json", "--temperature", "0", "--engine", "fast",
              "--kv_cache_dtype", "fp8", "--prompt", "Sort: cab\n")
    assert len(out) == 1 and math.isfinite(out[0]["mean_logprob"])
    assert [e.kv_cache_dtype for e in engines] == ["fp8"] and engines[0]._ws.k[0].dtype == torch.float8_e4m3fn
    line = one_line_error(capsys, "--kv_cache_dtype", "fp8")
    assert "--kv_cache_dtype fp8 need --engine fast" in line, line


# ----------------------------------------------------------------------------- LoRA adapter folders

PROMPTS = ["Reverse: abc\n", "Sort: cab\n"]
GREEDY = ["--temperature", "0", "--max_tokens", "5", "--json", "--seed", "0",
          "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]


def save_tiny_base(path, seed: int = 0, **sizes) -> None:
    """A tiny Qwen3 (random weights from ``seed``; ``sizes`` override the config) and the built-in
    tokenizer, saved as a model folder."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_model_config("qwen3", **sizes)).save_pretrained(path)
    build_tokenizer().save_pretrained(path)


@pytest.fixture(scope="module")
def lora_folders(tmp_path_factory):
    """``(base_dir, adapter_dir)``: a saved tiny base and a PEFT LoRA adapter of it (B drawn, not
    PEFT's zeros, so that the adapter changes the output), as a LoRA training run leaves them."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    base_dir, adapter_dir = str(root / "base"), str(root / "adapter")
    save_tiny_base(base_dir)
    # loaded from its folder, as a training run loads it: the adapter records base_dir as its base
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(adapter_dir)
    return base_dir, adapter_dir


def peft_greedy(base_dir: str, adapter_dir: str | None) -> list[str]:
    """The reference: plain transformers (+ PEFT) greedy generate of PROMPTS, 5 new tokens."""
    from peft import PeftModel

    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
        gen = model.generate(input_ids=ids, do_sample=False, max_new_tokens=5, min_new_tokens=5,
                             pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, ids.shape[1]:]))
    return out


def test_generate_applies_a_lora_adapter_folder_as_peft_does(capsys, lora_folders):
    base_dir, adapter_dir = lora_folders
    expected = peft_greedy(base_dir, adapter_dir)
    assert expected != peft_greedy(base_dir, None)  # the adapter changes what greedy decoding picks
    by_folder = run(capsys, *GREEDY, "--model", adapter_dir)  # on the base it records
    explicit = run(capsys, *GREEDY, "--model", base_dir, "--adapter", adapter_dir)
    fast = run(capsys, *GREEDY, "--model", adapter_dir, "--engine", "fast")  # PEFT layers in the fast engine
    for rows in (by_folder, explicit, fast):
        assert [r["completion"] for r in rows] == expected
        assert all(r["tokens"] == 5 for r in rows)
    plain = run(capsys, *GREEDY, "--model", base_dir)
    assert [r["completion"] for r in plain] == peft_greedy(base_dir, None) != expected
    # the training commands' --model_name_or_path and transformers' --max_new_tokens name the same options
    spelled = [a.replace("--max_tokens", "--max_new_tokens") for a in GREEDY]
    assert [r["completion"] for r in run(capsys, *spelled, "--model_name_or_path", adapter_dir)] == expected


def copy_adapter(adapter_dir: str, dest, **config_changes) -> str:
    """A copy of the adapter folder with ``adapter_config.json`` fields changed."""
    shutil.copytree(adapter_dir, dest)
    path = os.path.join(dest, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(config_changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dest)


def one_line_error(capsys, *argv) -> str:
    """Run ``swiftune generate ARGV``, which must end in one error line and exit status 2 (after
    transformers' loading progress bars, when a model loaded before the mistake showed)."""
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("swiftune generate:")]
    assert len(lines) == 1 and err.strip().endswith(lines[0]) and "Traceback" not in err, err
    return lines[0]


def test_an_adapter_whose_recorded_base_is_not_here_takes_base_model(capsys, lora_folders, tmp_path):
    base_dir, adapter_dir = lora_folders
    moved = copy_adapter(adapter_dir, tmp_path / "moved", base_model_name_or_path=str(tmp_path / "gone" / "base"))
    line = one_line_error(capsys, *GREEDY, "--model", moved)
    assert "gone" in line and "--base_model" in line
    builtin = copy_adapter(adapter_dir, tmp_path / "builtin", base_model_name_or_path=None)
    assert "--base_model" in one_line_error(capsys, *GREEDY, "--model", builtin)
    rows = run(capsys, *GREEDY, "--model", moved, "--base_model", base_dir)
    assert [r["completion"] for r in rows] == peft_greedy(base_dir, adapter_dir)


def test_incomplete_or_mismatched_adapters_end_in_one_line(capsys, lora_folders, tmp_path):
    base_dir, adapter_dir = lora_folders
    incomplete = copy_adapter(adapter_dir, tmp_path / "incomplete")
    os.remove(os.path.join(incomplete, "adapter_model.safetensors"))
    assert "incomplete" in one_line_error(capsys, "--model", incomplete)
    # an adapter of another architecture: its target modules are not in the base
    other = copy_adapter(adapter_dir, tmp_path / "other", target_modules=["qkv_proj", "v_proj"])
    line = one_line_error(capsys, "--model", other)
    assert "(qkv_proj)" in line and "--base_model" in line
    # a shallower base of the same family: layer 1's tensors would be dropped
    shallow = str(tmp_path / "shallow")
    save_tiny_base(shallow, num_hidden_layers=1)
    line = one_line_error(capsys, "--model", shallow, "--adapter", adapter_dir)
    assert "no place" in line and "layers.1." in line
    # a wider base: other shapes
    wide = str(tmp_path / "wide")
    save_tiny_base(wide, hidden_size=64, intermediate_size=96)
    assert "other shapes" in one_line_error(capsys, "--model", wide, "--adapter", adapter_dir)


def test_adapter_options_are_checked_before_loading(capsys, lora_folders, tmp_path):
    base_dir, adapter_dir = lora_folders
    assert "not a PEFT adapter folder" in one_line_error(capsys, "--model", base_dir, "--adapter", base_dir)
    assert "does not exist" in one_line_error(capsys, "--adapter", str(tmp_path / "nope"))
    assert "both name the base" in one_line_error(capsys, "--model", base_dir, "--base_model", base_dir,
                                                  "--adapter", adapter_dir)
    assert "--base_model is the base of an adapter" in one_line_error(capsys, "--model", base_dir,
                                                                     "--base_model", base_dir)
    assert "is an adapter folder too" in one_line_error(capsys, "--model", adapter_dir, "--adapter", adapter_dir)


# ----------------------------------------------------------------------------- repetition penalty

PENALTY_PROMPTS = ["Reverse: abc\n", "aaaa bbbb aaaa\n"]
PENALTY = 1.5


def transformers_greedy(path: str, penalty: float) -> list[str]:
    """The reference: the unpatched saved model's own greedy generate of PENALTY_PROMPTS with its
    repetition penalty (transformers' RepetitionPenaltyLogitsProcessor over the prompt and the tokens
    so far), 10 new tokens, stopping at the end of sequence."""
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    stops = [tok.eos_token_id]  # a plain prompt stops at the end of sequence only, as in GRPO on plain prompts
    out = []
    for p in PENALTY_PROMPTS:
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
        gen = model.generate(input_ids=ids, do_sample=False, max_new_tokens=10, repetition_penalty=penalty,
                             eos_token_id=stops, pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, ids.shape[1]:]))
    return out


@pytest.fixture(scope="module")
def penalty_reference(tmp_path_factory):
    """``(saved model dir, transformers' greedy completions with PENALTY)``; the penalty changes
    what greedy decoding picks on this model, so a CLI that dropped it would fail."""
    path = str(tmp_path_factory.mktemp("penalty") / "base")
    save_tiny_base(path, seed=2)
    want = transformers_greedy(path, PENALTY)
    assert want != transformers_greedy(path, 1.0)
    return path, want


@pytest.mark.parametrize("engine", ["transformers", "fast"])
def test_generate_repetition_penalty_is_transformers_greedy_with_the_penalty(capsys, penalty_reference, engine):
    path, want = penalty_reference
    # float32 as the reference (on a GPU machine "auto" would load bf16, whose greedy picks may differ)
    args = ["--model", path, "--temperature", "0", "--max_tokens", "10", "--json", "--engine", engine,
            "--repetition_penalty", str(PENALTY), "--dtype", "float32"]
    for p in PENALTY_PROMPTS:
        args += ["--prompt", p]
    assert [r["completion"] for r in run(capsys, *args)] == want


@pytest.mark.parametrize("bad", ["0", "-1.1", "nan", "inf"])
def test_generate_refuses_a_repetition_penalty_that_is_not_positive(capsys, bad):
    line = one_line_error(capsys, "--repetition_penalty", bad)
    assert "--repetition_penalty" in line and "> 0" in line and "1.0: off" in line


@pytest.mark.parametrize("option, bad, value, needle", [
    ("--num_generations", "0", None, "whole number >= 1"), ("--max_tokens", "0", 0, "whole number >= 1"),
    ("--temperature", "-1", -1.0, "finite number >= 0"), ("--top_p", "2", 2.0, "(0, 1]"), ("--top_p", "0", 0.0, "(0, 1]"),
    ("--top_k", "-3", -3, "-1 (vLLM's) for off"), ("--min_p", "5", 5.0, "[0, 1]")])
def test_generate_refuses_sampling_values_no_engine_honours(capsys, option, bad, value, needle):
    """Once taken silently (a negative temperature as greedy, top_p above 1 as off, top_k -3 as off, no tokens) or
    ended in a traceback (no generations: a division by zero; min_p above 1: torch's multinomial): one line naming
    the option, before the model loads; SamplingParams refuses the same values from Python."""
    from swiftune.rl.rollout import SamplingParams

    line = one_line_error(capsys, option, bad)
    assert line.startswith(f"swiftune generate: error: {option}=") and needle in line, line
    if value is not None:
        with pytest.raises(ValueError, match=f"{option.removeprefix('--')}="):
            SamplingParams(**{option.removeprefix("--"): value})
    for fine in (dict(top_k=-1), dict(top_k=0), dict(temperature=0.0), dict(min_p=0.0)):
        SamplingParams(**fine)  # vLLM's "off" values and greedy stay accepted
