"""Deprecated alias of swiftune.cli.grpo; removed after the next release."""

from ..cli.grpo import (  # noqa: F401
    BUILTIN_GRPO_DEFAULTS,
    BUILTIN_REWARDS,
    GRPOModelArguments,
    builtin_reverse_dataset,
    exact_match_reward,
    final_answer_reward,
    parse_grpo_args,
    resolve_reward_funcs,
    reverse_reward,
    run_grpo,
    sft_warmup,
)
