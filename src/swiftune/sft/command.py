"""What the trainer commands share: model/data options, YAML + command-line parsing, loading the
model (or the built-in tiny one) with optional LoRA, and the `swiftune sft` command itself.

`swiftune grpo` (``swiftune.rl.builtin``) builds on the same pieces.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelArguments:
    """What to train and on what data."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local path or hub name of a causal LM; none: the built-in tiny model."}
    )
    dataset: str | None = field(
        default=None,
        metadata={"help": "JSONL/JSON/Parquet path, or a hub dataset name (needs `datasets`); none: built-in data."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of a hub dataset."})
    eval_dataset: str | None = field(
        default=None,
        metadata={"help": "Held-out rows (same formats as --dataset), evaluated every --eval_steps with "
                          "--eval_strategy steps; SFT reports eval_loss, GRPO eval_reward."},
    )
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of a hub eval dataset."})
    dtype: str = field(default="auto", metadata={"help": "Model weights dtype: auto (bf16 on GPU), bf16, fp16, fp32."})
    use_lora: bool | None = field(
        default=None, metadata={"help": "Train LoRA adapters (default for real models) or the full model (false; "
                                        "default for the built-in tiny model)."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "Comma-separated module names, or all-linear."}
    )
    use_gradient_checkpointing: str = field(
        default="true", metadata={"help": "true, false, or offload (saved layer inputs in CPU memory)."}
    )
    offload_gpu_budget_gb: float | None = field(
        default=None, metadata={"help": "With --use_gradient_checkpointing offload: GB of GPU memory the kept "
                                        "layer inputs may take (default: as many as fit; 0: every one on the host, "
                                        "the least GPU memory)."}
    )


# Settings of the built-in run: a random tiny model learns the built-in tasks in about a minute.
BUILTIN_SFT_DEFAULTS = dict(
    output_dir="swiftune_output/sft", max_steps=80, per_device_train_batch_size=16, learning_rate=3e-3,
    lr_scheduler_type="cosine", warmup_steps=5, max_length=512, save_steps=40, save_total_limit=1,
)


def yaml_to_argv(path: str) -> list[str]:
    """A YAML mapping of option names to values, as command-line arguments."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise SystemExit(f"{path}: expected a mapping of option names to values")
    argv: list[str] = []
    for key, value in config.items():
        if value is None:
            continue
        argv.append(f"--{key}")
        if isinstance(value, list):
            argv.extend(str(v) for v in value)
        elif isinstance(value, dict):
            argv.append(json.dumps(value))
        else:
            argv.append(str(value))
    return argv


def parse_command_args(argv: list[str], classes: tuple, prog: str, description: str,
                       builtin_defaults: dict[str, Any], default_output_dir: str):
    """``(model_args, config, builtin)`` from ``[CONFIG.yaml] [--key value ...]``.

    Command-line options override the YAML file. Without ``--model_name_or_path`` the command
    runs its built-in task, with ``builtin_defaults`` for every option the user did not give.
    """
    from transformers import HfArgumentParser

    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml")):
        argv = yaml_to_argv(argv[0]) + argv[1:]
    parser = HfArgumentParser(classes, prog=prog, description=description)
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    builtin = "model_name_or_path" not in given
    if builtin:
        argv = [f"--{k}={v}" for k, v in builtin_defaults.items() if k not in given] + argv
    elif "output_dir" not in given:
        argv = [f"--output_dir={default_output_dir}"] + argv
    model_args, config = parser.parse_args_into_dataclasses(args=argv)
    return model_args, config, builtin


def load_rows(spec: str | None, split: str, builtin_rows: Callable[[], Any]):
    """The training rows: built-in ones, a local file path (read later), or a hub dataset."""
    if spec is None:
        return builtin_rows()
    if os.path.exists(spec):
        return spec  # prepare_dataset / the GRPO trainer read JSONL/JSON/Parquet paths themselves
    try:
        import datasets
    except ImportError as e:
        raise SystemExit(f"--dataset {spec!r} is not a file, and loading hub datasets needs "
                         "`pip install datasets`") from e
    return datasets.load_dataset(spec, split=split)


def load_eval_rows(model_args: ModelArguments):
    """The ``--eval_dataset`` rows (a file path or hub dataset), or None without one."""
    if not model_args.eval_dataset:
        return None
    return load_rows(model_args.eval_dataset, model_args.eval_dataset_split, list)


def gradient_checkpointing_mode(model_args: ModelArguments) -> bool | str:
    gc = {"true": True, "false": False, "offload": "offload"}.get(model_args.use_gradient_checkpointing.lower())
    if gc is None:
        raise SystemExit("--use_gradient_checkpointing must be true, false or offload")
    return gc


def build_model(model_args: ModelArguments, config, builtin: bool,
                prepare_builtin: Callable[[Any, Any], None] | None = None):
    """``(model, tokenizer, use_lora)``: the built-in tiny model (random init, on the GPU when there
    is one) or ``FastModel.from_pretrained``; then LoRA adapters or full fine-tuning set-up.
    ``prepare_builtin(model, tokenizer)`` runs on the built-in model before adapters are added."""
    import torch

    from ..data import build_tokenizer, tiny_model_config
    from ..models import FastModel

    gc = gradient_checkpointing_mode(model_args)
    budget = model_args.offload_gpu_budget_gb
    if budget is not None and gc != "offload":
        raise SystemExit("--offload_gpu_budget_gb needs --use_gradient_checkpointing offload")
    if budget is not None and budget < 0:
        raise SystemExit(f"--offload_gpu_budget_gb must be >= 0, got {budget}")
    budget_bytes = None if budget is None else int(budget * 1e9)
    if builtin:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(config.seed)
        tokenizer = build_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"))
        if torch.cuda.is_available():
            model = model.to("cuda")
        if prepare_builtin is not None:
            prepare_builtin(model, tokenizer)
        use_lora = bool(model_args.use_lora)
    else:
        model, tokenizer = FastModel.from_pretrained(
            model_args.model_name_or_path, max_seq_length=getattr(config, "max_length", None),
            dtype=model_args.dtype, attn_implementation=config.attention_backend,
            kernel_backend=config.kernel_backend,
        )
        use_lora = model_args.use_lora is not False
    if use_lora:
        targets = model_args.lora_target_modules
        model = FastModel.get_peft_model(
            model, r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
            target_modules=targets if targets == "all-linear" else targets.split(","), use_gradient_checkpointing=gc,
            offload_gpu_budget_bytes=budget_bytes,
        )
    elif gc:
        FastModel.for_training(model, use_gradient_checkpointing=gc, offload_gpu_budget_bytes=budget_bytes)
    return model, tokenizer, use_lora


def resume_target(value: str | bool | None) -> str | bool | None:
    """``--resume_from_checkpoint`` as the Trainer takes it: ``true``/``last`` = the newest checkpoint
    in ``output_dir``, ``false``/empty = start fresh, anything else a checkpoint folder."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lower() in ("true", "yes", "1", "last", "latest"):
        return True
    if text.lower() in ("", "false", "no", "0", "none"):
        return None
    if not os.path.isdir(text):
        raise FileNotFoundError(f"--resume_from_checkpoint {text!r}: no such checkpoint folder "
                                "(give a checkpoint-N folder, or true for the newest one in output_dir)")
    return text


def first_and_last_fifth(metrics_path: str, key: str) -> tuple[float, float] | None:
    """Mean of ``key`` over the first and the last fifth of the logged steps."""
    from .metrics import read_metrics

    rows = [r for r in read_metrics(metrics_path) if key in r] if os.path.exists(metrics_path) else []
    if not rows:
        return None
    k = max(1, len(rows) // 5)
    return sum(r[key] for r in rows[:k]) / k, sum(r[key] for r in rows[-k:]) / k


def parse_sft_args(argv: list[str]):
    from .config import SFTConfig

    return parse_command_args(argv, (ModelArguments, SFTConfig), "swiftune sft",
                              "Supervised fine-tuning with swiftune.", BUILTIN_SFT_DEFAULTS, "swiftune_output/sft")


def run_sft(argv: list[str]) -> int:
    """``swiftune sft``: train, save, and report the loss of the first and last fifth."""
    from ..data import builtin_instruction_dataset
    from .trainer import SFTTrainer

    model_args, config, builtin = parse_sft_args(argv)
    model, tokenizer, use_lora = build_model(model_args, config, builtin)
    rows = load_rows(model_args.dataset, model_args.dataset_split, builtin_instruction_dataset)
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows, eval_dataset=load_eval_rows(model_args),
                         processing_class=tokenizer)
    stats = trainer.train_dataset.stats
    print(f"swiftune sft: {stats.num_examples} examples ({stats.data_shape}), {stats.num_tokens} tokens, "
          f"{stats.num_truncated} truncated; batches: {config.batch_mode}; "
          f"{'LoRA r=%d' % model_args.lora_r if use_lora else 'full fine-tuning'}; device {trainer.args.device}")
    trainer.train(resume_from_checkpoint=resume_target(config.resume_from_checkpoint))
    trainer.save_model(config.output_dir)
    tokenizer.save_pretrained(config.output_dir)
    if config.metrics_file and trainer.is_world_process_zero():
        fifths = first_and_last_fifth(os.path.join(config.output_dir, config.metrics_file), "loss")
        if fifths:
            print(f"loss: first fifth {fifths[0]:.3f} -> last fifth {fifths[1]:.3f}; wrote {config.output_dir}/"
                  f"{{model, {config.metrics_file}, loss.png}}")
    return 0
