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

* **Prefill token cap** (``max_prefill_tokens``): a chunk of ``max_batch_size // G`` prompts (or
  what the KV cache allows) is split further so that each prefill holds at most that many tokens
  (text and image tokens, :func:`split_by_prefill_tokens`): a chunk's prompt count says nothing of
  its images, and a few large images make one prefill's activations (and the vision tower's) far
  larger than its KV cache. The default (``"auto"``) is :func:`auto_prefill_token_cap`: on CUDA, the
  share of free memory the KV cache leaves (``1 - memory_fraction``) over
  :func:`prefill_bytes_per_token`; on CPU no cap. Both vision engines use these helpers.

Sampling, stop tokens / strings, LoRA (runtime or merged), the cache and the CUDA graphs are
:class:`~swiftune.rl.rollout.fast.FastRolloutEngine`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ...attention.kv_cache import ROLLOUT_KWARG
from ...data.multimodal import rope_positions
from ...losses import free_gpu_bytes
from ...memory.shapes import model_shape
from ...models.patching import causal_lm_of
from ...models.qwen3_vl import text_config_of
from .fast import FastRolloutEngine
from .kv_cache import DecodeContext, Workspace
from .protocol import Rollouts, SamplingParams

logger = logging.getLogger(__name__)

#: the vision-language model types this engine runs (a Qwen3 or Qwen3-MoE text decoder behind a vision tower)
VISION_FAST_TYPES = ("qwen3_vl", "qwen3_vl_moe")


# ---------------------------------------------------------------------- the prefill token cap
def check_prefill_token_cap(value: Any) -> int | str | None:
    """``max_prefill_tokens`` as given, or a ``ValueError`` saying what it may be."""
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"max_prefill_tokens must be a positive number of tokens, 'auto' (from free GPU memory) or "
                     f"None (no cap: chunks of max_batch_size // num_generations prompts), got {value!r}")


def prefill_bytes_per_token(config: Any, itemsize: int) -> int:
    """An upper estimate of the working set one prefilled token adds (no grad, one layer at a time).

    Text decoder: the residual stream, its normed copy and the attention output (``3 h``), the
    projections ``q``, ``k``, ``v`` and the attention's output (``2 q + 2 kv``), the MLP's gate, up and
    activation (``3 I``, ``I`` the width a token goes through: ``k * I_e`` in a sparse layer, plus the
    ``k`` routed copies of the token and their outputs, ``2 k h``). Every token is counted as if it
    were an image token as well: its ``merge**2`` vision patches through a vision block (the block's
    input, normed copy, qkv, attention output: ``6 d``; the MLP: ``2 I_v``) and its deepstack features
    (one ``out_hidden`` per deepstack merger); counting every token so keeps the estimate an upper one
    whatever the share of image tokens. The KV cache and the sampled logits are not in it (the
    engines size those themselves)."""
    s = model_shape(config)
    per = 3 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + 3 * s.active_intermediate
    if s.is_moe:
        per += 2 * s.experts_per_token * s.hidden
    if s.vision is not None:
        v = s.vision
        per += v.patches_per_token * (6 * v.hidden + 2 * v.intermediate) + v.deepstack * v.out_hidden
    return per * itemsize


def auto_prefill_token_cap(model: nn.Module, memory_share: float) -> int | None:
    """The default cap on one prefill's tokens: ``memory_share`` of the free CUDA memory over
    :func:`prefill_bytes_per_token` (at least one token); ``None`` (no cap) off CUDA, where free
    memory is not what limits a chunk."""
    param = next(model.parameters())
    if param.device.type != "cuda":
        return None
    free = free_gpu_bytes(param.device)
    config = causal_lm_of(model).config
    per_token = prefill_bytes_per_token(config, max(param.element_size(), 2))  # quantised weights: bf16 activations
    return max(1, int(free * memory_share) // per_token)


def prefill_tokens(lengths: Sequence[int], *, padded: bool, copies: int = 1) -> int:
    """The tokens of one prefill of prompts of ``lengths``: packed (their sum) or left-padded
    (``rows x longest``), each prompt prefilled ``copies`` times."""
    if not lengths:
        return 0
    return copies * (len(lengths) * max(lengths) if padded else sum(lengths))


def split_by_prefill_tokens(lengths: Sequence[int], cap: int | None, *, padded: bool,
                            copies: int = 1) -> list[range]:
    """Consecutive runs of the prompts of ``lengths`` (in order), each prefill at most ``cap``
    tokens (:func:`prefill_tokens`); a prompt above the cap by itself is a run alone (logged). No
    cap: one run."""
    if cap is None or not lengths:
        return [range(len(lengths))] if lengths else []
    runs: list[range] = []
    start = 0
    for i in range(1, len(lengths) + 1):
        if i < len(lengths) and prefill_tokens(lengths[start:i + 1], padded=padded, copies=copies) <= cap:
            continue
        runs.append(range(start, i))
        start = i
    for run in runs:
        alone = prefill_tokens(lengths[run.start:run.stop], padded=padded, copies=copies)
        if alone > cap:
            logger.warning("swiftune: an image prompt of %d tokens (%d prefill tokens with its copies) is above "
                           "max_prefill_tokens=%d: prefilled alone; raise max_prefill_tokens (or use smaller "
                           "images) if it runs out of memory", lengths[run.start], alone, cap)
    return runs


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
        max_prefill_tokens: most tokens (text and image, each prompt once, or once per completion
            without ``share_prompt_prefill``) one prefill holds: a positive int, ``"auto"``
            (:func:`auto_prefill_token_cap` of the memory the KV cache leaves) or None (no cap).
        pad_token_id, seed, **kwargs: as :class:`FastRolloutEngine`.
    """

    accepts_vision_inputs = True
    workspace_class = VisionWorkspace

    def __init__(self, model: nn.Module, rope_index: Any, image_token_id: int, pad_token_id: int = 0,
                 seed: int = 0, max_prefill_tokens: int | str | None = "auto", **kwargs: Any):
        self.max_prefill_tokens = check_prefill_token_cap(max_prefill_tokens)  # before anything else runs
        super().__init__(model, pad_token_id=pad_token_id, seed=seed, **kwargs)
        self.rope_index = rope_index
        self.image_token_id = int(image_token_id)
        self._prefill_cap: int | None = None  # this call's cap (max_prefill_tokens resolved by generate)
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
        self._prefill_cap = (auto_prefill_token_cap(self.model, max(0.0, 1.0 - self.memory_fraction))
                             if self.max_prefill_tokens == "auto" else self.max_prefill_tokens)
        try:
            return super().generate(prompt_ids, num_generations, params)
        finally:
            self._pending = []
            self._prefill_cap = None

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], n: int, params: Any,
                        stops: tuple[str, ...]) -> tuple[list[list[int]], list[torch.Tensor], list[bool], int]:
        """The base engine's chunk (its prompt count and KV cache fit), split further into prefills of
        at most this call's cap of tokens (:func:`split_by_prefill_tokens`), run one after another."""
        copies = 1 if self.share_prompt_prefill else n
        runs = split_by_prefill_tokens([len(p) for p in prompts], self._prefill_cap, padded=False, copies=copies)
        ids: list[list[int]] = []
        lps: list[torch.Tensor] = []
        done: list[bool] = []
        steps = 0
        for run in runs:  # in prompt order: each prefill takes its prompts' image inputs from the front
            one = super()._generate_chunk(prompts[run.start:run.stop], n, params, stops)
            ids += one[0]
            lps += one[1]
            done += one[2]
            steps += one[3]
        return ids, lps, done, steps

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
