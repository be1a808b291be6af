"""SFTConfig / GRPOConfig refuse bad lengths, counts and coefficients at construction: before any
model or data is loaded, with a message that names the field, the value and what to set instead."""

import dataclasses
import math

import pytest

from swiftune.rl.config import GRPOConfig
from swiftune.sft.config import SFTConfig

BASE = dict(output_dir="/tmp/swiftune_unused", report_to="none")


def refused(cls, field, value, **extra):
    """The ValueError of ``cls(field=value)``, checked to name the field, the value and a fix."""
    with pytest.raises(ValueError) as info:
        cls(**BASE, **{field: value}, **extra)
    message = str(info.value)
    assert f"{field}={value!r}" in message, message
    assert "set " in message, message
    return message


@pytest.mark.parametrize("field, value", [
    ("max_length", -5), ("max_length", 0), ("max_length", 12.5),
    ("gradient_accumulation_steps", 0), ("gradient_accumulation_steps", -1),
    ("per_device_train_batch_size", 0), ("per_device_eval_batch_size", 0),
    ("learning_rate", -1e-4), ("learning_rate", math.nan),
    ("max_steps", 0), ("max_steps", -5), ("num_train_epochs", -1.0), ("num_train_epochs", 0),
    ("weight_decay", -0.1), ("adam_beta1", 1.0), ("adam_beta2", -0.5), ("adam_epsilon", -1e-8),
    ("max_grad_norm", -1.0), ("save_total_limit", 0), ("seed", -1), ("dataloader_num_workers", -2),
    ("logging_steps", -1), ("save_steps", 0), ("max_tokens_per_batch", 0), ("logit_chunk_tokens", 0),
    ("truncation", "cut"), ("kernel_backend", "cuda"), ("attention_backend", "flsh_attn"),
])
def test_sft_config_refuses(field, value):
    refused(SFTConfig, field, value)


def test_sft_config_refuses_before_loading_anything():
    """The config alone raises: nothing about a model or a dataset is needed to find the mistake."""
    message = refused(SFTConfig, "max_length", -5)
    assert "None" in message  # the way to say "no limit"


def test_sft_config_accepts_the_documented_values():
    assert SFTConfig(**BASE).max_length == 1024
    assert SFTConfig(**BASE, max_length=None).max_length is None
    assert SFTConfig(**BASE, max_grad_norm=0.0).max_grad_norm == 0.0  # transformers: 0 = no clipping
    assert SFTConfig(**BASE, max_steps=-1, num_train_epochs=2).num_train_epochs == 2
    assert SFTConfig(**BASE, attention_backend="sdpa").attention_backend == "sdpa"
    assert SFTConfig(**BASE, attention_backend="eager").attention_backend == "eager"  # kept when loading a path


def test_packing_and_padding_free():
    """Unset padding_free means padding-free unless packing; packing with padding_free=True given
    explicitly is refused (one of them would silently be ignored); padding_free=False with packing
    is packing's own padded rows."""
    assert SFTConfig(**BASE).batch_mode == "padding_free"
    packed = SFTConfig(**BASE, packing=True)
    assert packed.batch_mode == "packed" and packed.padding_free is False
    assert SFTConfig(**BASE, packing=True, padding_free=False).batch_mode == "packed"
    assert SFTConfig(**BASE, padding_free=False).batch_mode == "padded"
    assert SFTConfig(**BASE, padding_free=True).batch_mode == "padding_free"
    with pytest.raises(ValueError, match="packing=True and padding_free=True.*set only one"):
        SFTConfig(**BASE, packing=True, padding_free=True)
    # a resolved config rebuilds (dataclasses.replace re-runs __post_init__ with the resolved values)
    assert dataclasses.replace(packed, max_length=256).batch_mode == "packed"


@pytest.mark.parametrize("field, value", [
    ("max_prompt_length", -3), ("max_prompt_length", 0), ("max_completion_length", 0),
    ("epsilon", -0.5), ("epsilon_high", -0.1), ("beta", -0.01), ("beta", math.inf),
    ("num_generations", 1), ("num_generations", 0), ("temperature", 0), ("temperature", -1.0),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 2.0), ("num_iterations", 0),
    ("steps_per_generation", 0), ("generation_batch_size", 0), ("max_rollout_batch_size", 0),
    ("loss_type", "ppo"), ("importance_sampling_level", "tokens"), ("scale_rewards", "batches"),
    ("rollout_engine", "vllm"), ("rollout_kv_cache_dtype", "int8"), ("stop_token_ids", [-1]), ("reward_weights", [1.0, math.nan]),
    ("delta", 0.5), ("gradient_accumulation_steps", 0), ("per_device_train_batch_size", 0),
    ("learning_rate", -1e-6), ("logit_chunk_tokens", 0), ("kernel_backend", "gpu"), ("reward_timeout", 0),
    ("neftune_noise_alpha", 5.0), ("label_smoothing_factor", 0.1),
])
def test_grpo_config_refuses(field, value):
    refused(GRPOConfig, field, value)


def test_grpo_fp8_kv_cache_needs_the_fast_engine():
    """The FP8 cache is the fast engine's: beside rollout_engine='transformers' the config says what to set."""
    with pytest.raises(ValueError, match="rollout_kv_cache_dtype='fp8' is the fast rollout engine's cache.*set "
                                         "rollout_engine to 'fast'"):
        GRPOConfig(**BASE, rollout_engine="transformers", rollout_kv_cache_dtype="fp8")
    assert GRPOConfig(**BASE, rollout_kv_cache_dtype="fp8").rollout_kv_cache_dtype == "fp8"


def test_grpo_lengths_none_means_no_limit():
    assert GRPOConfig(**BASE, max_prompt_length=None).max_prompt_length is None
    message = refused(GRPOConfig, "max_prompt_length", 0)
    assert "None for no limit" in message


def test_grpo_group_size_and_clipping():
    assert "num_generations" in refused(GRPOConfig, "num_generations", 1)
    # TRL allows asymmetric clipping either way; so does swiftune (epsilon_high < epsilon is legal math)
    assert GRPOConfig(**BASE, epsilon=0.2, epsilon_high=0.1).epsilon_high == 0.1
    assert GRPOConfig(**BASE, epsilon=0.0).epsilon_high == 0.0
    with pytest.raises(ValueError, match="epsilon_high=0.*cispo"):
        GRPOConfig(**BASE, loss_type="cispo", epsilon_high=0.0)
    assert GRPOConfig(**BASE, scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(**BASE, delta=2.0).delta == 2.0


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for cls in (SFTConfig, GRPOConfig):
        with pytest.raises(ValueError, match="output_dir=.* is a file, not a folder"):
            cls(output_dir=str(afile), report_to="none")
