"""Moved to :mod:`swiftune.training.metrics` (shared by both trainers); kept so imports keep working."""

from ..training.metrics import (  # noqa: F401
    MetricsCallback,
    StepFlops,
    TokenMeter,
    plot_metric,
    read_metrics,
    truncate_metrics,
)
