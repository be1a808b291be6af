"""Memory: predict what fits before training (:func:`plan_memory`, :func:`max_tokens`).

The planner is pure Python over a model's config: it imports neither torch nor any other part of
swiftune, so that any layer may ask it what fits (the offloaded checkpointing and the tiled MLP
that it models import it, not the other way round). Its command line is ``swiftune plan``
(:mod:`swiftune.cli.plan`). See docs/memory.md for the formulas.
"""

from .planner import (
    MemoryPlan,
    TrainSetup,
    auto_tile_tokens,
    layer_working_set,
    max_tokens,
    plan_memory,
    step_reserve,
)
from .shapes import KNOWN_MODELS, ModelShape, lora_param_count, model_shape, param_count

__all__ = [
    "KNOWN_MODELS",
    "MemoryPlan",
    "ModelShape",
    "TrainSetup",
    "auto_tile_tokens",
    "layer_working_set",
    "lora_param_count",
    "max_tokens",
    "model_shape",
    "param_count",
    "plan_memory",
    "step_reserve",
]
