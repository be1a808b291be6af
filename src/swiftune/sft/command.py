"""Deprecated alias of swiftune.cli.sft, swiftune.cli.arguments and swiftune.cli.runs; removed after the next release."""

from ..cli.arguments import (  # noqa: F401
    CommandLineError,
    ModelArguments,
    check_model_args,
    check_paths,
    gradient_checkpointing_mode,
    lora_targets,
    parse_command_args,
    read_yaml_config,
    resume_target,
)
from ..cli.runs import build_model, first_and_last_fifth, load_eval_rows, load_rows  # noqa: F401
from ..cli.sft import BUILTIN_SFT_DEFAULTS, parse_sft_args, run_sft  # noqa: F401
