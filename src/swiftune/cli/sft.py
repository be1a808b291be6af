"""``swiftune sft``: supervised fine-tuning from the command line.

    swiftune sft [CONFIG.yaml] [--key value ...]

Options are the fields of :class:`~swiftune.cli.arguments.ModelArguments` and of
:class:`swiftune.SFTConfig`. Without ``--model_name_or_path`` it trains the built-in tiny model
(random init) on the built-in instruction dataset, with :data:`BUILTIN_SFT_DEFAULTS` for every
option not given (a given ``--num_train_epochs`` replaces its ``max_steps``): a run small enough for a CPU
whose loss visibly falls.
"""

from __future__ import annotations


from .arguments import ModelArguments, parse_command_args
from .runs import build_model, describe_training, load_eval_rows, load_rows, train_save_and_report

# Settings of the built-in run: chosen so that a random tiny model learns the built-in tasks in a
# short CPU run (a high learning rate, short rows, one checkpoint kept).
BUILTIN_SFT_DEFAULTS = dict(
    output_dir="swiftune_output/sft", max_steps=80, per_device_train_batch_size=16, learning_rate=3e-3,
    lr_scheduler_type="cosine", warmup_steps=5, max_length=512, save_steps=40, save_total_limit=1,
)


def parse_sft_args(argv: list[str]):
    """``(model_args, SFTConfig, builtin)`` from a command line (YAML first, then options)."""
    from ..sft import SFTConfig

    return parse_command_args(argv, (ModelArguments, SFTConfig), "swiftune sft",
                              "Supervised fine-tuning with swiftune.", BUILTIN_SFT_DEFAULTS, "swiftune_output/sft")


def run_sft(argv: list[str]) -> int:
    """``swiftune sft``: train, save, and report the loss of the first and last fifth."""
    from ..data import builtin_instruction_dataset
    from ..sft import SFTTrainer

    model_args, config, builtin = parse_sft_args(argv)
    model, tokenizer, use_lora = build_model(model_args, config, builtin)
    rows = load_rows(model_args.dataset, model_args.dataset_split, builtin_instruction_dataset)
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows, eval_dataset=load_eval_rows(model_args),
                         processing_class=tokenizer)
    stats = trainer.train_dataset.stats
    if trainer.is_world_process_zero():  # once under torchrun
        print(f"swiftune sft: {stats.num_examples} examples ({stats.data_shape}), {stats.num_tokens} tokens, "
              f"{stats.num_truncated} truncated; batches: {trainer.batch_layout}; "
              f"{describe_training(use_lora, model_args.lora_r)}; device {trainer.args.device}")
    train_save_and_report(trainer, config, tokenizer, "loss", "loss.png")
    return 0
