"""Training runtime shared by the trainers (:mod:`swiftune.sft`, :mod:`swiftune.rl`), which never
import each other: metrics, checkpoints that are complete before they are visible and resuming
from them, the output_dir lock, Ctrl-C handling and the NaN/inf guards (:class:`RunSafetyMixin`).

Imports only from the layers below it (models, data, losses, attention, kernels, memory).
"""

from .checkpoints import CheckpointSaveError, newest_complete_checkpoint, resolve_resume
from .guards import NonFiniteError
from .interrupt import TrainingInterrupted
from .metrics import MetricsCallback, StepFlops, TokenMeter, read_metrics, truncate_metrics
from .run_lock import RunLock, RunLockedError
from .safety import RunSafetyMixin

__all__ = [
    "CheckpointSaveError",
    "MetricsCallback",
    "NonFiniteError",
    "RunLock",
    "RunLockedError",
    "RunSafetyMixin",
    "StepFlops",
    "TokenMeter",
    "TrainingInterrupted",
    "newest_complete_checkpoint",
    "read_metrics",
    "resolve_resume",
    "truncate_metrics",
]
