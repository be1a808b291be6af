"""swiftune: fast, memory-lean fine-tuning of large language models.

    import swiftune
    model, tokenizer = swiftune.FastModel.from_pretrained(path, max_seq_length=4096)
    model = swiftune.FastModel.get_peft_model(model, r=16, lora_alpha=16)
    swiftune.SFTTrainer(model=model, args=swiftune.SFTConfig(...), train_dataset=..., processing_class=tokenizer)

An Unsloth script switches with ``from swiftune import FastLanguageModel`` (Unsloth's loader names).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from . import kernels, losses  # noqa: E402,F401  (the light base layers)

# Heavier entry points (transformers' Trainer, PEFT) load on first use.
_LAZY = {
    "FastModel": "swiftune.training",
    "FastLanguageModel": "swiftune.training",
    "patch_model": "swiftune.models",
    "unpatch_model": "swiftune.models",
    "SFTConfig": "swiftune.sft",
    "SFTTrainer": "swiftune.sft",
    "GRPOConfig": "swiftune.rl",
    "GRPOTrainer": "swiftune.rl",
    "rl": "swiftune.rl",
    "plan_memory": "swiftune.memory",
    "max_tokens": "swiftune.memory",
    "memory": "swiftune.memory",
    "attention": "swiftune.attention",
    "models": "swiftune.models",
    "data": "swiftune.data",
    "sft": "swiftune.sft",
    "training": "swiftune.training",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__.endswith("." + name) else getattr(module, name)
    raise AttributeError(f"module 'swiftune' has no attribute {name!r}")


__all__ = ["FastLanguageModel", "FastModel", "GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer", "kernels", "losses",
           "patch_model", "plan_memory", "unpatch_model"]
