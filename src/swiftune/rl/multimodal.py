"""GRPO with image prompts on a vision-language policy (Qwen3-VL): prompts, rollouts, policy rows.

What differs from text GRPO, and where it is handled:

* **Prompts** (:func:`prompt_messages`, :meth:`VisionGRPO.encode`): conversational ``prompt``
  messages whose content may hold image parts (``{"type": "image", "image": <PIL image or path>}``),
  or TRL's ``image`` / ``images`` columns: an image part without ``"image"`` takes the next image
  of the row, and a prompt with no image part at all gets one placeholder per image at the start of
  its first user message (TRL 1.16's ``prepare_multimodal_messages`` rule). Tokenized by
  :func:`swiftune.data.multimodal.tokenize_multimodal_prompt` (each image's tokens expanded as the
  processor does; ``pixel_values`` / ``image_grid_thw`` from the image processor).
* **Rollouts** (:class:`VisionRolloutEngine`): transformers' own forward and KV cache, as
  :class:`~swiftune.rl.rollout.TransformersRolloutEngine`, several prompts per prefill (left-padded,
  up to ``max_batch_size // G`` prompts): their pixel values go to the vision tower once, each
  row's M-RoPE positions come from the model's own ``get_rope_index`` on its prompt alone, the cache
  is repeated for the ``G`` completions, all rows decode together and every decoded (text) token of
  a row takes the position after its prompt's largest M-RoPE position (transformers' ``rope_deltas``).
  The image placeholder token is never sampled (it would stand for an image the completion does not have).
* **Policy rows** (:meth:`VisionGRPO.policy_row`): the samples ``prompt_i + completion_i`` laid out
  padding-free as :func:`swiftune.rl.policy.build_policy_row` does, plus what
  :class:`swiftune.data.multimodal.MultimodalCollator` adds to image-text rows: 3-D positions from
  ``get_rope_index`` on each sample alone, ``document_ids`` (one per sample: M-RoPE positions
  cannot say where samples start), every sample's pixel values concatenated in order. The row's
  ``model_inputs`` carry them to :func:`swiftune.rl.policy.completion_logprobs`.

  With ``share_prompt`` each group's prompt and its images appear once, followed by its completions
  (:mod:`swiftune.attention.shared_prompt`'s rule, switched on the text decoder's config only): the
  prompt's positions from ``get_rope_index`` on the prompt alone, each completion's continuing after
  the prompt's largest position on all three channels, as ``get_rope_index`` numbers the text tokens
  after the prompt of ``prompt + completion``.

The fast engine for image prompts (static KV cache, CUDA-graph decode) is
:class:`swiftune.rl.rollout.vision_fast.VisionFastRolloutEngine`: the same prefill inputs through the model's
own forward into its static cache, then the text engine's decode step at each row's shifted position.

Not supported (refused): video prompts, plain-string prompts with images.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..data.multimodal import (MultimodalCollator, VisionProcessor, has_image_parts, rope_positions,
                              tokenize_multimodal_prompt, with_image_placeholders)
from ..models.patching import causal_lm_of
from ..models.qwen3_vl import rope_index_of
from ..models.support import controls_attention
from .batching import is_conversational
from .policy import PolicyRow, build_policy_row, group_consecutive
from .rollout import Rollouts, SamplingParams, TransformersRolloutEngine, cache_supports, new_cache
from .rollout.vision_fast import auto_prefill_token_cap, check_prefill_token_cap, split_by_prefill_tokens

#: share of the free CUDA memory one prefill of :class:`VisionRolloutEngine` may take by default
#: (``max_prefill_tokens="auto"``): its KV cache grows with the prefill, unlike the fast engine's static one
PREFILL_MEMORY_SHARE = 0.5


def is_vision_language(model: nn.Module) -> bool:
    """Whether ``model`` (possibly PEFT/DDP-wrapped) is a vision-language model (a ``vision_config``)."""
    return getattr(causal_lm_of(model).config, "vision_config", None) is not None


@dataclass
class VisionPrompt:
    """One tokenized image prompt: ``input_ids`` (image tokens expanded) and its images' inputs."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


def _has_video(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, Mapping) and p.get("type") == "video"
                                                          for p in m["content"]) for m in messages)


def prompt_messages(row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The prompt messages of a dataset row and its images (the row's ``images`` list or ``image``).

    A prompt without any image part but with images gets one ``{"type": "image"}`` placeholder per
    image at the start of its first user message, as TRL does; placeholders are filled in order."""
    prompt = row["prompt"]
    if not is_conversational(prompt):
        if row.get("images") or row.get("image") is not None:
            raise ValueError("image prompts must be conversational: a list of {'role', 'content'} messages with "
                             "image parts (or an 'image' / 'images' column); a plain string prompt has nowhere to "
                             "put images")
        raise ValueError(f"a vision-language policy takes conversational prompts (a list of {{'role', 'content'}} "
                         f"messages, with or without images), got the plain string {prompt!r:.60}: write each "
                         "prompt as [{'role': 'user', 'content': text}] (swiftune grpo's built-in task has plain "
                         "string prompts: give --dataset with conversational ones)")
    if row.get("videos") is not None or row.get("video") is not None or _has_video(prompt):
        raise ValueError("video prompts are not supported in GRPO yet: use image parts")
    images = row.get("images")
    if images is None:
        images = [row["image"]] if row.get("image") is not None else []
    images = list(images)
    messages = [dict(m) for m in prompt]
    if images and not has_image_parts(messages):
        messages = with_image_placeholders(messages, len(images))
    return messages, images


class VisionGRPO:
    """The vision-language pieces a :class:`swiftune.GRPOTrainer` uses on a Qwen3-VL policy.

    Args:
        model: the policy, patched by :func:`swiftune.patch_model` (its text decoder must run
            swiftune's packed attention, which keeps the row's samples apart by ``document_ids``).
        processing_class: a transformers processor (``Qwen3VLProcessor``) or a
            :class:`swiftune.data.VisionProcessor`.
    """

    def __init__(self, model: nn.Module, processing_class: Any):
        if not controls_attention(causal_lm_of(model)):
            raise ValueError("GRPO on a vision-language model needs swiftune's packed attention in its text decoder "
                             "(its policy rows hold several samples): call swiftune.patch_model(model) first")
        self.processor = VisionProcessor.of(processing_class)
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = self.processor.token_id(self.processor.image_token)
        self.rope_index = rope_index_of(model)

    def encode(self, row: Mapping[str, Any], *, max_prompt_length: int | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> VisionPrompt:
        """Tokenize ``row``'s prompt (:func:`prompt_messages`); longer than ``max_prompt_length``:
        the last tokens, unless the cut would split off image tokens (then a ``ValueError``)."""
        messages, images = prompt_messages(row)
        example = tokenize_multimodal_prompt(messages, self.processor, images, **dict(chat_template_kwargs or {}))
        ids = example["input_ids"]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            cut = len(ids) - max_prompt_length
            if self.image_token_id in ids[:cut]:
                raise ValueError(f"an image prompt of {len(ids)} tokens (its images included) is longer than "
                                 f"max_prompt_length={max_prompt_length}, and cutting it would cut an image: raise "
                                 "max_prompt_length (or None), or use smaller images")
            ids = ids[cut:]
        return VisionPrompt(ids, example.get("pixel_values"), example.get("image_grid_thw"))

    def policy_row(self, prompts: Sequence[VisionPrompt], completion_ids: Sequence[Sequence[int]], *,
                   share_prompt: bool = False, group_ids: Sequence[int] | None = None,
                   attention_backend: str = "auto", device: torch.device | str = "cpu",
                   include_last_token: bool = False) -> PolicyRow:
        """One padding-free row of the samples ``prompts[i] + completion_ids[i]`` with their
        M-RoPE positions, ``document_ids`` and pixel values (module doc); with ``share_prompt``
        each group's prompt (and its images) once, followed by its completions."""
        row = build_policy_row([p.input_ids for p in prompts], completion_ids, share_prompt=share_prompt,
                               group_ids=group_ids, attention_backend=attention_backend, device=device,
                               include_last_token=include_last_token)
        if row.layout.shared:
            return self._shared_row(row, prompts, group_ids, device)
        examples = []
        for p, c in zip(prompts, completion_ids):
            inputs = list(c) if include_last_token else list(c)[:-1]  # as build_policy_row lays them out
            example: dict[str, Any] = {"input_ids": list(p.input_ids) + inputs}
            if p.pixel_values is not None:
                example.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
            examples.append(example)
        batch = MultimodalCollator(self.rope_index, self.image_token_id)(examples)
        if not torch.equal(batch["input_ids"].to(row.input_ids.device), row.input_ids):
            raise RuntimeError("the multimodal layout of the policy row differs from its token layout")
        row.position_ids = batch["position_ids"].to(device)  # [3, 1, T]
        inputs = {"document_ids": batch["document_ids"].to(device)}
        if "pixel_values" in batch:
            inputs.update(pixel_values=batch["pixel_values"].to(device), image_grid_thw=batch["image_grid_thw"].to(device))
        row.model_inputs = inputs
        return row

    def _shared_row(self, row: PolicyRow, prompts: Sequence[VisionPrompt], group_ids: Sequence[int] | None,
                    device: torch.device | str) -> PolicyRow:
        """A shared-prompt row (:func:`build_policy_row`'s layout, run by the shared-prompt attention):
        the prompt's positions from ``get_rope_index`` on the prompt alone, every completion's
        continuing after the prompt's largest position on all three channels (what ``get_rope_index``
        gives the text tokens after the prompt of ``prompt + completion``), the prompt's images once."""
        positions = torch.zeros(3, row.num_tokens, dtype=torch.long)
        pixel_values, grids = [], []
        runs = group_consecutive([p.input_ids for p in prompts], group_ids)
        spans = row.spans or []
        for run in runs:
            prompt = prompts[run[0]]
            ps, pe, _, _ = spans[run[0]]
            rope = rope_positions(self.rope_index, torch.tensor(prompt.input_ids), self.image_token_id,
                                  prompt.image_grid_thw)
            positions[:, ps:pe] = rope
            for i in run:
                _, _, cs, ce = spans[i]
                positions[:, cs:ce] = int(rope.max()) + 1 + torch.arange(ce - cs)
            if prompt.pixel_values is not None:
                pixel_values.append(prompt.pixel_values)
                grids.append(prompt.image_grid_thw)
        row.position_ids = positions.unsqueeze(1).to(device)
        inputs: dict[str, torch.Tensor] = {}
        if pixel_values:
            inputs.update(pixel_values=torch.cat(pixel_values).to(device), image_grid_thw=torch.cat(grids).to(device))
        row.model_inputs = inputs  # no document_ids: the row layout says where groups and completions are
        return row

    def generate(self, engine: Any, prompts: Sequence[VisionPrompt], num_generations: int,
                 params: SamplingParams) -> Rollouts:
        """``num_generations`` completions of every image prompt from ``engine`` (a
        :class:`VisionRolloutEngine`, or any engine whose ``generate`` takes ``vision_inputs``)."""
        if not getattr(engine, "accepts_vision_inputs", False):
            raise ValueError(f"the rollout engine {type(engine).__name__} cannot take image prompts: use "
                             "swiftune.rl.multimodal.VisionRolloutEngine or (CUDA graphs) "
                             "swiftune.rl.rollout.vision_fast.VisionFastRolloutEngine, or an engine with "
                             "accepts_vision_inputs = True and generate(..., vision_inputs=)")
        return engine.generate([p.input_ids for p in prompts], num_generations, params, vision_inputs=list(prompts))


class VisionRolloutEngine(TransformersRolloutEngine):
    """:class:`~swiftune.rl.rollout.TransformersRolloutEngine` for image prompts (module doc).

    Prompts are sampled in chunks of ``max_batch_size // num_generations`` prompts (all of a call
    when ``max_batch_size`` is None), as the text engine does, each split further so that its
    left-padded prefill (``rows x longest prompt``, image tokens included) holds at most
    ``max_prefill_tokens`` tokens (:func:`swiftune.rl.rollout.vision_fast.split_by_prefill_tokens`: a
    prompt above the cap alone, logged). A chunk is **one** prefill: its
    prompts left-padded into one batch (padding masked: swiftune's packed attention drops it, each
    row is one document), every prompt's pixel values concatenated in row order (the vision tower
    runs once per chunk, each image alone), each row's M-RoPE positions those of transformers'
    ``get_rope_index`` on that prompt alone. The cache is then repeated for the ``G`` completions and
    all of the chunk's rows decode together, each decoded (text) token at its row's text position
    plus that row's own delta (the prompt's largest M-RoPE position + 1 - its length: transformers'
    ``rope_deltas``) on all three channels. Without ``vision_inputs`` it is the text engine unchanged.

    Args:
        model: the vision-language policy (not copied).
        rope_index: the model's ``get_rope_index`` (:func:`swiftune.models.qwen3_vl.rope_index_of`).
        image_token_id: the image placeholder token.
        pad_token_id, seed, max_batch_size: as :class:`~swiftune.rl.rollout.TransformersRolloutEngine`.
        max_prefill_tokens: most tokens one prefill holds (left padding and, on caches that cannot
            repeat their rows, the ``G`` copies included): a positive int, ``"auto"`` (on CUDA
            :data:`PREFILL_MEMORY_SHARE` of free memory over
            :func:`~swiftune.rl.rollout.vision_fast.prefill_bytes_per_token`; no cap on CPU) or None (no cap).
    """

    accepts_vision_inputs = True

    def __init__(self, model: nn.Module, rope_index: Any, image_token_id: int, pad_token_id: int = 0, seed: int = 0,
                 max_batch_size: int | None = None, max_prefill_tokens: int | str | None = "auto"):
        self.max_prefill_tokens = check_prefill_token_cap(max_prefill_tokens)
        super().__init__(model, pad_token_id=pad_token_id, seed=seed, max_batch_size=max_batch_size)
        self.rope_index = rope_index
        self.image_token_id = int(image_token_id)
        self._chunk: list[VisionPrompt] | None = None  # the prompts being sampled (set only inside generate)
        self._deltas: torch.Tensor | None = None  # each prefilled row's M-RoPE delta (set by its prefill)

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, params: SamplingParams,
                 vision_inputs: Sequence[VisionPrompt] | None = None) -> Rollouts:
        if vision_inputs is None:
            return super().generate(prompt_ids, num_generations, params)
        if len(vision_inputs) != len(prompt_ids):
            raise ValueError(f"{len(vision_inputs)} vision inputs for {len(prompt_ids)} prompts")
        # the text engine's chunking: a chunk of at most this many prompts is one call of the text
        # engine below (which then does not split it again), so its images are known to _forward
        per_chunk = len(prompt_ids) if self.max_batch_size is None else max(1, self.max_batch_size // num_generations)
        cap = (auto_prefill_token_cap(self.model, PREFILL_MEMORY_SHARE) if self.max_prefill_tokens == "auto"
               else self.max_prefill_tokens)
        # caches without batch_repeat_interleave prefill every copy of a prompt (the text engine's rule)
        copies = num_generations if num_generations > 1 and not cache_supports(new_cache(self.model),
                                                                                 "batch_repeat_interleave") else 1
        chunks = [range(a + run.start, a + run.stop) for a in range(0, len(prompt_ids), per_chunk)
                  for run in split_by_prefill_tokens([len(p) for p in prompt_ids[a:a + per_chunk]], cap,
                                                     padded=True, copies=copies)]
        out = Rollouts([], [], [], num_generations)
        try:
            for chunk in chunks:
                self._chunk = list(vision_inputs[chunk.start:chunk.stop])
                one = super().generate(prompt_ids[chunk.start:chunk.stop], num_generations, params)
                out.completion_ids += one.completion_ids
                out.logprobs += one.logprobs
                out.finished += one.finished
                for k, v in one.stats.items():
                    out.stats[k] = out.stats.get(k, 0.0) + v
        finally:
            self._chunk = None
            self._deltas = None
        return out

    def _prefill_inputs(self, chunk: Sequence[VisionPrompt], input_ids: torch.Tensor,
                        attention_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The 3-D positions ``[3, rows, width]`` of a left-padded prefill of ``chunk`` and its
        images' inputs; records each row's M-RoPE delta for :meth:`_first_decode_positions`."""
        rows, width = input_ids.shape
        if rows % len(chunk):
            raise RuntimeError(f"a prefill of {rows} rows for {len(chunk)} image prompts")
        copies = rows // len(chunk)  # 1, or the group size where the older cache API prefills every copy
        device = input_ids.device
        lengths = attention_mask.sum(-1).tolist()
        # padding: position 1 on every channel, as transformers' get_rope_index fills it (never attended)
        positions = torch.ones(3, rows, width, dtype=torch.long)
        deltas = torch.zeros(rows, dtype=torch.long)
        pixel_values, grids = [], []
        for k, prompt in enumerate(chunk):
            first = k * copies
            length = int(lengths[first])
            ids = input_ids[first, width - length:].cpu()
            rope = rope_positions(self.rope_index, ids, self.image_token_id, prompt.image_grid_thw)
            positions[:, first:first + copies, width - length:] = rope.unsqueeze(1)
            deltas[first:first + copies] = int(rope.max()) + 1 - length  # transformers' rope_deltas
            if prompt.pixel_values is not None:  # in row order: the model scatters features by token order
                pixel_values += [prompt.pixel_values] * copies
                grids += [torch.as_tensor(prompt.image_grid_thw)] * copies
        self._deltas = deltas.to(device)
        inputs: dict[str, torch.Tensor] = {}
        if pixel_values:
            inputs.update(pixel_values=torch.cat(pixel_values).to(device), image_grid_thw=torch.cat(grids).to(device))
        return positions.to(device), inputs

    def _first_decode_positions(self, prompt_positions: torch.Tensor) -> torch.Tensor:
        """Each row's first decoded position: its text position shifted by its prompt's delta (the
        rows of a prefilled prompt are repeated consecutively for its group)."""
        first = super()._first_decode_positions(prompt_positions)
        if self._chunk is None or self._deltas is None:
            return first
        return first + self._deltas.repeat_interleave(first.shape[0] // self._deltas.numel()).unsqueeze(1)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        chunk = self._chunk
        if chunk is None:
            return super()._forward(input_ids, attention_mask, position_ids, cache)
        kwargs: dict[str, Any] = {}
        if cache.get_seq_length() == 0:  # prefill: the chunk's images, each prompt's own M-RoPE positions
            position_ids, kwargs = self._prefill_inputs(chunk, input_ids, attention_mask)
        else:  # decoded text tokens: positions already shifted by their rows' deltas, the same on all channels
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_arg: cache}, **kwargs)
        logits = out.logits[:, -1, :]
        # never sample the image placeholder: a completion's image token has no image behind it, and
        # the policy forward of its sample would refuse the token / feature count mismatch
        logits[:, self.image_token_id] = float("-inf")
        return logits
