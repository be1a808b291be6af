"""Deprecated alias of swiftune.training.metrics; removed after the next release."""

from ..training.metrics import (  # noqa: F401
    MetricsCallback,
    StepFlops,
    TokenMeter,
    plot_metric,
    read_metrics,
    truncate_metrics,
)
