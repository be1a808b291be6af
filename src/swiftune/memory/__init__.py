"""Memory: predict what fits before training (:func:`plan_memory`, :func:`max_tokens`, ``swiftune plan``).

The planner is pure Python over a model's config; the offloaded checkpointing and tiled MLP that
it models live in :mod:`swiftune.models.checkpointing` and :mod:`swiftune.models.tiled_mlp`.
See docs/memory.md for the formulas.
"""

from .cli import main_plan
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
    "main_plan",
    "max_tokens",
    "model_shape",
    "param_count",
    "plan_memory",
    "step_reserve",
]
