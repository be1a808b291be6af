"""SFT trainer end to end on a tiny random model: batch modes agree, accumulation equals one big
batch, a killed run resumes to the same weights, outputs load in plain transformers/PEFT, and
the built-in `swiftune sft` run learns.

The kernels and packed attention run their plain-PyTorch references here (`kernel_backend` /
`attention_backend="reference"`) for speed; their Triton and varlen paths are checked against
those references in test_kernels.py and test_attention.py.
"""

import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftune.data import build_tokenizer, builtin_instruction_dataset, make_collator, tiny_model_config
from swiftune.sft import SFTConfig, SFTTrainer
from tests.helpers import KillAt, builtin_qwen3, rel_err

FAST = dict(kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
            logging_steps=1, seed=1, data_seed=1, dataloader_pin_memory=False, disable_tqdm=True)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def rows():
    return builtin_instruction_dataset(num_rows=48, seed=3)


def tiny_model(lora: bool, lora_seed: int = 1):
    return builtin_qwen3(lora, lora_seed, r=8)


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def train(tokenizer, rows, tmp_path, name, lora=True, collator=None, **overrides):
    model = tiny_model(lora)
    settings = dict(max_steps=5, per_device_train_batch_size=4, learning_rate=1e-3, max_length=256, **FAST)
    args = SFTConfig(output_dir=str(tmp_path / name), **{**settings, **overrides})
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                         data_collator=collator)
    trainer.train()
    with open(tmp_path / name / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f]
    return losses, trainable_state(model), trainer


def test_padding_free_packed_and_padded_give_same_losses_and_weights(tokenizer, rows, tmp_path):
    ref_losses, ref_state, trainer = train(tokenizer, rows, tmp_path, "padded", padding_free=False)
    assert len(ref_losses) == 5 and all(torch.isfinite(torch.tensor(ref_losses)))
    # the loss must actually train something: the weights moved
    assert any(rel_err(v, tiny_model(True).state_dict()[k]) > 1e-4 for k, v in ref_state.items()
               if k in tiny_model(True).state_dict())
    runs = {
        "padding_free": dict(padding_free=True),
        # the same examples per step, bin-packed into rows of max_length inside each batch
        "packed_rows": dict(collator=make_collator("packed", max_length=256)),
    }
    for name, kw in runs.items():
        losses, state, _ = train(tokenizer, rows, tmp_path, name, **kw)
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (name, losses, ref_losses)
        for key in ref_state:
            assert rel_err(state[key], ref_state[key]) < 1e-4, (name, key)


def test_negative_control_without_document_boundaries(tokenizer, rows, tmp_path):
    """Concatenating examples with positions that do NOT restart changes the loss: the equality
    above is a real test of the packed attention and label masking."""
    from swiftune.data import PaddingFreeCollator

    class NoBoundaries(PaddingFreeCollator):
        def __call__(self, examples):
            batch = super().__call__(examples)
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
            return batch

    ref_losses, _, _ = train(tokenizer, rows, tmp_path, "pf", padding_free=True)
    bad_losses, _, _ = train(tokenizer, rows, tmp_path, "nob", collator=NoBoundaries())
    assert max(abs(a - b) for a, b in zip(bad_losses, ref_losses)) > 1e-3


def test_dataset_packing_and_token_budget_batches_train(tokenizer, rows, tmp_path):
    losses, _, trainer = train(tokenizer, rows, tmp_path, "packing", packing=True, max_length=128)
    assert all(len(e["input_ids"]) <= 128 for e in trainer.train_dataset.examples)
    assert all(torch.isfinite(torch.tensor(losses)))
    losses, _, trainer = train(tokenizer, rows, tmp_path, "budget", max_tokens_per_batch=400)
    assert all(torch.isfinite(torch.tensor(losses)))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and batch["input_ids"].shape[1] <= 400


def test_gradient_accumulation_equals_one_big_batch(tokenizer, rows, tmp_path):
    big, big_state, _ = train(tokenizer, rows, tmp_path, "big", per_device_train_batch_size=8, max_steps=3)
    acc, acc_state, _ = train(tokenizer, rows, tmp_path, "acc", per_device_train_batch_size=2,
                              gradient_accumulation_steps=4, max_steps=3)
    for a, b in zip(acc, big):
        assert abs(a - b) <= 1e-5 * abs(b), (acc, big)
    for key in big_state:
        assert rel_err(acc_state[key], big_state[key]) < 1e-4, key


def test_killed_run_resumes_to_the_same_weights(tokenizer, rows, tmp_path):
    common = dict(max_steps=6, save_strategy="steps", save_steps=2, lr_scheduler_type="cosine", warmup_steps=1)
    _, full_state, _ = train(tokenizer, rows, tmp_path, "full", **common)

    out = tmp_path / "killed"
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-3,
                     max_length=256, **{**FAST, **common})
    trainer = SFTTrainer(model=tiny_model(True), args=args, train_dataset=rows, processing_class=tokenizer,
                         callbacks=[KillAt(5)])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (out / "checkpoint-4").is_dir()

    model = tiny_model(True, lora_seed=123)  # other adapter init: the trained state must come from the checkpoint
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=True)
    state = trainable_state(model)
    for key in full_state:
        assert rel_err(state[key], full_state[key]) < 1e-5, key


def test_outputs_load_in_plain_transformers_and_peft(tokenizer, rows, tmp_path):
    from peft import PeftModel

    _, _, trainer = train(tokenizer, rows, tmp_path, "lora", max_steps=2)
    trainer.save_model(str(tmp_path / "adapter"))
    base = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"))
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    saved = {n.replace(".default", ""): p for n, p in trainer.model.named_parameters() if "lora_" in n}
    for n, p in loaded.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, saved[n.replace(".default", "")])

    _, full_state, trainer = train(tokenizer, rows, tmp_path, "fullft", lora=False, max_steps=2)
    trainer.save_model(str(tmp_path / "model"))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    for n, p in plain.named_parameters():
        assert torch.equal(p, full_state[n]), n


def test_bad_inputs_say_what_to_change(tokenizer, rows, tmp_path):
    args = SFTConfig(output_dir=str(tmp_path / "bad"), padding_free=False, **FAST)
    no_pad = build_tokenizer(with_pad_token=False)
    with pytest.raises(ValueError, match="pad token"):
        SFTTrainer(model=tiny_model(False), args=args, train_dataset=rows, processing_class=no_pad)
    ok_args = SFTConfig(output_dir=str(tmp_path / "bad2"), **FAST)
    with pytest.raises(ValueError, match="empty"):
        SFTTrainer(model=tiny_model(False), args=ok_args, train_dataset=[], processing_class=tokenizer)
    with pytest.raises(ValueError, match="column"):
        SFTTrainer(model=tiny_model(False), args=ok_args, train_dataset=[{"question": "a", "answer": "b"}],
                   processing_class=tokenizer)
    with pytest.raises(ValueError, match="max_length"):
        SFTConfig(output_dir=str(tmp_path / "bad3"), packing=True, max_length=None)
    with pytest.raises(TypeError, match="SFTConfig"):
        from transformers import TrainingArguments

        SFTTrainer(model=tiny_model(False), args=TrainingArguments(output_dir=str(tmp_path / "x")),
                   train_dataset=rows, processing_class=tokenizer)


@pytest.mark.slow
def test_builtin_swiftune_sft_run_learns(tmp_path):
    """The README's main job, exactly as a user runs it (no TRITON_INTERPRET: a fresh process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sft"
    proc = subprocess.run(
        [sys.executable, "-m", "swiftune.cli", "sft", "--output_dir", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("metrics.jsonl", "loss.png", "model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).exists(), name
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    for key in ("step", "loss", "learning_rate", "tokens", "tokens_per_s", "padding_fraction"):
        assert key in rows[0]
    k = len(rows) // 5
    first = sum(r["loss"] for r in rows[:k]) / k
    last = sum(r["loss"] for r in rows[-k:]) / k
    assert last < 0.6 * first, (first, last)
    assert "first fifth" in proc.stdout
    # the folder the line names is the model (a "{model, ...}" spelling once read as a subfolder "model")
    assert f"wrote the model to {out} (load it from there)" in proc.stdout and (out / "config.json").exists()


def test_command_resumes_from_the_newest_checkpoint(tmp_path):
    """`swiftune sft ... --resume_from_checkpoint true` continues from checkpoint-N of output_dir."""
    from swiftune.cli import main
    from swiftune.cli.arguments import resume_target

    out = tmp_path / "run"
    common = ["sft", "--output_dir", str(out), "--per_device_train_batch_size", "4", "--save_steps", "2",
              "--kernel_backend", "reference", "--attention_backend", "reference", "--disable_tqdm", "true",
              "--report_to", "none", "--save_total_limit", "3"]
    assert main(common + ["--max_steps", "2"]) == 0
    assert (out / "checkpoint-2").is_dir()
    assert main(common + ["--max_steps", "4", "--resume_from_checkpoint", "true"]) == 0
    state = json.load(open(out / "checkpoint-4" / "trainer_state.json"))
    steps = [h["step"] for h in state["log_history"] if "loss" in h]
    assert steps == [1, 2, 3, 4]  # steps 1-2 come from the checkpoint's history, not a second run of them
    assert resume_target("false") is None and resume_target("last") is True
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint"):
        resume_target(str(tmp_path / "missing"))


def test_command_evaluates_a_held_out_file(tmp_path):
    """`swiftune sft --eval_dataset FILE --eval_strategy steps`: eval_loss logged beside the steps."""
    from swiftune.cli import main

    data = tmp_path / "eval.jsonl"
    with open(data, "w") as f:
        for row in builtin_instruction_dataset(num_rows=6, seed=9):
            f.write(json.dumps(row) + "\n")
    out = tmp_path / "run"
    assert main(["sft", "--output_dir", str(out), "--per_device_train_batch_size", "4", "--max_steps", "2",
                 "--kernel_backend", "reference", "--attention_backend", "reference", "--disable_tqdm", "true",
                 "--report_to", "none", "--save_strategy", "no", "--eval_dataset", str(data),
                 "--eval_strategy", "steps", "--eval_steps", "1"]) == 0
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [m for m in lines if "eval_loss" in m]
    assert [m["step"] for m in evals] == [1, 2] and all(math.isfinite(m["eval_loss"]) for m in evals)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_model_path_uses_the_configs_kernel_backend(tokenizer, rows, tmp_path, backend):
    """SFTTrainer(model="path/to/model") loads, patches and trains with its SFTConfig's kernel_backend."""
    path = tmp_path / "base"
    tiny_model(False).save_pretrained(path)
    tokenizer.save_pretrained(path)
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                     max_length=64, **{**FAST, "kernel_backend": backend})
    trainer = SFTTrainer(model=str(path), args=args, train_dataset=rows[:4])
    from swiftune.models.state import patch_state

    backends = {patch_state(m).kernel_backend for m in trainer.model.modules() if patch_state(m)}
    assert backends == {backend}
    trainer.train()


def test_cli_offload_gpu_budget_checks():
    """--offload_gpu_budget_gb needs offloaded checkpointing and a non-negative size (checked before
    any model is built)."""
    from swiftune.cli.arguments import ModelArguments
    from swiftune.cli.runs import build_model
    from swiftune.errors import ConfigError

    for gc, budget, message in (("true", 0.0, "needs --use_gradient_checkpointing offload"),
                                ("offload", -1.0, "must be >= 0")):
        args = ModelArguments(use_gradient_checkpointing=gc, offload_gpu_budget_gb=budget)
        with pytest.raises(ConfigError, match=message):
            build_model(args, config=None, builtin=True)
    # --offload_attention_output_layers reaches the offloaded checkpointing of the model it builds ...
    from swiftune.training.checkpointing import offload_stats

    config = SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none")
    args = ModelArguments(use_gradient_checkpointing="offload", offload_attention_output_layers=1)
    assert offload_stats(build_model(args, config, builtin=True)[0])["attention_output_layers"] == 1
    # (with --offload_attention_outputs_on_host, kept in host memory)
    args = ModelArguments(use_gradient_checkpointing="offload", offload_attention_output_layers=2,
                          offload_attention_outputs_on_host=True)
    stats = offload_stats(build_model(args, config, builtin=True)[0])
    assert stats["attention_output_layers"] == 2 and stats["attention_outputs_on_host"] is True
    # ... and is checked as the budget is
    for gc, kept, on_host, message in (
            ("true", 2, False, "--offload_attention_output_layers needs --use_gradient_checkpointing offload"),
            ("offload", -1, False, "must be a whole number of decoder layers >= 0"),
            ("offload", 0, True, "--offload_attention_outputs_on_host needs --offload_attention_output_layers N")):
        args = ModelArguments(use_gradient_checkpointing=gc, offload_attention_output_layers=kept,
                              offload_attention_outputs_on_host=on_host)
        with pytest.raises(ConfigError, match=message):
            build_model(args, config=None, builtin=True)


def test_cli_tiled_mlp_reaches_the_model_and_needs_lora():
    """--tiled_mlp false builds an offloaded LoRA model with the MLP untiled (the default tiles it), --tiled_mlp
    tiles a plainly checkpointed one; with full fine-tuning it is refused before any model is built (explicit
    --use_lora false) or once the built-in model has decided (its default is full fine-tuning)."""
    from swiftune.cli.arguments import ModelArguments
    from swiftune.cli.runs import build_model
    from swiftune.errors import ConfigError
    from swiftune.models.tiled_mlp import is_tiled

    config = SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none")
    for gc, tiled, expected in (("offload", None, True), ("offload", False, False), ("true", True, True),
                                ("true", None, False)):
        args = ModelArguments(use_lora=True, use_gradient_checkpointing=gc, tiled_mlp=tiled)
        assert is_tiled(build_model(args, config, builtin=True)[0]) is expected, (gc, tiled)
    with pytest.raises(ConfigError, match="--tiled_mlp applies to LoRA training"):
        build_model(ModelArguments(use_lora=False, tiled_mlp=False), config=None, builtin=True)
    with pytest.raises(ConfigError, match="--tiled_mlp applies to LoRA training"):
        build_model(ModelArguments(tiled_mlp=True), config, builtin=True)


@pytest.mark.parametrize("value,message", [(float("nan"), "must be a finite number >= 0"),
                                           (float("inf"), "must be a finite number >= 0"),
                                           (-1.0, "learning_rate=-1.0 must be >= 0")])
def test_config_names_a_non_finite_learning_rate_as_such(tmp_path, value, message):
    """nan and inf are refused as non-finite, not as if they were negative; a negative value as negative."""
    from swiftune.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        SFTConfig(output_dir=str(tmp_path / "o"), learning_rate=value, use_cpu=True)


@pytest.mark.parametrize("bf16", [True, False])
def test_training_step_leaves_lora_inputs_in_the_autocast_dtype_under_bf16(tokenizer, rows, tmp_path, bf16):
    """With bf16 (autocast) the trainer switches PEFT's LoRA input casts off for the step, forward and
    backward recompute alike, and back on after; in float32 training they stay on."""
    model = tiny_model(lora=True)
    lora_layer = next(m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled") and hasattr(m, "lora_A"))
    seen = []
    lora_layer.register_forward_pre_hook(lambda m, a: seen.append(m.cast_input_dtype_enabled))
    args = SFTConfig(output_dir=str(tmp_path / "o"), max_steps=2, per_device_train_batch_size=4, max_length=256,
                     bf16=bf16, use_cpu=True, **FAST)
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    assert seen and set(seen) == {not bf16}
    assert lora_layer.cast_input_dtype_enabled  # restored after each step


def test_floating_point_ops_counts_the_parameters_once(tokenizer, rows, tmp_path, monkeypatch):
    """SFTTrainer's FLOP estimate equals transformers' own (6 x input tokens x non-embedding
    parameters, recomputed here from the parameters themselves) while counting the parameters
    once per model instead of at every step; a new model object is counted afresh."""
    from transformers import Trainer

    losses, _, trainer = train(tokenizer, rows, tmp_path, "flops", max_steps=3)
    model = trainer.model
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    calls = []
    base_class = type(model.get_base_model())  # PeftModel hands num_parameters to the transformers model
    counter = base_class.num_parameters

    def counting(self, *args, **kwargs):
        calls.append(1)
        return counter(self, *args, **kwargs)

    monkeypatch.setattr(base_class, "num_parameters", counting)
    for n in (5, 17, 64):
        inputs = {"input_ids": torch.randint(0, 100, (1, n))}
        assert trainer.floating_point_ops(inputs) == Trainer.floating_point_ops(trainer, inputs) == 6 * n * non_embedding
    assert len(calls) == 3  # Trainer's own estimate, each time; swiftune's was counted during training
    trainer.model = tiny_model(True)  # another model: counted again
    assert trainer.floating_point_ops({"input_ids": torch.ones(1, 4, dtype=torch.long)}) > 0 and len(calls) == 4
    assert trainer.floating_point_ops({"labels": torch.ones(1, 4)}) == 0  # no input ids: no estimate
    assert trainer.state.total_flos > 0


def test_a_scripts_collator_gets_trls_labels_beside_the_completion_mask():
    """What a script's data_collator is fed: TRL's ``labels`` (-100 where nothing trains) for collators written
    for TRL, and the ``completion_mask`` kept for one that wraps a swiftune collator (which reads the mask);
    rows without a mask train every token."""
    from swiftune.data import IGNORE_INDEX
    from swiftune.sft.trainer import trl_example

    example = {"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}
    assert trl_example(example) == {**example, "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8]}
    assert trl_example({"input_ids": [5, 6], "completion_mask": None})["labels"] == [5, 6]
    wrapped = make_collator("padding_free", max_length=16, pad_token_id=0)
    batch = wrapped([trl_example(example)])
    assert batch["labels"].tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 7, 8]]  # the mask, not every token
