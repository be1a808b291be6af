"""What the training commands do around their trainer: the model (a model path, or the built-in
tiny one) with LoRA or full fine-tuning set up, the training and evaluation rows, and the summary
printed at the end.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

from .arguments import (ModelArguments, check_model_args, check_tiled_mlp_with_lora, gradient_checkpointing_mode,
                        lora_target_parameter_names, lora_targets, resume_target)


def load_rows(spec: str | None, split: str, builtin_rows: Callable[[], Any]):
    """The training rows: built-in ones, a local file path (read later), or a hub dataset.

    A name that looks like a local path (``./x``, ``/x``, ``~/x``, ``x.jsonl``, ``a/b/c``) and does
    not exist raises ``FileNotFoundError`` instead of a Hub lookup."""
    from ..local_paths import resolve_local_path

    if spec is None:
        return builtin_rows()
    spec = resolve_local_path(spec, "--dataset")
    if os.path.isfile(spec):
        return spec  # prepare_dataset / the GRPO trainer read JSONL/JSON/Parquet paths themselves
    try:
        import datasets
    except ImportError as e:
        what = "is a folder, and loading it" if os.path.isdir(spec) else "is not a file, and loading hub datasets"
        raise ImportError(f"--dataset {spec!r} {what} needs `pip install datasets`") from e
    if os.path.isdir(spec) and any(os.path.exists(os.path.join(spec, f)) for f in ("state.json", "dataset_dict.json")):
        saved = datasets.load_from_disk(spec)  # Dataset.save_to_disk / DatasetDict.save_to_disk output
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise ValueError(f"--dataset {spec}: the saved dataset has splits {sorted(saved)}, not {split!r}; "
                                 "choose one with --dataset_split (--eval_dataset_split for --eval_dataset)")
            return saved[split]
        return saved
    return datasets.load_dataset(spec, split=split)  # a hub name, or a folder of data files (as trl sft does)


def load_eval_rows(model_args: ModelArguments):
    """The ``--eval_dataset`` rows (a file path or hub dataset), or None without one."""
    if not model_args.eval_dataset:
        return None
    return load_rows(model_args.eval_dataset, model_args.eval_dataset_split, list)


def build_model(model_args: ModelArguments, config, builtin: bool,
                prepare_builtin: Callable[[Any, Any], None] | None = None):
    """``(model, tokenizer, use_lora)``: the built-in tiny model (random init, on the GPU when there
    is one) or ``FastModel.from_pretrained``; then LoRA adapters or full fine-tuning set-up.
    ``prepare_builtin(model, tokenizer)`` runs on the built-in model before adapters are added.

    Model arguments that cannot run raise :class:`swiftune.errors.ConfigError` before anything
    loads (the command has checked them already; a caller from Python may not have)."""
    import torch

    from ..data import build_tokenizer, tiny_model_config
    from ..training import FastModel

    check_model_args(model_args)
    gc = gradient_checkpointing_mode(model_args)
    budget = model_args.offload_gpu_budget_gb
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
        if getattr(model_args, "load_in_fp8", False):
            # after the warm-up (which trains the whole model), as --load_in_fp8 would load a saved
            # checkpoint of it; FP8 weights are frozen, so LoRA adapters train on top
            from ..models.fp8_linear import quantize_model_fp8

            quantize_model_fp8(model)
            use_lora = True
    else:
        model, tokenizer = FastModel.from_pretrained(
            model_args.model_name_or_path, max_seq_length=getattr(config, "max_length", None),
            dtype=model_args.dtype, attn_implementation=config.attention_backend,
            kernel_backend=config.kernel_backend, load_in_4bit=model_args.load_in_4bit,
            load_in_fp8=getattr(model_args, "load_in_fp8", False),
        )
        use_lora = model_args.use_lora is not False
    check_tiled_mlp_with_lora(model_args, use_lora)  # the built-in model decides use_lora only here
    if use_lora:
        parameters = lora_target_parameter_names(model_args.lora_target_parameters)
        model = FastModel.get_peft_model(
            model, r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
            target_modules=lora_targets(model_args.lora_target_modules), use_gradient_checkpointing=gc,
            **({"target_parameters": parameters} if parameters else {}),
            offload_gpu_budget_bytes=budget_bytes,
            offload_attention_output_layers=model_args.offload_attention_output_layers,
            offload_attention_outputs_on_host=model_args.offload_attention_outputs_on_host,
            tiled_mlp=model_args.tiled_mlp,
        )
    elif gc:
        FastModel.for_training(model, use_gradient_checkpointing=gc, offload_gpu_budget_bytes=budget_bytes,
                               offload_attention_output_layers=model_args.offload_attention_output_layers,
                               offload_attention_outputs_on_host=model_args.offload_attention_outputs_on_host)
    return model, tokenizer, use_lora


def first_and_last_fifth(metrics_path: str, key: str) -> tuple[float, float] | None:
    """Mean of ``key`` over the first and the last fifth of the logged steps."""
    from ..training.metrics import read_metrics

    rows = [r for r in read_metrics(metrics_path) if key in r] if os.path.exists(metrics_path) else []
    if not rows:
        return None
    k = max(1, len(rows) // 5)
    return sum(r[key] for r in rows[:k]) / k, sum(r[key] for r in rows[-k:]) / k


def describe_training(use_lora: bool, lora_r: int) -> str:
    """``LoRA r=16`` or ``full fine-tuning``, for the line a command prints before training."""
    return f"LoRA r={lora_r}" if use_lora else "full fine-tuning"


def save_final_model(trainer, tokenizer, output_dir: str) -> None:
    """The trained model and the tokenizer into ``output_dir``, written into a hidden folder first and
    moved in when complete: a run stopped while saving never leaves weights cut short in ``output_dir``
    (the checkpoints are complete or absent the same way, :mod:`swiftune.training.checkpoints`)."""
    from ..training.checkpoints import final_staging_dir, move_saved_files

    staging = final_staging_dir(output_dir)
    main = trainer.is_world_process_zero()
    if main and os.path.exists(staging):
        shutil.rmtree(staging)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(staging)  # every process takes part (sharded weights); the main one writes
    if main:
        tokenizer.save_pretrained(staging)
        move_saved_files(staging, output_dir)
    trainer.accelerator.wait_for_everyone()


def train_save_and_report(trainer, config, tokenizer, metric: str, plot: str) -> None:
    """Train (resuming if asked), save the model and tokenizer, then print how ``metric`` moved
    from the first fifth of the run to the last, so that a user sees at once whether it learned."""
    trainer.train(resume_from_checkpoint=resume_target(config.resume_from_checkpoint))
    save_final_model(trainer, tokenizer, config.output_dir)
    if not trainer.is_world_process_zero():
        return
    if not config.metrics_file:
        print(f"wrote the model to {config.output_dir} (load it from there); no {metric} summary or {plot}: "
              "metrics_file is off")
        return
    fifths = first_and_last_fifth(os.path.join(config.output_dir, config.metrics_file), metric)
    if fifths:
        first, last = fifths
        margin = f" (margin {last - first:+.3f})" if metric == "reward" else ""
        # the model is the folder itself (what --model of swiftune generate, from_pretrained and PEFT take)
        print(f"{metric}: first fifth {first:.3f} -> last fifth {last:.3f}{margin}; wrote the model to "
              f"{config.output_dir} (load it from there), with {config.metrics_file} and {plot}")
