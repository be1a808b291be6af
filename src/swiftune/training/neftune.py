"""NEFTune (noisy embeddings, ``neftune_noise_alpha``) with the same noise in every batch layout.

NEFTune adds ``U(-m, m)`` noise to each input embedding while training, ``m = alpha / sqrt(L d)`` for
an embedding width ``d`` and a sequence length ``L``. transformers' hook takes ``L`` from the shape of
the embedded batch: in TRL's default padded batches the longest sequence of the batch. In a
padding-free batch (swiftune's default) the whole batch is one row, so the same hook would take the
total token count for ``L`` and the noise would shrink with the batch size (1/sqrt of it).

:class:`LayoutFreeNEFTune` takes ``L`` from the batch's ``position_ids`` instead (they restart at each
document: the largest plus one is the longest document), so a padding-free or packed batch gets the
noise the padded batch of the same examples gets. Without ``position_ids`` it falls back to the
batch's width, as transformers. The magnitude stays a device tensor: no host sync per micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LayoutFreeNEFTune:
    """A forward hook on the input embeddings adding NEFTune's noise in training mode; call
    :meth:`set_batch` with each micro-batch's inputs before the forward."""

    def __init__(self, model: nn.Module, alpha: float):
        if not (isinstance(alpha, (int, float)) and alpha > 0):
            raise ValueError(f"neftune_noise_alpha must be a number > 0 (e.g. 5), got {alpha!r}")
        self.alpha = float(alpha)
        self.embeddings = model.get_input_embeddings()
        self._longest: torch.Tensor | int | None = None
        self._handle = self.embeddings.register_forward_hook(self._add_noise)

    def set_batch(self, inputs: dict[str, Any]) -> None:
        """The longest document of this micro-batch, from its ``position_ids`` (or its width)."""
        positions = inputs.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.numel():
            self._longest = positions.max() + 1
        else:
            ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
            self._longest = None if ids is None else int(ids.shape[1])

    def _add_noise(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        longest = self._longest if self._longest is not None else output.shape[1]
        if isinstance(longest, torch.Tensor):
            longest = longest.to(device=output.device, dtype=torch.float32)
        magnitude = self.alpha / torch.sqrt(torch.as_tensor(longest, dtype=torch.float32, device=output.device)
                                            * output.shape[-1])
        noise = torch.rand_like(output, dtype=torch.float32).mul_(2).sub_(1).mul_(magnitude)
        return output + noise.to(output.dtype)

    def remove(self) -> None:
        self._handle.remove()
