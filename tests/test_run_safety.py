"""Faults end in a clear error and finished work is safe (issue 21), for both trainers:

* NaN/inf: non-finite weights are refused at load and before training; the first non-finite
  loss or gradient stops the run naming its step; non-finite weights are never saved;
* checkpoints appear complete or not at all: resume skips an incomplete newer one, warns about
  changed settings, and metrics.jsonl holds each step once after a resume;
* a full disk says so, and the previous checkpoint stays usable;
* one run per output_dir (lock file);
* Ctrl-C saves the finished step and stops with the resume instructions;
* the GRPO rollout buffer is stored as tensors + JSON; a crafted pickle is refused unexecuted.

Tiny random models with the plain-PyTorch kernels and attention, as in test_sft.py.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load as load_file_bytes, load_file, save_file
from transformers import AutoModelForCausalLM, TrainerCallback

from swiftune.data import build_tokenizer, builtin_instruction_dataset, tiny_model_config
from swiftune.training import FastModel
from swiftune.training.loading import first_nonfinite_tensor
from swiftune.rl import GRPOConfig, GRPOTrainer, build_policy_row
from swiftune.rl.checkpoint import UnsafeCheckpointError, load_rollout_state, save_rollout_state
from swiftune.rl.trainer import GRPOMicroBatch
from swiftune.errors import ConfigError
from swiftune.sft import SFTConfig, SFTTrainer
from swiftune.training import (
    CheckpointSaveError,
    NonFiniteError,
    RunLock,
    RunLockedError,
    TrainingInterrupted,
    newest_complete_checkpoint,
    resolve_resume,
)
from swiftune.training.checkpoints import MARKER_NAME, STAGING_PREFIX, checkpoint_problem
from swiftune.training.run_lock import LOCK_NAME
from tests.helpers import KillAt, builtin_qwen3, rel_err

FAST = dict(kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
            logging_steps=1, seed=1, data_seed=1, dataloader_pin_memory=False, disable_tqdm=True, plot_loss=False)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def rows():
    return builtin_instruction_dataset(num_rows=24, seed=3)


def tiny_model(lora: bool = True, lora_seed: int = 1):
    return builtin_qwen3(lora, lora_seed, r=4)


def sft_trainer(out, rows, tokenizer, model=None, callbacks=(), **overrides):
    settings = dict(max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3, max_length=128, **FAST)
    args = SFTConfig(output_dir=str(out), **{**settings, **overrides})
    return SFTTrainer(model=model if model is not None else tiny_model(), args=args, train_dataset=rows,
                      processing_class=tokenizer, callbacks=list(callbacks))


def steps_in(path):
    return [json.loads(line)["step"] for line in open(path) if "loss" in json.loads(line)]


def checkpoint_folders(out):
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def assert_finite_checkpoints(out):
    for name in checkpoint_folders(out):
        for file in os.listdir(out / name):
            if file.endswith(".safetensors") and not file.startswith("rollouts"):
                for key, t in load_file(str(out / name / file)).items():
                    assert torch.isfinite(t).all(), (name, file, key)


class AtStep(TrainerCallback):
    """Calls ``fn(model)`` at the beginning (or end) of optimizer step ``step``."""

    def __init__(self, step, fn, when="begin"):
        self.step, self.fn, self.when = step, fn, when

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.when == "begin" and state.global_step + 1 == self.step:
            self.fn(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.when == "end" and state.global_step == self.step:
            self.fn(model)


def poison(model, value=float("nan")):
    """Write ``value`` into the first trainable weight of ``model``; returns its name."""
    name, p = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        p.view(-1)[0] = value
    return name


# ------------------------------------------------------------------------------------ NaN / inf


def test_first_nonfinite_tensor_names_and_counts():
    ok = torch.ones(10)
    huge = torch.full((4,), 3e38)  # finite, though its sum overflows float32: must pass
    bad = torch.ones(8)
    bad[2], bad[5], bad[6] = float("nan"), float("inf"), float("nan")
    assert first_nonfinite_tensor([("a", ok), ("huge", huge), ("ints", torch.arange(3))]) is None
    assert first_nonfinite_tensor([("a", ok), ("b", bad), ("c", bad)]) == ("b", "2 NaN, 1 inf of 8 values")
    assert first_nonfinite_tensor([("h", torch.tensor([float("-inf")], dtype=torch.bfloat16))])[0] == "h"


def test_model_with_nan_weights_is_refused_at_load(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"), dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 4] = float("nan")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight holds non-finite values "
                                         r"\(1 NaN of \d+ values\)"):
        FastModel.from_pretrained(str(tmp_path), dtype=torch.float32, device_map="cpu", patch=False)


def test_model_with_nan_weights_is_refused_before_training(tmp_path, rows, tokenizer):
    model = tiny_model()
    name = poison(model, float("inf"))
    trainer = sft_trainer(tmp_path / "run", rows, tokenizer, model=model)
    with pytest.raises(NonFiniteError, match=rf"non-finite weights before the first step: {name} \(1 inf"):
        trainer.train()


@pytest.mark.parametrize("deferred", [False, True])
def test_nan_loss_at_step_k_stops_naming_the_step_and_saves_nothing_non_finite(tmp_path, rows, tokenizer, deferred):
    """The weights go NaN before step 3 (as a diverging run's would): the run stops at step 3 with
    an error, checkpoints 1 and 2 are there and finite, and no checkpoint-3 exists. The same with the
    deferred check (no sync per step: the error comes before step 3's save and log)."""
    out = tmp_path / "run"
    trainer = sft_trainer(out, rows, tokenizer, callbacks=[AtStep(3, poison)], max_steps=5,
                          save_strategy="steps", save_steps=1, deferred_nonfinite_check=deferred)
    with pytest.raises(NonFiniteError, match=r"step 3: the training loss is nan") as info:
        trainer.train()
    assert info.value.step == 3 and "checkpoint-2" in str(info.value)
    assert checkpoint_folders(out) == ["checkpoint-1", "checkpoint-2"]
    assert_finite_checkpoints(out)
    assert steps_in(out / "metrics.jsonl") == [1, 2]  # no step logged with a filtered-out NaN loss


@pytest.mark.parametrize("deferred", [False, True])
def test_nan_gradient_stops_before_the_optimizer_step(tmp_path, rows, tokenizer, deferred):
    """A finite loss whose gradient is NaN (step 2): stopped before the weights change. With the deferred
    check the fused optimizer skips step 2's update on the device and the error comes at step 2's log."""
    model = tiny_model()
    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad)

    def nan_grads(model):
        param.register_hook(lambda g: torch.full_like(g, float("nan")))

    before = {}
    trainer = sft_trainer(tmp_path / "run", rows, tokenizer, model=model, deferred_nonfinite_check=deferred,
                          callbacks=[AtStep(2, nan_grads), AtStep(1, lambda m: before.update(
                              {n: p.detach().clone() for n, p in m.named_parameters()}), when="end")])
    with pytest.raises(NonFiniteError, match=r"step 2: the gradient norm is nan \(the loss was finite\)"):
        trainer.train()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_deferred_check_trains_exactly_what_the_eager_guards_train(tmp_path, rows, tokenizer):
    """Without a NaN the deferred check changes no arithmetic (the fused AdamW's found_inf is 0, a no-op):
    the same losses every step and bit-equal trained weights as the default guards."""
    runs = {}
    for deferred in (False, True):
        trainer = sft_trainer(tmp_path / str(deferred), rows, tokenizer, max_steps=4, deferred_nonfinite_check=deferred)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[deferred] = (losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})
    (l0, w0), (l1, w1) = runs[False], runs[True]
    assert len(l0) == 4 and l0 == l1
    assert w0.keys() == w1.keys() and all(torch.equal(w0[n], w1[n]) for n in w0)


def test_deferred_check_syncs_on_no_step_and_leaves_a_skipped_steps_weights_and_optimizer_state(
        tmp_path, rows, tokenizer, monkeypatch):
    """deferred_nonfinite_check=True: no step reads a loss or norm on the host (the eager guard's is_finite is
    never called, transformers' NaN filter is off), logging only every 10 steps. A NaN loss at step 3 (the
    loss itself, weights finite) makes the fused AdamW skip step 3's update on the device: after it the
    weights and the optimizer's moments and step counts are exactly those after step 2, and the error names
    step 3 when step 4 is about to update. Non-fused optimizers and fp16 are refused with what to set."""
    import swiftune.training.safety as safety

    monkeypatch.setattr(safety, "is_finite", lambda value: pytest.fail("a per-step host read of the loss/norm"))
    snapshots = {}

    def keep(step):
        def fn(model):
            opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
            snapshots[step] = ({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                               [{k: v.clone() for k, v in st.items()} for st in opt.state.values()])
        return fn

    class NanLossAt3(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            trainer.nan_loss = state.global_step + 1 == 3

    trainer = sft_trainer(tmp_path / "run", rows, tokenizer, max_steps=6, logging_steps=10,
                          deferred_nonfinite_check=True,
                          callbacks=[NanLossAt3(), *(AtStep(k, keep(k), when="end") for k in (1, 2, 3))])
    assert trainer.args.logging_nan_inf_filter is False
    compute_loss = trainer.compute_loss

    def nan_at_3(*a, **k):
        loss = compute_loss(*a, **k)
        return loss * float("nan") if trainer.nan_loss else loss

    trainer.compute_loss = nan_at_3
    with pytest.raises(NonFiniteError, match=r"step 3: the training loss is nan") as info:
        trainer.train()
    assert info.value.step == 3 and trainer.state.global_step == 3  # stopped before step 4's update
    (w2, s2), (w3, s3) = snapshots[2], snapshots[3]
    assert all(torch.isfinite(w).all() for w in w3.values())
    assert all(torch.equal(w2[n], w3[n]) for n in w2)  # step 3 changed no weight
    assert s2 and len(s2) == len(s3) and all(torch.equal(a[k], b[k]) for a, b in zip(s2, s3) for k in a)  # nor state
    assert all(torch.equal(w2[n], p.detach()) for n, p in trainer.model.named_parameters() if n in w2)  # at the end
    assert not all(torch.equal(w2[n], w) for n, w in snapshots[1][0].items())  # steps 1-2 did train

    with pytest.raises(ConfigError, match="optim='adamw_torch_fused'"):
        SFTConfig(output_dir=str(tmp_path / "x"), deferred_nonfinite_check=True, optim="adamw_torch")
    # several processes would each judge their own losses: refused when the trainer makes its optimizer
    monkeypatch.setattr(type(trainer.args), "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="runs in one process for now; this run has 2"):
        trainer.create_optimizer()
    with pytest.raises(ConfigError, match="bf16=True"):
        SFTConfig(output_dir=str(tmp_path / "x"), deferred_nonfinite_check=True, fp16=True, use_cpu=True)


def test_non_finite_weights_are_never_saved(tmp_path, rows, tokenizer):
    """Weights that turn inf in the optimizer step of step 2 (a finite loss before): the save of
    checkpoint-2 is refused naming the weight, and checkpoint-1 is untouched."""
    out = tmp_path / "run"
    names = []
    trainer = sft_trainer(out, rows, tokenizer, save_strategy="steps", save_steps=1,
                          callbacks=[AtStep(2, lambda m: names.append(poison(m, float("inf"))), when="end")])
    with pytest.raises(NonFiniteError, match=r"step 2: the weight .* holds non-finite values \(1 inf") as info:
        trainer.train()
    assert names[0] in str(info.value) and "checkpoint-2" in str(info.value)
    assert checkpoint_folders(out) == ["checkpoint-1"] and checkpoint_problem(str(out / "checkpoint-1")) is None
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
    with pytest.raises(NonFiniteError, match="refused saving the model"):
        trainer.save_model(str(tmp_path / "final"))
    assert not (tmp_path / "final").exists()


# ------------------------------------------------------------------------------------ GRPO


def grpo_trainer(out, tokenizer, model=None, callbacks=(), **overrides):
    from tests.test_grpo import PROMPT_ROWS, FixedEngine, length_reward

    settings = dict(max_steps=3, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                    learning_rate=1e-2, kernel_backend="reference", attention_backend="reference", report_to="none",
                    save_strategy="no", logging_steps=1, seed=1, dataloader_pin_memory=False, disable_tqdm=True,
                    plot_rewards=False)
    args = GRPOConfig(output_dir=str(out), **{**settings, **overrides})
    return GRPOTrainer(model if model is not None else tiny_model(), [length_reward], args=args,
                       train_dataset=PROMPT_ROWS, processing_class=tokenizer, rollout_engine=FixedEngine(),
                       callbacks=list(callbacks))


def test_grpo_stops_at_a_nan_loss_and_stores_rollouts_without_pickle(tmp_path, tokenizer, caplog):
    out = tmp_path / "grpo"
    trainer = grpo_trainer(out, tokenizer, callbacks=[AtStep(3, poison)], save_strategy="steps", save_steps=1,
                           num_iterations=2)
    with pytest.raises(NonFiniteError, match=r"step 3: the training loss is nan"):
        trainer.train()
    assert checkpoint_folders(out) == ["checkpoint-1", "checkpoint-2"]
    assert_finite_checkpoints(out)
    files = os.listdir(out / "checkpoint-1")
    assert "rollouts-rank0.safetensors" in files and MARKER_NAME in files
    assert not [f for f in files if f.startswith("rollouts") and f.endswith(".pt")]
    # checkpoint-1 falls mid-way through a reused generation: its buffer comes back whole
    state = load_rollout_state(str(out / "checkpoint-1"), 0, "cpu", types=(GRPOMicroBatch,))
    assert state is not None and state[0] == 1 and len(state[1]) == 1
    assert isinstance(state[1][0], GRPOMicroBatch) and state[1][0].old_logps is not None
    assert json.load(open(out / "checkpoint-1" / MARKER_NAME))["settings"]["repetition_penalty"] == 1.0
    # resumed there, step 2 reuses that generation (no fresh reward to log): each step once in the metrics;
    # a changed sampling setting (the generations after the resume differ) is warned about, as any other
    with caplog.at_level(logging.WARNING, logger="swiftune"):
        resumed = grpo_trainer(out, tokenizer, num_iterations=2, repetition_penalty=1.1)
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert "repetition_penalty: checkpoint 1.0, this run 1.1" in caplog.text
    assert resumed.state.global_step == 3
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2, 3]


def token_sum_reward(prompts, completions, completion_ids, **kwargs):
    return [float(sum(c) % 7) for c in completion_ids]  # varies with the sampled tokens


@pytest.mark.parametrize("num_iterations, steps_per_generation, save_steps", [(1, 1, 2), (2, 2, 3)])
def test_grpo_resumed_with_sampled_rollouts_logs_and_ends_as_the_uninterrupted_run(
        tmp_path, tokenizer, num_iterations, steps_per_generation, save_steps):
    """The built-in engine samples (temperature 1) from its own seeded generator: a checkpoint keeps its
    state, so a run killed after a checkpoint and resumed samples the completions the uninterrupted run
    samples (the generator started from the seed again: other completions, rewards and weights)."""
    from tests.test_grpo import PROMPT_ROWS

    def run(out, resume=None, callbacks=(), lora_seed=1):
        model = tiny_model(lora_seed=lora_seed)
        args = GRPOConfig(output_dir=str(out), max_steps=5, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=1,
                          beta=0.05, temperature=1.0, num_iterations=num_iterations,
                          steps_per_generation=steps_per_generation, plot_rewards=False,
                          **{**{k: v for k, v in FAST.items() if k != "plot_loss"}, "save_strategy": "steps",
                             "save_steps": save_steps})
        trainer = GRPOTrainer(model, [token_sum_reward], args=args, train_dataset=PROMPT_ROWS,
                              processing_class=tokenizer, callbacks=list(callbacks))
        trainer.train(resume_from_checkpoint=resume)
        logs = {h["step"]: (h["loss"], h["reward"]) for h in trainer.state.log_history if "loss" in h}
        return logs, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    full_logs, full_weights = run(tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "run", callbacks=[KillAt(save_steps + 1)])
    logs, weights = run(tmp_path / "run", resume=True, lora_seed=5)
    assert len({r for _, r in full_logs.values()}) > 1  # the rewards depend on what was sampled
    assert logs == full_logs
    assert all(torch.equal(weights[n], full_weights[n]) for n in full_weights)


def test_rollout_state_round_trips_through_tensors_and_json(tmp_path):
    prompts = [[1, 2, 3], [1, 2, 3], [7, 8]]
    completions = [[4, 5], [6], [9, 10, 11]]
    row = build_policy_row(prompts, completions, share_prompt=True, group_ids=[0, 0, 1], attention_backend="reference")
    mb = GRPOMicroBatch(row, torch.tensor([0.5, -0.5, 1.0]), torch.ones(6), torch.randn(6), None, 12.0)
    save_rollout_state(str(tmp_path), 0, 7, [mb])
    micro_step, (back,) = load_rollout_state(str(tmp_path), 0, "cpu", types=(GRPOMicroBatch,))
    assert micro_step == 7 and back.ref_logps is None and back.num_items_in_batch == 12.0
    assert torch.equal(back.row.input_ids, row.input_ids) and torch.equal(back.old_logps, mb.old_logps)
    assert back.row.layout.sequences == row.layout.sequences and torch.equal(back.row.layout.seg, row.layout.seg)
    assert torch.equal(back.row.layout.packed.cu_seqlens, row.layout.packed.cu_seqlens)
    with pytest.raises(UnsafeCheckpointError, match="not one of the types"):
        load_rollout_state(str(tmp_path), 0, "cpu")  # GRPOMicroBatch not allowed here


class _Crafted:
    """What a hostile checkpoint could hold: unpickling it creates a file (any code could run)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_pickle_in_a_checkpoint_is_refused_without_running(tmp_path):
    ran = tmp_path / "code_ran"
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    torch.save({"micro_step": 1, "buffer": _Crafted(str(ran))}, folder / "rollouts-rank0.pt")
    with pytest.raises(UnsafeCheckpointError, match="pickled rollout buffer.*refused"):
        load_rollout_state(str(folder), 0, "cpu")
    assert not ran.exists()
    # a crafted safetensors file can only name data and the allowed dataclasses
    tree = {"format": "swiftune-rollouts-1", "micro_step": 1,
            "buffer": [{"dataclass": "Popen", "fields": {"args": "touch " + str(ran)}}]}
    save_file({}, str(folder / "rollouts-rank0.safetensors"), metadata={"swiftune_rollout_state": json.dumps(tree)})
    with pytest.raises(UnsafeCheckpointError, match="'Popen', not one of the types"):
        load_rollout_state(str(folder), 0, "cpu")
    assert not ran.exists()


# ------------------------------------------------------------------------------------ checkpoints


def test_resume_skips_incomplete_checkpoint_warns_on_changed_settings_and_logs_each_step_once(
        tmp_path, rows, tokenizer, caplog):
    out = tmp_path / "run"
    kill = AtStep(6, lambda m: (_ for _ in ()).throw(KeyboardInterrupt("killed")))  # after step 5 was logged
    trainer = sft_trainer(out, rows, tokenizer, callbacks=[kill], max_steps=6, save_strategy="steps",
                          save_steps=2)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert checkpoint_folders(out) == ["checkpoint-2", "checkpoint-4"]
    for name in checkpoint_folders(out):
        marker = json.load(open(out / name / MARKER_NAME))
        assert marker["complete"] and marker["settings"]["learning_rate"] == 1e-3
    assert steps_in(out / "metrics.jsonl") == [1, 2, 3, 4, 5]
    # a newer checkpoint cut short while saving (no trainer_state.json; e.g. an older version's)
    (out / "checkpoint-6").mkdir()
    (out / "checkpoint-6" / "adapter_config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="swiftune"):
        resumed = sft_trainer(out, rows, tokenizer, max_steps=6, save_strategy="steps", save_steps=2,
                              learning_rate=2e-3)
        resumed.train(resume_from_checkpoint=True)
    assert "skipping" in caplog.text and "checkpoint-6" in caplog.text and "no trainer_state.json" in caplog.text
    assert "learning_rate: checkpoint 0.001, this run 0.002" in caplog.text
    assert resumed.state.global_step == 6
    assert steps_in(out / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert checkpoint_problem(str(out / "checkpoint-6")) is None  # replaced by the complete one
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]


def test_resume_with_other_training_data_warns_that_it_does_not_continue_where_it_stopped(
        tmp_path, rows, tokenizer, caplog):
    """The Trainer resumes by skipping the checkpoint's batches of the data it is given: with another
    dataset it trains other rows than the uninterrupted run, in silence. The marker records the row count
    and a hash of a few rows, and a resume with other data says so (the same data: nothing said)."""
    out = tmp_path / "run"
    sft_trainer(out, rows, tokenizer, max_steps=2, save_strategy="steps", save_steps=2).train()
    settings = json.load(open(out / "checkpoint-2" / MARKER_NAME))["settings"]
    assert settings["data.rows"] == len(rows) and len(settings["data.sample_hash"]) == 16
    checkpoint = str(out / "checkpoint-2")
    cases = {"same": rows, "other rows": builtin_instruction_dataset(num_rows=len(rows), seed=4),
             "fewer rows": rows[:-4]}
    said = {}
    for name, data in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="swiftune"):
            sft_trainer(out, data, tokenizer, max_steps=3).train(resume_from_checkpoint=checkpoint)
        said[name] = caplog.text
    assert "other training data" not in said["same"]
    assert f"the same {len(rows)} rows in number, but other rows" in said["other rows"]
    assert f"{len(rows)} rows in the checkpoint's, {len(rows) - 4} in this run's" in said["fewer rows"]
    assert "skips the batches of the checkpoint's 2 steps" in said["fewer rows"]
    assert "data." not in said["other rows"].split("other training data")[0]  # not also in the settings list


def test_resume_from_an_incomplete_folder_says_which_one_to_use(tmp_path):
    good, bad = tmp_path / "checkpoint-2", tmp_path / "checkpoint-4"
    good.mkdir()
    (good / "trainer_state.json").write_text("{}")
    bad.mkdir()
    (bad / MARKER_NAME).write_text('{"complete": false}')
    assert resolve_resume(True, str(tmp_path)) == str(good)
    with pytest.raises(ValueError, match=r"checkpoint-4.*incomplete.*newest complete checkpoint beside it is .*"
                                         r"checkpoint-2"):
        resolve_resume(str(bad), str(tmp_path))
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_resume(True, str(tmp_path / "empty"))


def test_resume_refuses_a_model_only_checkpoint_and_another_model_set_up(tmp_path, rows, tokenizer):
    # save_only_model=True keeps no optimizer, scheduler or RNG state: transformers resumed from it with
    # a fresh optimizer and a restarted schedule without a word (the weights drifted 6% off the run's)
    out = tmp_path / "model-only"
    sft_trainer(out, rows, tokenizer, max_steps=2, save_strategy="steps", save_steps=1, save_only_model=True).train()
    with pytest.raises(ConfigError, match=r"cannot resume from .*checkpoint-2: it was saved with save_only_model="):
        sft_trainer(out, rows, tokenizer).train(resume_from_checkpoint=True)
    # another LoRA rank, or full fine-tuning: the checkpoint's tensors do not fit (a size mismatch deep in
    # PEFT's loading, or "Can't find a checkpoint index") -> one error naming what differs, before loading
    out = tmp_path / "lora"
    sft_trainer(out, rows, tokenizer, max_steps=1, save_strategy="steps", save_steps=1).train()
    with pytest.raises(ConfigError, match=r"another model set-up .*model\.trainable_parameters: checkpoint \d+"):
        sft_trainer(out, rows, tokenizer, model=builtin_qwen3(True, 1, r=8)).train(resume_from_checkpoint=True)
    with pytest.raises(ConfigError, match=r"model\.lora: checkpoint True, this run False"):
        sft_trainer(out, rows, tokenizer, model=tiny_model(lora=False)).train(resume_from_checkpoint=True)
    assert not (out / LOCK_NAME).exists()
    resumed = sft_trainer(out, rows, tokenizer, max_steps=2)  # the same set-up resumes
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2


def test_a_kill_while_rotating_or_publishing_leaves_checkpoints_complete_or_absent(tmp_path, rows, tokenizer,
                                                                                   monkeypatch):
    out = tmp_path / "run"
    removed_in_place = shutil.rmtree

    def killed_while_deleting(path, *args, **kwargs):  # the run dies with checkpoint-1 half deleted
        if os.path.basename(path).endswith("checkpoint-1") and os.path.exists(os.path.join(path, "trainer_state.json")):
            for name in ("adapter_model.safetensors", "optimizer.pt"):
                os.remove(os.path.join(path, name))
            raise KeyboardInterrupt("killed")
        return removed_in_place(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        sft_trainer(out, rows, tokenizer, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1).train()
    monkeypatch.undo()
    # rotation used to delete checkpoint-1 in place: its marker and trainer_state.json outlived its weights
    for name in checkpoint_folders(out):
        assert checkpoint_problem(str(out / name)) is None and (out / name / "adapter_model.safetensors").exists(), name

    def resume(steps):
        trainer = sft_trainer(out, rows, tokenizer, max_steps=steps, save_strategy="steps", save_steps=1,
                              save_total_limit=1)
        trainer.train(resume_from_checkpoint=True)
        assert trainer.state.global_step == steps
        assert checkpoint_folders(out) == [f"checkpoint-{steps}"]
        assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]

    resume(3)
    # killed after the marker, before the rename: the complete staged checkpoint is published, not removed
    os.makedirs(out / f"{STAGING_PREFIX}checkpoint-3")
    os.replace(out / "checkpoint-3", out / f"{STAGING_PREFIX}checkpoint-3" / "checkpoint-3")
    resume(4)
    # killed between publish's two renames (the old checkpoint-4 aside, the new one not complete): it goes back
    os.replace(out / "checkpoint-4", out / f"{STAGING_PREFIX}replaced-checkpoint-4")
    os.makedirs(out / f"{STAGING_PREFIX}checkpoint-4" / "checkpoint-4")
    resume(5)


def test_a_finished_run_resumed_again_trains_nothing_more(tmp_path, rows, tokenizer):
    out = tmp_path / "run"
    model = tiny_model()
    sft_trainer(out, rows, tokenizer, model=model, max_steps=2, save_strategy="steps", save_steps=1).train()
    done = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    again = tiny_model(lora_seed=5)
    trainer = sft_trainer(out, rows, tokenizer, model=again, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train(resume_from_checkpoint=True)  # transformers' loop trained step 3 of 2 and saved checkpoint-3
    assert trainer.state.global_step == 2 and checkpoint_folders(out) == ["checkpoint-1", "checkpoint-2"]
    assert steps_in(out / "metrics.jsonl") == [1, 2]
    for n, p in again.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, done[n]), n


@pytest.mark.parametrize("failure", ["enospc", "torch-writer"])
def test_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(tmp_path, rows, tokenizer,
                                                                           monkeypatch, failure):
    out = tmp_path / "run"
    trainer = sft_trainer(out, rows, tokenizer, save_strategy="steps", save_steps=2)
    original = trainer._save_optimizer_and_scheduler

    def failing_save(output_dir):
        if trainer.state.global_step == 4:
            if failure == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 601792 vs 601680")
        original(output_dir)

    monkeypatch.setattr(trainer, "_save_optimizer_and_scheduler", failing_save)
    with pytest.raises(CheckpointSaveError) as info:
        trainer.train()
    message = str(info.value)
    assert str(out / "checkpoint-4") in message and str(out / "checkpoint-2") in message
    assert ("the disk is full" in message) if failure == "enospc" else ("unexpected pos" in message)
    assert checkpoint_folders(out) == ["checkpoint-2"]
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]  # the partial save is gone
    assert newest_complete_checkpoint(str(out))[0] == str(out / "checkpoint-2")
    if failure == "enospc":  # the previous checkpoint resumes
        resumed = sft_trainer(out, rows, tokenizer)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 4


# ------------------------------------------------------------------------------------ lock


def _write_lock(out, pid):
    out.mkdir(parents=True, exist_ok=True)
    import socket

    (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "earlier"}))


def test_second_run_into_the_same_output_dir_is_refused(tmp_path, rows, tokenizer):
    out = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(out, other.pid)
        (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        trainer = sft_trainer(out, rows, tokenizer)
        with pytest.raises(RunLockedError, match=rf"another run \(pid {other.pid} on .*Choose another output_dir"):
            trainer.train()
        assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'  # nothing touched
    finally:
        other.kill()
        other.wait()


def test_lock_is_exclusive_across_processes_and_a_dead_owners_lock_is_taken_over(tmp_path, rows, tokenizer,
                                                                                caplog):
    out = tmp_path / "run"
    module = os.path.join(os.path.dirname(__file__), "..", "src", "swiftune", "training", "run_lock.py")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import importlib.util, sys, time\n"
         f"spec = importlib.util.spec_from_file_location('run_lock', {module!r})\n"
         "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
         f"m.RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            RunLock(str(out)).acquire()
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: the next run takes the lock over, and frees it at the end
    seen = []
    trainer = sft_trainer(out, rows, tokenizer, max_steps=1, callbacks=[AtStep(
        1, lambda m: seen.append(json.load(open(out / LOCK_NAME))["pid"]))])
    with caplog.at_level(logging.WARNING, logger="swiftune"):
        trainer.train()
    assert "stale lock" in caplog.text and f"pid {holder.pid}" in caplog.text
    assert seen == [os.getpid()] and not (out / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------ Ctrl-C


def ctrl_c(times=1):
    def send(model):
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
    return send


def test_ctrl_c_saves_the_step_and_resumes_to_the_same_weights(tmp_path, rows, tokenizer):
    full = tiny_model()
    sft_trainer(tmp_path / "full", rows, tokenizer, model=full, max_steps=5).train()

    out = tmp_path / "run"
    trainer = sft_trainer(out, rows, tokenizer, max_steps=5, callbacks=[AtStep(3, ctrl_c())])
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match=r"Ctrl-C after step 3 of 5: saved .*checkpoint-3\. Resume with "
                                                  r"trainer\.train\(resume_from_checkpoint=True\)") as info:
        trainer.train()
    assert info.value.checkpoint == str(out / "checkpoint-3") and isinstance(info.value, KeyboardInterrupt)
    assert checkpoint_folders(out) == ["checkpoint-3"]  # saved although save_strategy="no"
    assert signal.getsignal(signal.SIGINT) is handler  # the SIGINT handler given back

    model = tiny_model(lora_seed=5)  # other adapters: the trained state must come from the checkpoint
    sft_trainer(out, rows, tokenizer, model=model, max_steps=5).train(resume_from_checkpoint=True)
    want = dict(full.named_parameters())
    for n, p in model.named_parameters():
        assert rel_err(p, want[n]) < 1e-5, n
    assert steps_in(out / "metrics.jsonl") == [1, 2, 3, 4, 5]


def test_sigterm_with_enable_jit_checkpoint_saves_the_step_and_says_so(tmp_path, rows, tokenizer):
    # transformers' JIT handler saved before the optimizer step, trained the step on and ended train() as if
    # the run had finished: the command exited 0 with a model of step 3 of 5 and a checkpoint of step 2
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    trainer = sft_trainer(out, rows, tokenizer, max_steps=5, enable_jit_checkpoint=True,
                          callbacks=[AtStep(2, lambda m: os.kill(os.getpid(), signal.SIGTERM))])
    with pytest.raises(TrainingInterrupted, match=r"stopped by SIGTERM after step 2 of 5: saved .*checkpoint-2\."):
        trainer.train()
    assert checkpoint_folders(out) == ["checkpoint-2"] and trainer.state.global_step == 2
    assert signal.getsignal(signal.SIGTERM) == before


def test_second_ctrl_c_stops_at_once_without_saving(tmp_path, rows, tokenizer):
    out = tmp_path / "run"
    trainer = sft_trainer(out, rows, tokenizer, callbacks=[AtStep(2, ctrl_c(times=2))])
    with pytest.raises(KeyboardInterrupt) as info:
        trainer.train()
    assert not isinstance(info.value, TrainingInterrupted)
    assert not [n for n in os.listdir(out) if n.startswith(("checkpoint-", STAGING_PREFIX))]
    assert not (out / LOCK_NAME).exists()


def test_the_summary_of_a_resumed_run_counts_its_own_steps():
    from types import SimpleNamespace

    from swiftune.training.metrics import run_summary

    state = SimpleNamespace(global_step=6)
    assert run_summary(state, {"train_runtime": 2.0}, {}, 100).startswith("swiftune: trained 6 steps in 2.0 s")
    line = run_summary(state, {"train_runtime": 2.0}, {}, 100, first_step=4)
    assert line.startswith("swiftune: trained 2 steps (steps 5-6, resumed) in 2.0 s") and "50 tokens/s" in line
    state.max_steps = 6
    line = run_summary(state, {"train_runtime": 0.0, "train_loss": 0.0}, {}, 0, first_step=6)
    assert line == "swiftune: nothing to train: the checkpoint is at step 6, the run's last (max_steps 6); the model is " \
                   "the checkpoint's"


class _TokenizerKilledWhileSaving:
    """A tokenizer whose save fails: the final save stops after the weights were written (a kill, a full disk)."""

    def save_pretrained(self, save_directory, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_the_final_save_is_complete_or_leaves_the_earlier_files(tmp_path, rows, tokenizer):
    """The commands' final save (swiftune.cli.runs.save_final_model) writes into a hidden folder and moves the
    files in when complete: a save cut short leaves a reused output_dir's earlier model as it was (not new
    weights beside the old config); the next run's start removes the leftover; a complete save replaces the
    earlier files and holds exactly the trained adapter."""
    from peft import get_peft_model_state_dict

    from swiftune.cli.runs import save_final_model

    out = tmp_path / "run"
    first = sft_trainer(out, rows, tokenizer, max_steps=1)
    first.train()
    save_final_model(first, tokenizer, str(out))
    saved = {n: (out / n).read_bytes() for n in os.listdir(out) if (out / n).is_file() and n != "metrics.jsonl"}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json"} <= set(saved)
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]

    second = sft_trainer(out, rows, tokenizer, model=tiny_model(lora_seed=7), max_steps=1, learning_rate=5e-3)
    second.train()
    with pytest.raises(OSError, match="No space left"):
        save_final_model(second, _TokenizerKilledWhileSaving(), str(out))
    for name, data in saved.items():  # the earlier model, untouched
        assert (out / name).read_bytes() == data, name
    leftover = [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
    assert leftover and "adapter_model.safetensors" in os.listdir(out / leftover[0])  # the cut-short save

    third = sft_trainer(out, rows, tokenizer, model=tiny_model(lora_seed=9), max_steps=1)
    third.train()  # its start removes the leftover
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
    save_final_model(third, tokenizer, str(out))
    weights = load_file(str(out / "adapter_model.safetensors"))
    expected = get_peft_model_state_dict(third.model)
    assert weights.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(weights[key], tensor.detach().cpu()), key
    assert weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].ne(
        load_file_bytes(saved["adapter_model.safetensors"])["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    ).any()
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]


def test_moving_the_final_save_in_replaces_files_and_folders_of_the_same_name(tmp_path):
    """training.checkpoints.move_saved_files: a file and a folder (PEFT saves a named adapter in a subfolder) of an
    earlier save are replaced, other files of output_dir are left alone, and the staging folder is gone."""
    from swiftune.training.checkpoints import final_staging_dir, move_saved_files

    out = tmp_path / "run"
    (out / "second_adapter").mkdir(parents=True)
    (out / "second_adapter" / "stale.safetensors").write_text("old")
    (out / "adapter_config.json").write_text("old")
    (out / "metrics.jsonl").write_text("kept")
    staged = final_staging_dir(str(out))
    os.makedirs(os.path.join(staged, "second_adapter"))
    with open(os.path.join(staged, "second_adapter", "adapter_model.safetensors"), "w") as f:
        f.write("new")
    with open(os.path.join(staged, "adapter_config.json"), "w") as f:
        f.write("new")
    assert move_saved_files(staged, str(out)) == ["adapter_config.json", "second_adapter"]
    assert (out / "adapter_config.json").read_text() == "new" and (out / "metrics.jsonl").read_text() == "kept"
    assert os.listdir(out / "second_adapter") == ["adapter_model.safetensors"]
    assert not os.path.exists(staged) and not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]


def test_a_fresh_run_into_an_output_dir_with_an_earlier_runs_checkpoints_says_what_happens_to_them(
        tmp_path, rows, tokenizer, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="swiftune"):
        sft_trainer(out, rows, tokenizer, max_steps=4, save_strategy="steps", save_steps=2).train()
    assert "earlier run" not in caplog.text  # an empty output_dir: nothing to say
    assert checkpoint_folders(out) == ["checkpoint-2", "checkpoint-4"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swiftune"):
        sft_trainer(out, rows, tokenizer, max_steps=2, save_strategy="steps", save_steps=2,
                    save_total_limit=1).train()
    said = caplog.text
    assert "already holds checkpoints of an earlier run (checkpoint-4, checkpoint-2)" in said
    assert "save_total_limit=1" in said and "--resume_from_checkpoint true" in said
    # what it said happened: this run's checkpoint-2 replaced the earlier one, the rotation removed checkpoint-4
    assert checkpoint_folders(out) == ["checkpoint-2"]
    assert json.load(open(out / "checkpoint-2" / MARKER_NAME))["step"] == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swiftune"):  # resuming is continuing: no warning
        sft_trainer(out, rows, tokenizer, max_steps=4, save_strategy="steps", save_steps=2).train(
            resume_from_checkpoint=True)
    assert "earlier run" not in caplog.text


def test_rotation_orders_checkpoints_by_their_markers_write_time_not_by_step(tmp_path):
    from swiftune.training.checkpoints import checkpoints_oldest_first, rotate_checkpoints, write_marker

    for step, when in ((9, None), (2, 300.0), (4, 100.0), (8, 200.0)):  # checkpoint-9: no marker (cut short)
        (tmp_path / f"checkpoint-{step}").mkdir()
        if when is not None:
            write_marker(str(tmp_path / f"checkpoint-{step}"), step, {})
            marker = json.load(open(tmp_path / f"checkpoint-{step}" / MARKER_NAME))
            (tmp_path / f"checkpoint-{step}" / MARKER_NAME).write_text(json.dumps({**marker, "time": when}))
    assert [os.path.basename(p) for p in checkpoints_oldest_first(str(tmp_path))] == [
        "checkpoint-9", "checkpoint-4", "checkpoint-8", "checkpoint-2"]
    rotate_checkpoints(str(tmp_path), 2, str(tmp_path / "checkpoint-4"))  # the best one is kept too
    assert checkpoint_folders(tmp_path) == ["checkpoint-2", "checkpoint-4"]
