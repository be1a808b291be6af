"""Data-parallel training under torchrun (CPU, gloo): 2 processes of batch B take the same SGD step
as 1 process of batch 2B, for SFT (loss normalised by the global token count) and GRPO (dapo: global
token count; grpo: mean over all sequences), with batch-scaled rewards gathered across processes.

Each run is a real ``torch.distributed.run`` launch of tests/distributed_worker.py. FSDP2 is checked
at the loss level (accelerate does not shard on CPU): sharded gradients == unsharded gradients.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "distributed_worker.py")


def launch(tmp_path, name: str, nproc: int, *args: str) -> dict:
    out = tmp_path / name
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER,
           "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = torch.load(out / "result.pt")
    assert result["world_size"] == nproc
    return result


def assert_same_step(one: dict, two: dict, tol: float = 1e-4) -> None:
    assert one["deltas"].keys() == two["deltas"].keys()
    moved = sum(float(d.abs().sum()) for d in one["deltas"].values())
    assert moved > 0  # the step did something
    for key in one["deltas"]:
        assert rel_err(two["deltas"][key], one["deltas"][key]) < tol, key


def test_sft_two_processes_equal_one_big_batch(tmp_path):
    one = launch(tmp_path, "one", 1, "--mode", "sft", "--batch", "8")
    two = launch(tmp_path, "two", 2, "--mode", "sft", "--batch", "4")
    assert len(one["losses"]) == len(two["losses"]) == 2
    for a, b in zip(two["losses"], one["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b), (two["losses"], one["losses"])
    assert_same_step(one, two)
    # the logged token counts are the whole step's, every process's (they were rank 0's share)
    assert two["tokens"] == one["tokens"] and all(t > 0 for t in one["tokens"])


def test_fsdp2_sharded_sft_loss_gradients_equal_unsharded(tmp_path):
    """FSDP2 (``fully_shard`` per decoder layer + root): the fused loss reads the LM head after the
    model's forward; the gradients of 2 sharded processes equal one unsharded pass over the batch."""
    from swiftune.sft.trainer import sft_loss
    from tests.distributed_worker import fixed_batch, plain_model

    two = launch(tmp_path, "two", 2, "--mode", "fsdp2_loss")
    assert two["sharded"]
    ids, labels = fixed_batch()
    model = plain_model()
    loss, _ = sft_loss(model, {"input_ids": ids}, labels, num_items_in_batch=int((labels[:, 1:] != -100).sum()))
    loss.backward()
    assert abs(two["loss"] - loss.item()) <= 1e-5 * loss.item()
    for name, p in model.named_parameters():
        assert rel_err(two["grads"][name], p.grad) < 1e-4, name


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_grpo_two_processes_equal_one_big_batch(tmp_path, loss_type):
    one = launch(tmp_path, "one", 1, "--mode", "grpo", "--batch", "16", "--loss-type", loss_type)
    two = launch(tmp_path, "two", 2, "--mode", "grpo", "--batch", "8", "--loss-type", loss_type)
    assert_same_step(one, two)
    # evaluation of 5 held-out prompts (3 on one process, 2 on the other) == one process's
    for key in ("eval_reward", "eval_reward_std", "eval_completion_length", "eval_rewards/length_reward/mean"):
        assert two["eval"][key] == pytest.approx(one["eval"][key], rel=1e-6), key
