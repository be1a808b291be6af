"""One training run under ``torchrun`` (CPU, gloo) for tests/test_distributed.py.

    python -m torch.distributed.run --standalone --nproc_per_node N tests/distributed_worker.py \
        --mode sft|grpo --batch B --out deltas.pt

Every process trains the same tiny random model (same seeds) on its share of the data; rank 0
saves the change of every trainable parameter and the logged losses. The test compares N=2
processes of batch B against N=1 process of batch 2B: with the loss normalised by the global
token count (SFT, GRPO dapo) or the global sequence count (GRPO grpo), the two must take the
same SGD step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swiftune.data import build_tokenizer, builtin_instruction_dataset, tiny_model_config  # noqa: E402
from swiftune.training import FastModel  # noqa: E402

COMMON = dict(kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
              logging_steps=1, seed=1, data_seed=1, dataloader_pin_memory=False, disable_tqdm=True, optim="sgd",
              learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, use_cpu=True,
              ddp_backend="gloo")


def lora_model(seed: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"), dtype=torch.float32)
    torch.manual_seed(seed + 1)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    with torch.no_grad():  # PEFT starts B at zero: give it values so A has gradients too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


class LossLog(TrainerCallback):
    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (FSDP2 shards are DTensors)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def run(mode: str, batch: int, out_dir: str, loss_type: str):
    """One training run; returns the trainer (the caller keeps it alive until the process ends)."""
    tokenizer = build_tokenizer()
    model = lora_model(9)
    before = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    common = dict(COMMON)
    log = LossLog()
    if mode == "sft":
        from swiftune.sft import SFTConfig, SFTTrainer

        args = SFTConfig(output_dir=out_dir, max_steps=2, per_device_train_batch_size=batch, max_length=256,
                         **common)
        trainer = SFTTrainer(model=model, args=args, train_dataset=builtin_instruction_dataset(num_rows=16, seed=3),
                             processing_class=tokenizer, callbacks=[log])
    else:
        from swiftune.rl import GRPOConfig, GRPOTrainer
        from tests.test_grpo import PROMPT_ROWS, FixedEngine, length_reward

        args = GRPOConfig(output_dir=out_dir, max_steps=1, per_device_train_batch_size=batch, num_generations=8,
                          max_completion_length=16, loss_type=loss_type, beta=0.05, scale_rewards="batch",
                          metrics_file=None, plot_rewards=False, **common)
        trainer = GRPOTrainer(model, [length_reward], args=args, train_dataset=PROMPT_ROWS[:4],
                              processing_class=tokenizer, rollout_engine=FixedEngine(), callbacks=[log])
    trainer.train()
    evaluated = None
    if mode == "grpo":  # held-out prompts split over the processes, totals summed
        from tests.test_grpo import PROMPT_ROWS

        evaluated = trainer.evaluate(PROMPT_ROWS[3:8])
    after = {n: full(p) for n, p in trainer.model.named_parameters() if n in before}
    if trainer.accelerator.is_main_process:
        deltas = {n: after[n] - before[n] for n in before}
        torch.save({"deltas": deltas, "losses": log.losses, "world_size": trainer.accelerator.num_processes,
                    "eval": evaluated},
                   os.path.join(out_dir, "result.pt"))
    finish_process_group()
    return trainer


def fsdp2_loss_gradients(out_dir: str) -> None:
    """FSDP2 by hand (accelerate does not shard on CPU): ``fully_shard`` on every decoder layer and the
    root, each rank the SFT loss of its half of a fixed batch normalised by the global label count,
    times the world size (FSDP2's reduce-scatter averages); rank 0 saves the full gradients."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from swiftune.sft.trainer import sft_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, labels = fixed_batch()
    num_items = int((labels[:, 1:] != -100).sum())
    model = plain_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    per_rank = ids.shape[0] // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    loss, _ = sft_loss(model, {"input_ids": ids[mine]}, labels[mine], num_items_in_batch=num_items)
    (loss * world).backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    sharded = all(hasattr(p, "full_tensor") for p in model.parameters())
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        torch.save({"grads": grads, "loss": float(total), "world_size": world, "sharded": sharded},
                   os.path.join(out_dir, "result.pt"))
    finish_process_group()


def finish_process_group() -> None:
    """Every rank done before the group goes: tearing gloo down while a peer still uses it aborts."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, tiny_model_config("qwen3").vocab_size, (4, 24), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100  # a prompt part without loss
    labels[1, 10:] = -100  # rows with different label counts
    return ids, labels


def plain_model():
    """Full fine-tuning model (every parameter trained) on the reference kernels and attention."""
    from swiftune.models import patch_model

    torch.manual_seed(9)
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"), dtype=torch.float32)
    return patch_model(model, attention="reference", kernel_backend="reference")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["sft", "grpo", "fsdp2_loss"], required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    alive = []  # not to be freed before the process ends (see below)
    if a.mode == "fsdp2_loss":
        fsdp2_loss_gradients(a.out)
    else:
        alive.append(run(a.mode, a.batch, a.out, a.loss_type))
    print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "done": True}), flush=True)
    # Leave without freeing the trainer: freeing DDP's reducer destroys its gloo process group, whose
    # destructor joins gloo's worker thread while holding the GIL that thread may be waiting for to
    # drop a tensor (a deadlock seen in CI on torch 2.13's CPU build: rank 1 hung after rank 0 ended).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
