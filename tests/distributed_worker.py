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
from swiftune.models import FastModel  # noqa: E402

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


def run(mode: str, batch: int, out_dir: str, loss_type: str):
    tokenizer = build_tokenizer()
    model = lora_model(9)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    log = LossLog()
    if mode == "sft":
        from swiftune.sft import SFTConfig, SFTTrainer

        args = SFTConfig(output_dir=out_dir, max_steps=2, per_device_train_batch_size=batch, max_length=256,
                         **COMMON)
        trainer = SFTTrainer(model=model, args=args, train_dataset=builtin_instruction_dataset(num_rows=16, seed=3),
                             processing_class=tokenizer, callbacks=[log])
    else:
        from swiftune.rl import GRPOConfig, GRPOTrainer
        from tests.test_grpo import PROMPT_ROWS, FixedEngine, length_reward

        args = GRPOConfig(output_dir=out_dir, max_steps=1, per_device_train_batch_size=batch, num_generations=8,
                          max_completion_length=16, loss_type=loss_type, beta=0.05, scale_rewards="batch",
                          metrics_file=None, plot_rewards=False, **COMMON)
        trainer = GRPOTrainer(model, [length_reward], args=args, train_dataset=PROMPT_ROWS[:4],
                              processing_class=tokenizer, rollout_engine=FixedEngine(), callbacks=[log])
    trainer.train()
    if trainer.accelerator.is_main_process:
        deltas = {n: (p.detach() - before[n]) for n, p in model.named_parameters() if p.requires_grad}
        torch.save({"deltas": deltas, "losses": log.losses, "world_size": trainer.accelerator.num_processes},
                   os.path.join(out_dir, "result.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["sft", "grpo"], required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    run(a.mode, a.batch, a.out, a.loss_type)
    print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "done": True}))


if __name__ == "__main__":
    main()
