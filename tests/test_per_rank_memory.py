"""Per-rank memory accounting of offloaded checkpointing when several processes share one host.

* Pinned host memory: every rank of a job pins its own offloaded layer inputs, so each rank's
  budget is its share of the host's free memory (``(MemAvailable - margin) // LOCAL_WORLD_SIZE``),
  and ``plan_memory`` / ``swiftune plan --world_size N`` plan each rank with the same share.
* Pending gradients of the GPU reserve: under FSDP2 a parameter is a DTensor whose ``numel()`` is
  the whole tensor's; a rank allocates only its shard's gradient.

The two-process checks run under ``torchrun`` (CPU, gloo): this file is also the worker
(``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/test_per_rank_memory.py
--out DIR``), each rank saving what it measured for the test to check against formulas written
out here: the host's ``MemAvailable`` read from ``/proc/meminfo``, and FSDP2's row split of each
parameter (``torch.chunk`` over dim 0) from the parameter's global shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPROC = 2
ODD_VOCAB = 321  # embedding rows that do not split evenly over 2 ranks: 161 + 160


def meminfo_available() -> int:
    """The kernel's own figure, read without swiftune: ``MemAvailable`` in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("/proc/meminfo has no MemAvailable line")


def bracketed_share(budget_of, ranks: int, attempts: int = 5) -> tuple[int, int, int]:
    """``(before, budget, after)`` where ``budget_of()`` was read between two ``MemAvailable``
    readings and lies within their shares (other processes change free memory between reads: a few
    attempts until one is bracketed; the last attempt is returned either way, for the assert)."""
    for _ in range(attempts):
        before = meminfo_available()
        budget = budget_of()
        after = meminfo_available()
        if min(before, after) // ranks <= budget <= max(before, after) // ranks:
            break
    return before, budget, after


def shard_rows(rows: int, rank: int, world: int) -> int:
    """Rows of dim 0 that FSDP2 gives ``rank``: ``torch.chunk`` semantics (ceil-sized chunks, the
    last ones short or empty)."""
    chunk = -(-rows // world)
    return max(0, min(rows, (rank + 1) * chunk) - rank * chunk)


# --------------------------------------------------------------------------- the worker


def worker(out_dir: str, cuda: bool) -> None:
    """One rank: its host budget and local world, then the pending gradient bytes of an FSDP2 model
    (``cuda``: on this rank's GPU, NCCL; else CPU, gloo)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from swiftune.data import tiny_model_config
    from swiftune.memory import step_reserve
    from swiftune.training.checkpointing import OffloadState, _setup_of, decoder_layers
    from swiftune.training.offload_memory import host_available_bytes, local_world_size

    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # torchrun's: this rank's GPU
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank, "world_size": dist.get_world_size(), "local_world_size": local_world_size()}
    result["host"] = bracketed_share(lambda: host_available_bytes(margin_bytes=0), result["local_world_size"])
    launcher = os.environ.pop("LOCAL_WORLD_SIZE")  # without the launcher's figure: the process group's
    result["local_world_size_from_group"] = local_world_size()
    os.environ["LOCAL_WORLD_SIZE"] = launcher

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3", vocab_size=ODD_VOCAB), dtype=torch.float32)
    model.to(device)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)  # frozen: allocates no gradient
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = OffloadState(model, decoder_layers(model), None, None, 2**26, None)
    x = torch.zeros(1, 64, model.config.hidden_size, device=device)
    result["pending"] = state.pending_grad_bytes(x.device)
    result["reserve_minus_activations"] = state._reserve(x) - step_reserve(model.config, 64, _setup_of(model, x), 0)
    result["device"] = str(x.device)
    result["params"] = [(name, tuple(p.shape), p.requires_grad, type(p).__name__, p.element_size())
                        for name, p in model.named_parameters()]
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- two ranks


def launch(out, cuda: bool) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), "OMP_NUM_THREADS": "1"}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           os.path.abspath(__file__), "--out", str(out), *(["--cuda"] if cuda else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [torch.load(out / f"rank{r}.pt") for r in range(NPROC)]
    assert [r["device"] for r in results] == ([f"cuda:{r}" for r in range(NPROC)] if cuda else ["cpu"] * NPROC)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("per-rank"), cuda=False)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads the host's MemAvailable from /proc/meminfo")
def test_each_rank_budgets_its_share_of_the_host(ranks):
    """Each of the 2 ranks on this host may pin (MemAvailable - margin) / 2, not all of it: the
    two budgets together stay within what the host has."""
    assert_host_shares(ranks)


def assert_host_shares(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["world_size"] == NPROC and r["local_world_size"] == NPROC
        assert r["local_world_size_from_group"] == NPROC
        before, budget, after = r["host"]
        assert min(before, after) // NPROC <= budget <= max(before, after) // NPROC, r["host"]
        assert budget > 0
    assert sum(r["host"][1] for r in ranks) <= max(max(r["host"][0], r["host"][2]) for r in ranks)


def test_fsdp2_pending_gradients_count_the_local_shard(ranks):
    """The GPU reserve's pending gradients under FSDP2 are this rank's shard of each trainable
    parameter (rows split over the ranks as torch.chunk splits them), not the whole parameter."""
    assert_local_shard_pending(ranks)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < NPROC
                    or not os.path.exists("/proc/meminfo"), reason="needs 2 CUDA GPUs (NCCL) and /proc/meminfo")
def test_two_gpus_budget_host_shares_and_count_local_shards(tmp_path):
    """The same two checks on 2 GPUs of one host (NCCL, FSDP2 parameters on each rank's GPU)."""
    results = launch(tmp_path, cuda=True)
    assert_host_shares(results)
    assert_local_shard_pending(results)


def assert_local_shard_pending(ranks: list[dict]) -> None:
    whole = 0
    for r in ranks:
        params = r["params"]
        assert params and all(kind == "DTensor" for _, _, _, kind, _ in params)  # sharded by fully_shard
        assert any(not trained for _, _, trained, _, _ in params)
        assert any(shape[0] == ODD_VOCAB for _, shape, _, _, _ in params)  # an uneven split is exercised
        want = sum(shard_rows(shape[0], r["rank"], NPROC) * math.prod(shape[1:]) * size
                   for _, shape, trained, _, size in params if trained)
        whole = sum(math.prod(shape) * size for _, shape, trained, _, size in params if trained)
        assert r["pending"] == want > 0
        assert r["reserve_minus_activations"] == want  # what _reserve adds to the step's activations
        assert r["pending"] < whole  # the whole parameters' bytes, which were counted before
    assert sum(r["pending"] for r in ranks) == whole  # the shards partition the trainable bytes


# --------------------------------------------------------------------------- one process


def test_host_budget_divides_by_the_ranks_on_the_host():
    from swiftune.training.offload_memory import host_available_bytes

    for ranks_on_host in (1, 3):
        before, budget, after = bracketed_share(lambda: host_available_bytes(0, ranks_on_host), ranks_on_host)
        assert min(before, after) // ranks_on_host <= budget <= max(before, after) // ranks_on_host
    with pytest.raises(ValueError, match="ranks_on_host must be a whole number"):
        host_available_bytes(0, 0)


def test_local_world_size_reads_the_launcher(monkeypatch):
    from swiftune.training.offload_memory import local_world_size

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_world_size() == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_world_size() == 1  # no launcher, no process group: this process alone
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two' is not a number"):
        local_world_size()


def test_planner_plans_each_rank_with_its_share_of_the_host():
    """All 36 layer inputs offloaded (no GPU budget): the host holds them for one rank; shared by
    2 ranks (one host) each rank's share holds fewer, so inputs are derived; on 2 hosts (1 rank
    each) each rank has the whole host again."""
    from swiftune.memory import plan_memory
    from swiftune.memory.planner import pinned_slot_bytes
    from swiftune.memory.shapes import model_shape

    tokens, shape = 8192, model_shape("qwen3-8b")
    need = shape.layers * pinned_slot_bytes(tokens * shape.hidden * 2)
    host = need * 3 // 2
    one = plan_memory("qwen3-8b", tokens, gradient_checkpointing="offload", host_bytes=host)
    shared = plan_memory("qwen3-8b", tokens, gradient_checkpointing="offload", host_bytes=host, world_size=2)
    two_hosts = plan_memory("qwen3-8b", tokens, gradient_checkpointing="offload", host_bytes=host, world_size=2,
                            ranks_per_host=1)
    assert one.host_limit == two_hosts.host_limit == host and one.host_bytes == need and not one.derived_layers
    assert shared.host_limit == host // 2 and shared.ranks_per_host == 2
    assert shared.derived_layers > 0 and 0 < shared.host_bytes <= host // 2
    assert two_hosts.host_bytes == need and not two_hosts.derived_layers
    assert "over 2 ranks" in shared.table() and "over" not in one.table().split("pinned host memory")[1]
    with pytest.raises(ValueError, match="ranks_per_host must be a whole number >= 1 that divides world_size"):
        plan_memory("qwen3-8b", tokens, world_size=4, ranks_per_host=3)


def test_swiftune_plan_host_gb_is_the_hosts(capsys):
    from swiftune.cli.plan import main_plan

    assert main_plan(["--model", "qwen3-0.6b", "--tokens", "65536", "--gradient_checkpointing", "offload",
                      "--gpu_gb", "20", "--host_gb", "3", "--world_size", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["host_limit"] == int(3e9) // 2 and plan["ranks_per_host"] == 2
    assert main_plan(["--model", "qwen3-0.6b", "--world_size", "4", "--ranks_per_host", "3"]) == 2
    assert "divides world_size" in capsys.readouterr().err


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one rank of tests/test_per_rank_memory.py (under torchrun)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cuda", action="store_true", help="each rank on its GPU (NCCL); default CPU (gloo)")
    cli = parser.parse_args()
    worker(cli.out, cli.cuda)
