"""Shared test helpers."""

import torch
from transformers import TrainerCallback


class KillAt(TrainerCallback):
    """Stops training at the end of ``step`` as a killed process would (after that step's checkpoint)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt("simulated kill")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative norm error in float64; NaN/inf anywhere yields inf, so it never passes."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().clamp_min(1e-30)
    return float((a - e).norm() / denom)
