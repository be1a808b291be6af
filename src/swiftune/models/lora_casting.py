"""Deprecated alias of swiftune.training.lora_casting; removed after the next release."""

from ..training.lora_casting import (  # noqa: F401
    LORA_CAST_FLAG,
    can_skip_lora_input_casts,
    lora_input_casting,
    lora_inputs_cast,
    training_step_lora_casting,
)
