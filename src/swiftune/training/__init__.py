"""Training runtime shared by the trainers (:mod:`swiftune.sft`, :mod:`swiftune.rl`), which never
import each other: model loading and LoRA adapters (:class:`FastModel`; :class:`FastLanguageModel`
under Unsloth's names; Unsloth's merged saving, :func:`save_pretrained_merged`), offloaded gradient
checkpointing and its host page pool, CUDA-graphed decoder layers, LoRA input casting under autocast,
the trainers' common start-up (:class:`SwiftuneTrainer`), metrics, checkpoints that are complete
before they are visible and resuming from them, the output_dir lock, Ctrl-C handling and the NaN/inf
guards (:class:`RunSafetyMixin`).

Imports only from the layers below it (models, data, losses, attention, kernels, memory).
"""

from .base import SwiftuneTrainer
from .checkpointing import (
    CheckpointBudgetError,
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    offload_stats,
    release_host_memory,
)
from .checkpoints import CheckpointSaveError, newest_complete_checkpoint, resolve_resume
from .guards import NonFiniteError
from .interrupt import TrainingInterrupted
from .layer_graphs import disable_graphed_layers, enable_graphed_layers, graphed_layer_stats
from .loading import FastModel, enable_gradient_checkpointing, ensure_pad_token
from .merged_save import push_to_hub_merged, save_pretrained_merged
from .metrics import MetricsCallback, StepFlops, TokenMeter, read_metrics, truncate_metrics
from .run_lock import RunLock, RunLockedError
from .safety import RunSafetyMixin
from .unsloth_names import FastLanguageModel

__all__ = [
    "CheckpointBudgetError",
    "CheckpointSaveError",
    "FastLanguageModel",
    "FastModel",
    "MetricsCallback",
    "NonFiniteError",
    "RunLock",
    "RunLockedError",
    "RunSafetyMixin",
    "StepFlops",
    "SwiftuneTrainer",
    "TokenMeter",
    "TrainingInterrupted",
    "disable_graphed_layers",
    "disable_offloaded_checkpointing",
    "enable_graphed_layers",
    "enable_gradient_checkpointing",
    "enable_offloaded_checkpointing",
    "ensure_pad_token",
    "graphed_layer_stats",
    "newest_complete_checkpoint",
    "offload_stats",
    "push_to_hub_merged",
    "read_metrics",
    "release_host_memory",
    "resolve_resume",
    "save_pretrained_merged",
    "truncate_metrics",
]
