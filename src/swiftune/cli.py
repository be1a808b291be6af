"""The ``swiftune`` command.

    swiftune sft [CONFIG.yaml] [--key value ...]    supervised fine-tuning
    swiftune check                                  kernels vs their references on this machine

With no arguments ``swiftune sft`` trains a tiny built-in model on the built-in instruction
dataset (no download), on the GPU when there is one, else on the CPU in about a minute.
Options are the fields of :class:`swiftune.SFTConfig` (transformers' ``TrainingArguments``
plus swiftune's) and of :class:`ModelArguments`; a YAML file gives the same keys, and
command-line options override it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass, field

logger = logging.getLogger("swiftune")


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
    dtype: str = field(default="auto", metadata={"help": "Model weights dtype: auto (bf16 on GPU), bf16, fp16, fp32."})
    use_lora: bool | None = field(
        default=None, metadata={"help": "Train LoRA adapters (default) or the full model (false). "
                                        "The built-in tiny model trains fully by default."}
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


# Settings of the built-in run: a random tiny model learns the built-in tasks in about a minute.
BUILTIN_SFT_DEFAULTS = dict(
    output_dir="swiftune_output/sft", max_steps=80, per_device_train_batch_size=16, learning_rate=3e-3,
    lr_scheduler_type="cosine", warmup_steps=5, max_length=512, save_steps=40, save_total_limit=1,
)


def _yaml_to_argv(path: str) -> list[str]:
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


def parse_sft_args(argv: list[str]):
    from transformers import HfArgumentParser

    from .sft import SFTConfig

    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml")):
        argv = _yaml_to_argv(argv[0]) + argv[1:]
    parser = HfArgumentParser((ModelArguments, SFTConfig), prog="swiftune sft",
                              description="Supervised fine-tuning with swiftune. " + (__doc__ or ""))
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    # built-in run: its own defaults unless the user set them
    builtin = "model_name_or_path" not in given
    if builtin:
        defaults = [f"--{k}={v}" for k, v in BUILTIN_SFT_DEFAULTS.items() if k not in given]
        argv = defaults + argv
    elif "output_dir" not in given:
        argv = ["--output_dir=swiftune_output/sft"] + argv
    model_args, config = parser.parse_args_into_dataclasses(args=argv)
    return model_args, config, builtin


def _load_dataset(spec: str | None, split: str):
    from .data import builtin_instruction_dataset

    if spec is None:
        return builtin_instruction_dataset()
    if os.path.exists(spec):
        return spec  # prepare_dataset reads JSONL/JSON/Parquet paths itself
    try:
        import datasets
    except ImportError as e:
        raise SystemExit(f"--dataset {spec!r} is not a file, and loading hub datasets needs `pip install datasets`") from e
    return datasets.load_dataset(spec, split=split)


def run_sft(argv: list[str]) -> int:
    import torch

    from .data import build_tokenizer, tiny_model_config
    from .models import FastModel
    from .sft import SFTTrainer

    model_args, config, builtin = parse_sft_args(argv)
    gc = {"true": True, "false": False, "offload": "offload"}.get(model_args.use_gradient_checkpointing.lower())
    if gc is None:
        raise SystemExit("--use_gradient_checkpointing must be true, false or offload")
    if builtin:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(config.seed)
        tokenizer = build_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"))
        if torch.cuda.is_available():
            model = model.to("cuda")
        use_lora = bool(model_args.use_lora)
    else:
        model, tokenizer = FastModel.from_pretrained(
            model_args.model_name_or_path, max_seq_length=config.max_length, dtype=model_args.dtype,
            attn_implementation=config.attention_backend,
        )
        use_lora = model_args.use_lora is not False
    if use_lora:
        targets = model_args.lora_target_modules
        model = FastModel.get_peft_model(
            model, r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
            target_modules=targets if targets == "all-linear" else targets.split(","),
            use_gradient_checkpointing=gc,
        )
    elif gc:
        FastModel.for_training(model, use_gradient_checkpointing=gc)
    trainer = SFTTrainer(model=model, args=config, train_dataset=_load_dataset(model_args.dataset,
                                                                                model_args.dataset_split),
                         processing_class=tokenizer)
    stats = trainer.train_dataset.stats
    print(f"swiftune sft: {stats.num_examples} examples ({stats.data_shape}), {stats.num_tokens} tokens, "
          f"{stats.num_truncated} truncated; batches: {config.batch_mode}; "
          f"{'LoRA r=%d' % model_args.lora_r if use_lora else 'full fine-tuning'}; device {trainer.args.device}")
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)
    tokenizer.save_pretrained(config.output_dir)
    if config.metrics_file and trainer.is_world_process_zero():
        from .sft.metrics import read_metrics

        rows = [r for r in read_metrics(os.path.join(config.output_dir, config.metrics_file)) if "loss" in r]
        if rows:
            k = max(1, len(rows) // 5)
            first = sum(r["loss"] for r in rows[:k]) / k
            last = sum(r["loss"] for r in rows[-k:]) / k
            print(f"loss: first fifth {first:.3f} -> last fifth {last:.3f}; wrote {config.output_dir}/"
                  f"{{model, {config.metrics_file}, loss.png}}")
    return 0


def run_check(argv: list[str]) -> int:
    """Each kernel against its reference on this machine's device (compiled on CUDA)."""
    import torch

    from .kernels import geglu, geglu_reference, rms_norm, rms_norm_reference, rope_qk, rope_qk_reference, swiglu
    from .kernels import swiglu_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    g, u = torch.randn(64, 1000, device=device), torch.randn(64, 1000, device=device)
    x, w = torch.randn(64, 1000, device=device), torch.randn(1000, device=device)
    q, k = torch.randn(2, 8, 16, 64, device=device), torch.randn(2, 2, 16, 64, device=device)
    cos, sin = torch.randn(2, 16, 64, device=device), torch.randn(2, 16, 64, device=device)
    rows = [
        ("swiglu", swiglu(g, u), swiglu_reference(g, u)),
        ("geglu", geglu(g, u, "tanh"), geglu_reference(g, u, "tanh")),
        ("rms_norm", rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)),
        ("rope_qk", torch.cat([t.flatten() for t in rope_qk(q.clone(), k.clone(), cos, sin)]),
         torch.cat([t.flatten() for t in rope_qk_reference(q, k, cos, sin)])),
    ]
    ok = True
    for name, got, want in rows:
        err = float((got.double() - want.double()).norm() / want.double().norm())
        ok &= err < 1e-5
        print(f"{name:9s} rel err {err:.2e} {'ok' if err < 1e-5 else 'FAIL'}")
    print(f"device {device}: {'all kernels match their references' if ok else 'MISMATCH'}")
    return 0 if ok else 1


COMMANDS = {"sft": run_sft, "check": run_check}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "accelerate", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

