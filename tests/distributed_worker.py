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
        self.tokens: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.tokens.append(float(logs.get("tokens", float("nan"))))


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
        torch.save({"deltas": deltas, "losses": log.losses, "tokens": log.tokens,
                    "world_size": trainer.accelerator.num_processes, "eval": evaluated},
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


# ------------------------------------------------------------------ resuming across world sizes
# (tests/test_distributed_resume.py). Two launches share one folder with a 1-process checkpoint
# the test writes first (``sft-seed``): phase 2 (2 processes) trains uninterrupted runs that save
# checkpoints (saving changes nothing in the run) and resumes the 1-process checkpoint; phase 1
# (1 process) trains the same uninterrupted runs and resumes phase 2's checkpoints. The global batch
# (per-device batch x processes) is the same in every run but the negative control.

RESUME_SFT = dict(optim="adamw_torch", learning_rate=5e-3, lr_scheduler_type="linear", max_grad_norm=1.0)
SFT_GLOBAL_BATCH, SFT_STEPS, SFT_SAVE_AT = 8, 4, 2
GRPO_GLOBAL_BATCH, GRPO_STEPS, GRPO_SAVE_AT = 16, 2, 1


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters() if p.requires_grad}


def resumable_sft(out_dir: str, resume: str | None, alive: list, global_batch: int = SFT_GLOBAL_BATCH,
                  launched: bool = True) -> dict:
    """SFT with LoRA (DDP across processes), AdamW and a linear schedule, saving every
    ``SFT_SAVE_AT`` steps; 24 rows = 3 steps an epoch, so the checkpoint falls mid-epoch.
    ``launched=False``: a plain process without torchrun (no gloo back-end asked for)."""
    import io
    import logging

    from swiftune.sft import SFTConfig, SFTTrainer

    world = int(os.environ.get("WORLD_SIZE", 1))
    log = LossLog()
    messages = io.StringIO()  # swiftune's resume messages (info: a world-size change that keeps the batch)
    handler = logging.StreamHandler(messages)
    swiftune_logger = logging.getLogger("swiftune")
    swiftune_logger.addHandler(handler)
    swiftune_logger.setLevel(logging.INFO)
    common = {**COMMON, **RESUME_SFT, "save_strategy": "steps", "save_steps": SFT_SAVE_AT}
    if not launched:
        common.pop("ddp_backend")
    args = SFTConfig(output_dir=out_dir, max_steps=SFT_STEPS, per_device_train_batch_size=global_batch // world,
                     max_length=256, **common)
    trainer = SFTTrainer(model=lora_model(9), args=args, train_dataset=builtin_instruction_dataset(num_rows=24, seed=3),
                         processing_class=build_tokenizer(), callbacks=[log])
    alive.append(trainer)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        swiftune_logger.removeHandler(handler)
    return {"losses": log.losses, "weights": trainable(trainer.model), "steps": trainer.state.global_step,
            "ddp": ddp_buckets(trainer.model_wrapped), "warnings": messages.getvalue(),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
            "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}


def ddp_buckets(model) -> dict | None:
    """DDP's gradient buckets (bytes) and whether they are views of the gradients, or None (no DDP)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    info = model._get_ddp_logging_data()
    return {"bucket_bytes": sum(int(b) for b in str(info["bucket_sizes"]).split(",") if b),
            "gradient_as_bucket_view": bool(int(info["gradient_as_bucket_view"]))}


def fsdp2_shard_bytes() -> list[int]:
    """Parameter bytes each rank holds after ``fully_shard`` on every decoder layer and the root
    (float32, the full fine-tuning model), gathered from every rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = plain_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    mine = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [int(b) for b in every]


def resumable_grpo(out_dir: str, resume: str | None, alive: list, steps_per_generation: int = 1) -> dict:
    """GRPO (dapo, KL) on the deterministic engine, 2 steps of 2 prompts x 8 generations, a
    checkpoint after step 1: a generation boundary (every step generates), or with
    ``steps_per_generation=2`` between the two steps of one generation."""
    import io
    import logging

    from swiftune.rl import GRPOConfig, GRPOTrainer
    from tests.test_grpo import PROMPT_ROWS, FixedEngine, length_reward

    world = int(os.environ.get("WORLD_SIZE", 1))
    log = LossLog()
    common = {**COMMON, **RESUME_SFT, "save_strategy": "steps", "save_steps": GRPO_SAVE_AT}
    args = GRPOConfig(output_dir=out_dir, max_steps=GRPO_STEPS, per_device_train_batch_size=GRPO_GLOBAL_BATCH // world,
                      num_generations=8, max_completion_length=16, loss_type="dapo", beta=0.05, scale_rewards="batch",
                      metrics_file=None, plot_rewards=False, steps_per_generation=steps_per_generation, **common)
    trainer = GRPOTrainer(lora_model(9), [length_reward], args=args, train_dataset=PROMPT_ROWS[:4],
                          processing_class=build_tokenizer(), rollout_engine=FixedEngine(), callbacks=[log])
    alive.append(trainer)
    messages = io.StringIO()  # the rollout buffer's warning on another world size
    handler = logging.StreamHandler(messages)
    logging.getLogger("swiftune").addHandler(handler)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        logging.getLogger("swiftune").removeHandler(handler)
    return {"losses": log.losses, "weights": trainable(trainer.model), "steps": trainer.state.global_step,
            "warnings": messages.getvalue(), "generations": trainer.rollout_engine.calls}


FSDP2_CONFIG = {"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"], "state_dict_type": "SHARDED_STATE_DICT"}


def resumable_fsdp2_sft(out_dir: str, resume: str | None, alive: list) -> dict:
    """Full fine-tuning through the Trainer under accelerate's FSDP2 (CUDA + NCCL only: accelerate
    enables FSDP for GPU back-ends only), float32, the SFT schedule of :func:`resumable_sft`; the
    checkpoints are accelerate's sharded state dicts (torch.distributed.checkpoint folders)."""
    from swiftune.sft import SFTConfig, SFTTrainer

    world = int(os.environ.get("WORLD_SIZE", 1))
    log = LossLog()
    common = {**COMMON, **RESUME_SFT, "save_strategy": "steps", "save_steps": SFT_SAVE_AT, "use_cpu": False,
              "ddp_backend": "nccl"}
    args = SFTConfig(output_dir=out_dir, max_steps=SFT_STEPS, per_device_train_batch_size=SFT_GLOBAL_BATCH // world,
                     max_length=256, fsdp="full_shard", fsdp_config=dict(FSDP2_CONFIG), **common)
    trainer = SFTTrainer(model=plain_model(), args=args,
                         train_dataset=builtin_instruction_dataset(num_rows=24, seed=3),
                         processing_class=build_tokenizer(), callbacks=[log])
    alive.append(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return {"losses": log.losses, "weights": {n: full(p).cpu() for n, p in trainer.model.named_parameters()},
            "steps": trainer.state.global_step, "sharded": all(hasattr(p, "full_tensor")
                                                               for p in trainer.model.parameters())}


def fsdp2_resume_phase(phase: int, root: str, alive: list) -> None:
    """The GPU launches of tests/test_distributed_resume.py's FSDP2 test: 3 = 1 GPU uninterrupted
    (saves), 4 = 2 GPUs uninterrupted (saves) + the resume of 3's checkpoint, 5 = 1 GPU, the resume
    of 4's checkpoint; rank 0 saves ``phase{phase}.pt``."""
    import torch.distributed as dist

    join = lambda *parts: os.path.join(root, *parts)  # noqa: E731
    results: dict = {}
    checkpoint = f"checkpoint-{SFT_SAVE_AT}"
    if phase == 3:
        results["fsdp"] = resumable_fsdp2_sft(join("fsdp-1"), None, alive)
    elif phase == 4:
        results["fsdp"] = resumable_fsdp2_sft(join("fsdp-2"), None, alive)
        results["fsdp_from_1"] = resumable_fsdp2_sft(join("fsdp-2-from-1"), join("fsdp-1", checkpoint), alive)
    else:
        results["fsdp_from_2"] = resumable_fsdp2_sft(join("fsdp-1-from-2"), join("fsdp-2", checkpoint), alive)
        results["checkpoint_files"] = sorted(os.listdir(join("fsdp-2", checkpoint)))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"world_size": world, **results}, join(f"phase{phase}.pt"))
    finish_process_group()


def resume_phase(phase: int, root: str, alive: list) -> None:
    """One launch (see above): ``phase`` 2 on 2 processes, 1 on one; rank 0 saves ``phase{phase}.pt``.
    The 1-process checkpoint that phase 2 resumes (``sft-seed``) is written before, by the test."""
    import torch.distributed as dist

    join = lambda *parts: os.path.join(root, *parts)  # noqa: E731
    results: dict = {}
    if phase == 2:
        results["sft"] = resumable_sft(join("sft-2"), None, alive)
        results["sft_from_1"] = resumable_sft(join("sft-2-from-1"), join("sft-seed", f"checkpoint-{SFT_SAVE_AT}"), alive)
        results["grpo"] = resumable_grpo(join("grpo-2"), None, alive)
        results["grpo_mid"] = resumable_grpo(join("grpo-mid-2"), None, alive, steps_per_generation=2)
        results["fsdp2_shard_bytes"] = fsdp2_shard_bytes()
    else:
        results["sft"] = resumable_sft(join("sft-1"), None, alive)
        results["sft_from_2"] = resumable_sft(join("sft-1-from-2"), join("sft-2", f"checkpoint-{SFT_SAVE_AT}"), alive)
        # the negative control: another global batch does not continue where the checkpoint stopped
        results["sft_from_2_half_batch"] = resumable_sft(join("sft-1-from-2-half"),
                                                         join("sft-2", f"checkpoint-{SFT_SAVE_AT}"), alive,
                                                         global_batch=SFT_GLOBAL_BATCH // 2)
        results["grpo"] = resumable_grpo(join("grpo-1"), None, alive)
        results["grpo_from_2"] = resumable_grpo(join("grpo-1-from-2"), join("grpo-2", f"checkpoint-{GRPO_SAVE_AT}"),
                                                alive)
        results["grpo_mid_from_2"] = resumable_grpo(join("grpo-mid-1-from-2"),
                                                    join("grpo-mid-2", f"checkpoint-{GRPO_SAVE_AT}"), alive,
                                                    steps_per_generation=2)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"world_size": world, **results}, join(f"phase{phase}.pt"))
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
    p.add_argument("--mode", choices=["sft", "grpo", "fsdp2_loss", "resume"], required=True)
    p.add_argument("--phase", type=int, choices=[1, 2, 3, 4, 5], default=1,
                   help="--mode resume: which launch (2, 4: 2 processes; 3-5: FSDP2 on CUDA)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    alive = []  # not to be freed before the process ends (see below)
    if a.mode == "fsdp2_loss":
        fsdp2_loss_gradients(a.out)
    elif a.mode == "resume" and a.phase >= 3:
        fsdp2_resume_phase(a.phase, a.out, alive)
    elif a.mode == "resume":
        resume_phase(a.phase, a.out, alive)
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
