"""TRL 1.16 ``SFTConfig`` fields that swiftune takes with TRL's meaning (docs/trl_compat.md).

Checked at config construction, before any model or data loads: a value swiftune cannot honour
raises a :class:`~swiftune.errors.ConfigError` naming the field and what to set instead; a field
accepted without effect warns once, naming it. The trainer-side work (tokens, chat template,
model keywords) is :func:`apply_tokenizer_fields` and :func:`model_load_kwargs`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ..errors import ConfigError
from ..training.config_checks import fail, from_pretrained_kwargs, require_choice, require_int
from ..training.config_checks import warn_once as config_warn_once

LOSS_TYPES = ("nll", "dft")
TRUNCATION_MODES_TRL = ("keep_start", "keep_end")
DATASET_KWARGS_KEYS = ("skip_prepare_dataset",)
# model_init_kwargs keys that SFTConfig sets through its own fields
_MODEL_KWARGS_OWNED = {
    "attn_implementation": "attention_backend",
    "max_seq_length": "max_length",
    "kernel_backend": "kernel_backend",
}


def warn_once(field_name: str, message: str, owner: str = "SFTConfig") -> None:
    """One warning per field and process: a field accepted but not (fully) honoured says so."""
    config_warn_once(f"{owner}.{field_name}", f"{owner}.{field_name}: {message}", stacklevel=4)


def _require_bool(config: Any, name: str, allow_none: bool = False) -> None:
    value = getattr(config, name)
    if not (isinstance(value, bool) or (allow_none and value is None)):
        fail(config, name, value, "must be True or False" + (" or None" if allow_none else ""),
             f"set {name} to True or False")


def _require_token(config: Any, name: str) -> None:
    value = getattr(config, name)
    if value is not None and (not isinstance(value, str) or not value):
        fail(config, name, value, "must be a token string or None", f"set {name} to a token of the tokenizer's "
             "vocabulary (e.g. '<|im_end|>'), or None to keep the tokenizer's")


def _resolve_pad_to_multiple_of(config: Any) -> None:
    value = config.pad_to_multiple_of
    if isinstance(value, str):  # the command line passes strings, as in TRL
        lowered = value.strip().lower()
        if lowered in ("auto", "none", "null"):
            value = None  # TRL's "auto" pads only on Neuron, which swiftune does not run on
        elif lowered.isdigit():
            value = int(lowered)
    config.pad_to_multiple_of = value
    require_int(config, "pad_to_multiple_of", 1, "a row-length multiple (e.g. 64), or None / 'auto' for no "
                "extra padding", allow_none=True)


def check_trl_fields(config: Any) -> None:
    """The TRL fields that decide layout and checkpointing; runs before ``TrainingArguments.__post_init__``."""
    require_choice(config, "truncation_mode", TRUNCATION_MODES_TRL)
    if config.loss_type == "chunked_nll":  # TRL's deprecated alias: the same loss
        warnings.warn("SFTConfig.loss_type='chunked_nll' is TRL's deprecated alias of 'nll' (what swiftune's fused "
                      "loss computes); using 'nll'", FutureWarning, stacklevel=4)
        config.loss_type = "nll"
    require_choice(config, "loss_type", LOSS_TYPES)
    strategy = config.packing_strategy
    if strategy == "bfd-requeue":  # TRL's deprecated name
        warnings.warn("SFTConfig.packing_strategy='bfd-requeue' is TRL's deprecated name of 'bfd_split'; using "
                      "'bfd_split'", FutureWarning, stacklevel=4)
        config.packing_strategy = strategy = "bfd_split"
    if strategy == "wrapped":
        fail(config, "packing_strategy", strategy, "is not supported: it cuts documents mid-sequence and trains "
             "across their boundaries, while swiftune keeps every packed document whole and separate",
             "set packing_strategy='bfd' (best-fit decreasing; same loss as unpacked training)")
    if strategy not in ("bfd", "bfd_split"):
        fail(config, "packing_strategy", strategy, "is not one of bfd, bfd_split, wrapped",
             "set packing_strategy='bfd' (or 'bfd_split')")
    for name in ("shuffle_dataset", "activation_offloading", "trust_remote_code"):
        _require_bool(config, name)
    _require_bool(config, "eval_packing", allow_none=True)
    if config.eval_packing and config.max_length is None:
        fail(config, "eval_packing", True, "needs max_length (the length of a packed row)",
             "set max_length, e.g. 1024, or eval_packing=False")
    _resolve_pad_to_multiple_of(config)
    require_int(config, "dataset_num_proc", 1, "the processes (TRL's datasets.map num_proc), or None",
                allow_none=True)
    if config.dataset_num_proc is not None:
        warn_once("dataset_num_proc", f"{config.dataset_num_proc} is accepted but not used: swiftune tokenizes in "
                  "batches of rows with the fast tokenizer in one process; leave it unset to silence this")
    for name in ("eos_token", "pad_token"):
        _require_token(config, name)
    path = config.chat_template_path
    if path is not None and (not isinstance(path, str) or not os.path.exists(path)):
        fail(config, "chat_template_path", path, "is not an existing file or directory", "set it to a local "
             ".jinja / .j2 template file or a local tokenizer directory (no Hub lookups), or None")
    coef = config.router_aux_loss_coef
    if coef is not None and (not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0 or coef != coef):
        fail(config, "router_aux_loss_coef", coef, "is not a number >= 0", "set a weight >= 0 for the MoE "
             "load-balancing loss, 0.0 to switch it off, or None for the model config's own")
    if getattr(config, "use_liger_kernel", False):
        fail(config, "use_liger_kernel", True, "would put Liger's kernels (and its fused loss, which replaces the "
             "model's forward) over swiftune's own", "leave use_liger_kernel=False: swiftune's fused kernels and "
             "chunked loss do that work")
    if config.activation_offloading and config.gradient_checkpointing:
        # offloaded checkpointing already checkpoints every layer; transformers' own flag on top of it would
        # recompute each layer twice
        config.gradient_checkpointing = False


def _require_dict(config: Any, name: str, example: str) -> dict | None:
    value = getattr(config, name)
    if value is not None and not isinstance(value, dict):
        fail(config, name, value, "must be a dict (or its JSON) or None", f"set {name} to e.g. {example}")
    return value


def check_dict_fields(config: Any) -> None:
    """The dict fields, once ``TrainingArguments.__post_init__`` has parsed their JSON strings."""
    _require_dict(config, "chat_template_kwargs", '{"enable_thinking": False}')
    kwargs = _require_dict(config, "dataset_kwargs", '{"skip_prepare_dataset": True}')
    for key in kwargs or {}:
        if key not in DATASET_KWARGS_KEYS:
            fail(config, "dataset_kwargs", kwargs, f"has the key {key!r}; the only key is skip_prepare_dataset "
                 "(as in TRL 1.16)", "remove it")
    if kwargs and not isinstance(kwargs.get("skip_prepare_dataset", False), bool):
        fail(config, "dataset_kwargs", kwargs, "has a non-bool skip_prepare_dataset", "set it to True or False")
    model_kwargs = _require_dict(config, "model_init_kwargs", '{"dtype": "bfloat16"}')
    for key, field_name in _MODEL_KWARGS_OWNED.items():
        if model_kwargs and key in model_kwargs:
            fail(config, "model_init_kwargs", model_kwargs, f"sets {key!r}, which SFTConfig sets itself",
                 f"set SFTConfig.{field_name} instead")
    if model_kwargs and "torch_dtype" in model_kwargs and "dtype" in model_kwargs:
        fail(config, "model_init_kwargs", model_kwargs, "sets both torch_dtype and dtype", "keep dtype only")


def model_load_kwargs(config: Any) -> dict[str, Any]:
    """Keywords for :meth:`FastModel.from_pretrained` when the trainer loads the model from a path.

    TRL's ``torch_dtype`` is transformers' old name of ``dtype``; ``"auto"`` / ``None`` is swiftune's
    default (bf16 on a GPU that has it, else float32)."""
    # both torch_dtype and dtype are refused at construction (check_dict_fields)
    return from_pretrained_kwargs(config.model_init_kwargs, config.trust_remote_code)


def _check_in_vocab(tokenizer: Any, name: str, token: str) -> None:
    if token not in tokenizer.get_vocab():
        raise ConfigError(f"SFTConfig: {name}={token!r} is not in the tokenizer's vocabulary; set {name} to one of "
                          "its tokens, or add it to the tokenizer (and resize the model's embeddings) first")


def apply_tokenizer_fields(config: Any, tokenizer: Any, model: Any) -> None:
    """``chat_template_path``, ``eos_token`` and ``pad_token`` on the tokenizer (and the model's
    configs), as TRL's trainer sets them, before the data is tokenized."""
    path = config.chat_template_path
    if path is not None:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        else:
            from transformers import AutoTokenizer

            source = AutoTokenizer.from_pretrained(path)
            if not getattr(source, "chat_template", None):
                raise ConfigError(f"SFTConfig: chat_template_path={path!r} is a tokenizer without a chat template; "
                                  "give a tokenizer directory that has one, or a .jinja file")
            for token in source.all_special_tokens:
                _check_in_vocab(tokenizer, "chat_template_path (its special token)", token)
            tokenizer.chat_template = source.chat_template
    hf_config = getattr(model, "config", None)
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    generation = getattr(model, "generation_config", None)
    if config.eos_token is not None:
        _check_in_vocab(tokenizer, "eos_token", config.eos_token)
        tokenizer.eos_token = config.eos_token
        if text_config is not None:
            text_config.eos_token_id = tokenizer.eos_token_id
        if generation is not None:  # generation stops at the new EOS as well as the old ones
            old = generation.eos_token_id
            old = [] if old is None else [old] if isinstance(old, int) else list(old)
            if tokenizer.eos_token_id not in old:
                generation.eos_token_id = [tokenizer.eos_token_id, *old]
    if config.pad_token is not None:
        _check_in_vocab(tokenizer, "pad_token", config.pad_token)
        tokenizer.pad_token = config.pad_token
        if text_config is not None:
            text_config.pad_token_id = tokenizer.pad_token_id
        if generation is not None:
            generation.pad_token_id = tokenizer.pad_token_id
