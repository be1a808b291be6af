"""Deprecated alias of swiftune.attention.shared_prompt; removed after the next release."""

from ..attention.registry import register_grpo_attention
from ..attention.shared_prompt import (
    GRPO_ATTENTION_NAME,
    LAYOUT_KWARG,
    RowLayout,
    flex_attention,
    grpo_attention_forward,
    shared_prompt_flex,
    shared_prompt_reference,
    shared_prompt_sdpa,
)
from .policy import install_grpo_attention

__all__ = [
    "GRPO_ATTENTION_NAME",
    "LAYOUT_KWARG",
    "RowLayout",
    "flex_attention",
    "grpo_attention_forward",
    "install_grpo_attention",
    "register_grpo_attention",
    "shared_prompt_flex",
    "shared_prompt_reference",
    "shared_prompt_sdpa",
]
