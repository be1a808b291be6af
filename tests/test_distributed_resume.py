"""Checkpoints across world sizes (CPU, gloo): saved by 2 processes, resumed on 1, and the reverse.

What "equal" means when the number of processes changes: the global batch (per-device batch x
processes x accumulation) stays the same, and the Trainer's sample order is one global order
(seeded by epoch) of which accelerate hands each process its per-device batches in turn, so a run of
N processes and one of M take the same optimizer steps on the same samples. A resumed run skips
``global_step x accumulation`` batches of its own loader, i.e. the same samples when the global
batch is the same. So: the run resumed on M processes from a checkpoint of N must log the same
losses for the remaining steps, and end with the same weights, as an uninterrupted run on M
processes (fp32; only the reduction order differs). The negative control (another global batch
after the resume) shows the comparison can fail.

Runs: one 1-process SFT in this process writes the checkpoint the 2-process launch resumes; one
2-process launch (uninterrupted SFT with LoRA under DDP, AdamW, linear schedule, clipping; the
1-process resume; GRPO; FSDP2 shard sizes) and one 1-process launch (the uninterrupted references
and the resumes of the 2-process checkpoints). The memory planner's per-rank arithmetic is checked
against the FSDP2 shard sizes and DDP's gradient buckets measured there.

FSDP2 through the Trainer runs on CUDA only (accelerate enables FSDP for GPU back-ends only):
``test_fsdp2_checkpoints_resume_across_world_sizes`` (2 GPUs) resumes accelerate's sharded
checkpoints (torch.distributed.checkpoint folders, resharded on load) from 2 GPUs on 1 and back.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "distributed_worker.py")


def launch(root, nproc: int, phase: int, gpus: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), "OMP_NUM_THREADS": "1"}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER,
           "--mode", "resume", "--phase", str(phase), "--out", str(root)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = torch.load(root / f"phase{phase}.pt")
    assert result["world_size"] == nproc
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.distributed_worker import resumable_sft

    root = tmp_path_factory.mktemp("resume")
    alive: list = []
    seed = resumable_sft(str(root / "sft-seed"), None, alive, launched=False)  # the 1-process checkpoint, in this process
    two = launch(root, 2, 2)
    one = launch(root, 1, 1)
    return {"seed": seed, "two": two, "one": one, "root": root}


def assert_resumed_equals(resumed: dict, reference: dict, resumed_steps: int, tol: float = 1e-5) -> None:
    """The resumed run logs the reference's last ``resumed_steps`` losses and ends with its weights."""
    assert resumed["steps"] == reference["steps"]
    assert len(resumed["losses"]) == resumed_steps, resumed["losses"]
    for got, want in zip(resumed["losses"], reference["losses"][-resumed_steps:]):
        assert abs(got - want) <= tol * abs(want), (resumed["losses"], reference["losses"])
    assert resumed["weights"].keys() == reference["weights"].keys() and resumed["weights"]
    for name, want in reference["weights"].items():
        assert rel_err(resumed["weights"][name], want) < tol, name


def test_uninterrupted_runs_agree_across_world_sizes(runs):
    """The premise: 1 and 2 processes with the same global batch train the same run (4 steps, AdamW)."""
    from tests.distributed_worker import SFT_STEPS

    one, two, seed = runs["one"]["sft"], runs["two"]["sft"], runs["seed"]
    assert len(one["losses"]) == SFT_STEPS
    assert_resumed_equals(two, one, SFT_STEPS)
    assert_resumed_equals(seed, one, SFT_STEPS)  # in this process == under torchrun on 1 process
    assert runs["two"]["sft"]["ddp"] is not None  # the 2-process run is DDP


def test_sft_lora_checkpoint_of_two_processes_resumes_on_one(runs):
    from tests.distributed_worker import SFT_SAVE_AT, SFT_STEPS

    resumed = runs["one"]["sft_from_2"]
    assert_resumed_equals(resumed, runs["one"]["sft"], SFT_STEPS - SFT_SAVE_AT)
    # the same global batch: not warned about, and said so at info level
    assert "global batch is the same (8)" in resumed["warnings"]
    assert "written with other settings" not in resumed["warnings"]


def test_sft_lora_checkpoint_of_one_process_resumes_on_two(runs):
    from tests.distributed_worker import SFT_SAVE_AT, SFT_STEPS

    resumed = runs["two"]["sft_from_1"]
    assert_resumed_equals(resumed, runs["two"]["sft"], SFT_STEPS - SFT_SAVE_AT)
    assert "written by 1 process(es), resumed on 2: the global batch is the same" in resumed["warnings"]


def test_another_global_batch_after_resume_is_warned_and_differs(runs):
    """The negative control: 1 process of batch 4 from the 2 x 4 checkpoint skips 2 batches of 4
    (not 8 samples), so its losses are not the reference's; the warning says what to set."""
    reference = runs["one"]["sft"]
    resumed = runs["one"]["sft_from_2_half_batch"]
    assert len(resumed["losses"]) == 2
    assert all(abs(a - b) > 1e-3 * abs(b) for a, b in zip(resumed["losses"], reference["losses"][-2:]))
    assert "does not continue at the sample where the checkpoint stopped" in resumed["warnings"]
    assert "set per_device_train_batch_size = 8 / (1 processes x 1 accumulation steps)" in resumed["warnings"]


def test_grpo_checkpoint_of_two_processes_resumes_on_one(runs):
    """GRPO (dapo, KL, batch-scaled rewards, the deterministic engine: a sampling engine seeded
    ``seed + rank`` draws other completions on another number of processes) resumed at a generation
    boundary: the second step's loss and the final LoRA weights equal the uninterrupted 1-process run's."""
    from tests.distributed_worker import GRPO_SAVE_AT, GRPO_STEPS

    assert_resumed_equals(runs["two"]["grpo"], runs["one"]["grpo"], GRPO_STEPS)
    assert_resumed_equals(runs["one"]["grpo_from_2"], runs["one"]["grpo"], GRPO_STEPS - GRPO_SAVE_AT)
    # every process saved its own rollout buffer, recording the world size
    checkpoint = runs["root"] / "grpo-2" / f"checkpoint-{GRPO_SAVE_AT}"
    assert {p.name for p in checkpoint.glob("rollouts-rank*.safetensors")} == {
        "rollouts-rank0.safetensors", "rollouts-rank1.safetensors"}


def test_grpo_checkpoint_between_steps_of_a_generation_resumes_on_one(runs):
    """``steps_per_generation=2``: the 2-process checkpoint after step 1 holds each process's half of
    the generation; resumed on 1 process it is not replayed (warned about) but sampled again, and
    the run finishes its 2 steps (uninterrupted: one generation for both steps)."""
    uninterrupted, resumed = runs["two"]["grpo_mid"], runs["one"]["grpo_mid_from_2"]
    assert uninterrupted["generations"] == 1 and uninterrupted["steps"] == 2 and len(uninterrupted["losses"]) == 2
    assert "saved by 2 process(es) and this run has 1" in resumed["warnings"]
    assert resumed["generations"] == 1 and resumed["steps"] == 2 and len(resumed["losses"]) == 1
    assert all(torch.isfinite(w).all() for w in resumed["weights"].values())


def test_rollout_buffer_of_another_world_size_is_dropped_with_a_warning(tmp_path, caplog):
    """A 2-process buffer (each rank's share of one global generation) is not replayed on 1 process:
    the micro-step counter comes back, the buffer does not (that generation is sampled again)."""
    from swiftune.rl.checkpoint import load_rollout_state, save_rollout_state

    buffer = [{"old_logps": torch.arange(6, dtype=torch.float32)}]
    save_rollout_state(str(tmp_path), 0, 3, buffer, world_size=2)
    micro_step, same = load_rollout_state(str(tmp_path), 0, "cpu", world_size=2)
    assert micro_step == 3 and torch.equal(same[0]["old_logps"], buffer[0]["old_logps"])
    with caplog.at_level(logging.WARNING, logger="swiftune"):
        micro_step, dropped = load_rollout_state(str(tmp_path), 0, "cpu", world_size=1)
    assert micro_step == 3 and dropped is None
    assert "saved by 2 process(es) and this run has 1" in caplog.text


def test_planner_per_rank_matches_fsdp2_shards_and_ddp_buckets(runs):
    """``plan_memory(world_size=2, fsdp=True)``: the weights a rank holds == the largest FSDP2 shard
    measured (float32 full fine-tuning model, ``fully_shard`` per layer + root); without fsdp (DDP):
    replicated weights, and DDP's gradient buckets == the trainable gradients, as measured."""
    from swiftune.data import tiny_model_config
    from swiftune.memory import param_count, plan_memory
    from swiftune.memory.shapes import model_shape

    config = tiny_model_config("qwen3")
    shards = runs["two"]["fsdp2_shard_bytes"]
    full_bytes = param_count(model_shape(config)) * 4
    assert len(shards) == 2 and sum(shards) == full_bytes  # the shards partition the model
    sharded = plan_memory(config, 256, full_finetune=True, dtype_bytes=4, world_size=2, fsdp=True)
    one = plan_memory(config, 256, full_finetune=True, dtype_bytes=4)
    assert max(shards) <= sharded.weights <= max(shards) * 1.01
    assert sharded.gradients == sharded.weights and sharded.optimizer == -(-one.optimizer // 2)
    assert sharded.layer_working_set == one.layer_working_set and sharded.checkpoints == one.checkpoints
    assert sharded.distributed > 0 and sharded.allocated < one.allocated

    sft = runs["two"]["sft"]
    ddp = plan_memory(config, 256, lora_rank=8, dtype_bytes=4, lora_dtype_bytes=4, world_size=2)
    single = plan_memory(config, 256, lora_rank=8, dtype_bytes=4, lora_dtype_bytes=4)
    assert ddp.trainable_params == sft["trainable_parameters"]
    assert ddp.weights + ddp.trainable == single.weights + single.trainable == sft["parameter_bytes"]
    assert not sft["ddp"]["gradient_as_bucket_view"]
    assert ddp.distributed == sft["ddp"]["bucket_bytes"] == ddp.gradients
    assert single.distributed == 0 and ddp.allocated == single.allocated + ddp.gradients


def test_planner_world_size_errors():
    from swiftune.memory import plan_memory

    with pytest.raises(ValueError, match="world_size must be a whole number"):
        plan_memory("qwen3-0.6b", 1024, world_size=0)
    with pytest.raises(ValueError, match="fsdp=True with weight_quantization"):
        plan_memory("qwen3-0.6b", 1024, world_size=2, fsdp=True, weight_quantization="nf4")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp2_checkpoints_resume_across_world_sizes(tmp_path):
    """Full fine-tuning under accelerate's FSDP2 (float32): a checkpoint of 2 GPUs resumed on 1 GPU
    (1 process, still FSDP2) and one of 1 GPU resumed on 2 log the remaining losses and end with the
    weights of the uninterrupted run on the resumed number of GPUs."""
    from tests.distributed_worker import SFT_SAVE_AT, SFT_STEPS

    one = launch(tmp_path, 1, 3, gpus=True)
    two = launch(tmp_path, 2, 4, gpus=True)
    back = launch(tmp_path, 1, 5, gpus=True)
    assert two["fsdp"]["sharded"] and one["fsdp"]["sharded"]
    print("checkpoint files:", back["checkpoint_files"])
    assert_resumed_equals(two["fsdp"], one["fsdp"], SFT_STEPS, tol=1e-4)
    assert_resumed_equals(two["fsdp_from_1"], two["fsdp"], SFT_STEPS - SFT_SAVE_AT, tol=1e-4)
    assert_resumed_equals(back["fsdp_from_2"], one["fsdp"], SFT_STEPS - SFT_SAVE_AT, tol=1e-4)


def test_plan_command_world_size(capsys):
    """``swiftune plan --world_size 2 --fsdp`` prints the per-rank plan of ``plan_memory``; a bad
    world size is an error saying what to change."""
    import json

    from swiftune.cli.plan import main_plan
    from swiftune.memory import plan_memory

    assert main_plan(["--model", "qwen3-0.6b", "--tokens", "2048", "--full_finetune", "--world_size", "2", "--fsdp",
                      "--gpu_gb", "80", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["plan"]
    want = plan_memory("qwen3-0.6b", 2048, full_finetune=True, world_size=2, fsdp=True, gpu_bytes=int(80e9))
    assert printed["weights"] == want.weights and printed["distributed"] == want.distributed > 0
    assert printed["world_size"] == 2 and printed["fsdp"] is True
    assert main_plan(["--model", "qwen3-0.6b", "--world_size", "0"]) == 2
    assert "world_size must be a whole number of processes >= 1" in capsys.readouterr().err
