"""``VisionFastRolloutEngine``: the fast rollout engine for image prompts on Qwen3-VL.

A Qwen3-VL rollout is one multimodal prefill, then text-only decoding:

* **Prefill** (:meth:`VisionFastRolloutEngine.prefill`): the model's own multimodal forward
  (``Qwen3VLModel``: the vision tower on the chunk's images, their embeddings put at the image
  placeholder tokens, deepstack features added to the first decoder layers, 3-D M-RoPE positions)
  over one packed, padding-free row of the chunk's distinct prompts, each prompt's positions those
  of the model's own ``get_rope_index`` on it alone. The text decoder's attention is the engine's
  (``"swiftune_rollout"``, switched on the text config only), so the forward writes every prompt's
  K/V straight into the rows of the engine's static cache of its ``G`` completions, as the text
  engine's packed prefill does.
* **Decode** (:meth:`FastRolloutEngine.decode_one`, the graph-capturable step): a decoded token is
  text, and transformers gives it the M-RoPE position ``text position + rope delta`` (the delta: the
  prompt's largest M-RoPE position + 1 - its length) on all three channels. With equal channels the
  interleaved M-RoPE tables are the plain RoPE tables at that position (its frequencies are split
  between the channels, each frequency rotated by its channel's position; tested in
  tests/test_vl_fast_rollout.py), so the decode step is the text engine's step on the text decoder,
  with each row's rotary position shifted by its delta (a per-row buffer of the workspace, moved
  with the row when finished rows leave the batch). The KV slot stays the text position.
* The image placeholder token is never sampled (its logit is ``-inf`` before sampling, as in
  :class:`swiftune.rl.multimodal.VisionRolloutEngine`): it would stand for an image the completion
  does not have.

Sampling, stop tokens / strings, LoRA (runtime or merged), the cache and the CUDA graphs are
:class:`~swiftune.rl.rollout.fast.FastRolloutEngine`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ...attention.kv_cache import ROLLOUT_KWARG
from ...data.multimodal import rope_positions
from ...models.qwen3_vl import text_config_of
from .fast import FastRolloutEngine
from .kv_cache import DecodeContext, Workspace
from .protocol import Rollouts, SamplingParams

#: the vision-language model types this engine runs (a Qwen3 or Qwen3-MoE text decoder behind a vision tower)
VISION_FAST_TYPES = ("qwen3_vl", "qwen3_vl_moe")


class ImagePrompt(Protocol):
    """What the engine reads of a tokenized image prompt (:class:`swiftune.rl.multimodal.VisionPrompt`)."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


class VisionWorkspace(Workspace):
    """:class:`Workspace` plus each row's M-RoPE delta (``rope_delta [rows]``), a per-row field:
    views and compaction carry it with the row."""

    ROW_FIELDS = (*Workspace.ROW_FIELDS, "rope_delta")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.rope_delta = torch.zeros(self.rows, dtype=torch.long, device=self.tok.device)


class VisionFastRolloutEngine(FastRolloutEngine):
    """:class:`FastRolloutEngine` for image prompts on Qwen3-VL (module docstring).

    Args:
        model: the vision-language policy (``Qwen3VLForConditionalGeneration``, PEFT-wrapped or not;
            patched by :func:`swiftune.patch_model` for the fused layer loop; not copied).
        rope_index: the model's ``get_rope_index`` (:func:`swiftune.models.qwen3_vl.rope_index_of`).
        image_token_id: the image placeholder token (never sampled).
        pad_token_id, seed, **kwargs: as :class:`FastRolloutEngine`.
    """

    accepts_vision_inputs = True
    workspace_class = VisionWorkspace

    def __init__(self, model: nn.Module, rope_index: Any, image_token_id: int, pad_token_id: int = 0,
                 seed: int = 0, **kwargs: Any):
        super().__init__(model, pad_token_id=pad_token_id, seed=seed, **kwargs)
        self.rope_index = rope_index
        self.image_token_id = int(image_token_id)
        self._pending: list[ImagePrompt | None] = []  # the image inputs of the prompts not prefilled yet, in order
        self._prefill_inputs: dict[str, torch.Tensor] | None = None  # the prefill's 3-D positions and images

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, params: SamplingParams,
                 vision_inputs: Sequence[ImagePrompt | None] | None = None) -> Rollouts:
        """``num_generations`` completions of every prompt; ``vision_inputs[i]`` holds prompt ``i``'s
        images (``None``, or no ``vision_inputs`` at all: a text prompt, M-RoPE = plain positions)."""
        vision = list(vision_inputs) if vision_inputs is not None else [None] * len(prompt_ids)
        if len(vision) != len(prompt_ids):
            raise ValueError(f"{len(vision)} vision inputs for {len(prompt_ids)} prompts")
        # the base engine prefills its chunks in prompt order: each prefill takes its prompts' inputs from the front
        self._pending = vision
        try:
            return super().generate(prompt_ids, num_generations, params)
        finally:
            self._pending = []

    # ------------------------------------------------------------------ prefill
    def prefill(self, ws: Workspace, ctx: DecodeContext, prompts: Sequence[Sequence[int]], n: int) -> torch.Tensor:
        """The text engine's packed prefill, its forward the model's multimodal one (:meth:`_hidden`):
        the chunk's images and each prompt's own M-RoPE positions; records each row's delta."""
        vision, self._pending = self._pending[:len(prompts)], self._pending[len(prompts):]
        for p, v in zip(prompts, vision):
            if v is not None and list(v.input_ids) != list(p):
                raise RuntimeError("the image inputs of a prefill are not its prompts'")
        device = ws.tok.device
        copies = 1 if self.share_prompt_prefill else n  # the packed row holds each prompt once, or once per row
        positions, deltas, pixel_values, grids = [], [], [], []
        for p, v in zip(prompts, vision):
            grid = v.image_grid_thw if v is not None else None
            rope = rope_positions(self.rope_index, torch.tensor(list(p)), self.image_token_id, grid)
            positions += [rope] * copies
            deltas.append(int(rope.max()) + 1 - len(p))  # transformers' rope_deltas
            if v is not None and v.pixel_values is not None:  # in token order, as the model scatters the features
                pixel_values += [v.pixel_values] * copies
                grids += [torch.as_tensor(v.image_grid_thw)] * copies
        ws.rope_delta.copy_(torch.tensor(deltas, dtype=torch.long).repeat_interleave(n).to(device))
        inputs = {"position_ids": torch.cat(positions, dim=1)[:, None].to(device)}  # [3, 1, T]
        if pixel_values:
            inputs.update(pixel_values=torch.cat(pixel_values).to(device), image_grid_thw=torch.cat(grids).to(device))
        self._prefill_inputs = inputs
        try:
            return super().prefill(ws, ctx, prompts, n)
        finally:
            self._prefill_inputs = None

    # ------------------------------------------------------------------ the model forward
    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor, ctx: DecodeContext) -> torch.Tensor:
        """Prefill: the multimodal model's own forward (vision tower, placeholder scatter, deepstack,
        M-RoPE) with the engine's attention; decode: the text step at each row's shifted position."""
        if ctx.mode == "decode":  # [3, B, 1]: the rotary module of transformers 5.17 takes 3-D positions only
            return super()._hidden(ids, (pos + ctx.ws.rope_delta[:, None]).expand(3, -1, -1), ctx)
        if self._prefill_inputs is None:
            raise RuntimeError("a VisionFastRolloutEngine prefill runs inside prefill() only")
        ctx.masks = {}
        out = self._hf().model(input_ids=ids, use_cache=False, **self._prefill_inputs, **{ROLLOUT_KWARG: ctx})
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super()._logits(hidden)
        logits[:, self.image_token_id] = float("-inf")  # never sample the image placeholder (module docstring)
        return logits

    def _parts(self):
        hf = self._hf()
        if hf.config.model_type not in VISION_FAST_TYPES:
            raise ValueError(f"VisionFastRolloutEngine runs {VISION_FAST_TYPES}, not {hf.config.model_type!r}: use "
                             "swiftune.rl.multimodal.VisionRolloutEngine (GRPOConfig(rollout_engine='transformers'))")
        return hf, hf.model.language_model

    def _decoder_config(self):
        return text_config_of(self._hf().config)
