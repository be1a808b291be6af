"""Image-text SFT data for vision-language models (Qwen3-VL): tokenizing and padding-free batches.

Rows are chat ``messages`` whose ``content`` may be a list of parts, ``{"type": "text", "text":
...}`` and ``{"type": "image", "image": <PIL image or path>}`` (an image part without ``"image"``
takes the next entry of the row's ``images`` column, TRL's layout). Each example becomes:

* ``input_ids``: the chat rendered by the tokenizer's chat template, every image written as
  ``<|vision_start|><|image_pad|><|vision_end|>`` and its ``<|image_pad|>`` expanded to the number
  of language-model tokens of that image (``t * h * w / merge_size**2`` of its patch grid), as
  Qwen3-VL's processor does;
* ``completion_mask``: 1 on the assistant turns' text (completion-only loss), 0 on the prompt,
  the image tokens and the template's markup;
* ``pixel_values`` (``[patches, C * T * p * p]``) and ``image_grid_thw`` (``[images, 3]``) from the
  image processor.

:class:`MultimodalCollator` puts examples in one padding-free row (or, given ``max_length``,
in best-fit-decreasing packed rows padded to the longest): ``pixel_values`` concatenated in
token order, ``image_grid_thw`` likewise, the 3-D M-RoPE ``position_ids [3, B, S]`` computed by
the model's own ``get_rope_index`` on each example alone and then concatenated, and
``document_ids [B, S]``, which tell swiftune's packed attention where each example starts
(:mod:`swiftune.models.qwen3_vl`); M-RoPE positions cannot, since image tokens make them jump.
Image tokens count in every token budget: an example's length is its expanded token count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swiftune.data.collators import IGNORE_INDEX
from swiftune.data.formatting import DataFormatError, FormattingStats, TokenizedDataset
from swiftune.data.packing import pack_best_fit
from swiftune.data.row_files import load_rows

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"

#: ``FormattingStats.data_shape`` of image-text examples (packed by the collator, never by ``pack_dataset``).
MULTIMODAL_SHAPE = "messages_multimodal"

#: ``get_rope_index(input_ids [1, L], mm_token_type_ids [1, L], image_grid_thw=...) -> (positions [3, 1, L], _)``
RopeIndex = Callable[..., tuple[torch.Tensor, Any]]


@dataclass
class VisionProcessor:
    """What tokenizing image-text rows needs: the tokenizer (with the vision special tokens and a
    chat template) and an image processor (Qwen2-VL's: ``patch_size``, ``merge_size``). A
    transformers processor (``Qwen3VLProcessor``) converts with :meth:`of`."""

    tokenizer: Any
    image_processor: Any
    image_token: str = IMAGE_TOKEN
    vision_start_token: str = VISION_START_TOKEN
    vision_end_token: str = VISION_END_TOKEN

    @classmethod
    def of(cls, processor: Any) -> VisionProcessor:
        """``processor`` itself, or the tokenizer and image processor of a transformers processor."""
        if isinstance(processor, cls):
            return processor
        tokenizer, image_processor = getattr(processor, "tokenizer", None), getattr(processor, "image_processor", None)
        if tokenizer is None or image_processor is None:
            raise TypeError(f"image-text rows need a processor with a tokenizer and an image processor (e.g. "
                            f"Qwen3VLProcessor, or swiftune.data.VisionProcessor), got {type(processor).__name__}")
        return cls(tokenizer, image_processor, getattr(processor, "image_token", IMAGE_TOKEN),
                   getattr(processor, "vision_start_token", VISION_START_TOKEN),
                   getattr(processor, "vision_end_token", VISION_END_TOKEN))

    def token_id(self, token: str) -> int:
        ids = self.tokenizer.convert_tokens_to_ids([token])
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if not ids or ids[0] is None or (unk is not None and ids[0] == unk):
            raise DataFormatError(f"the tokenizer has no {token!r} token; add the vision special tokens "
                                  f"({self.vision_start_token}, {self.vision_end_token}, {self.image_token})")
        return int(ids[0])

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 2))

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """The tokenizer's and the image processor's files, as a transformers processor saves them (what
        the trainers' checkpoints and the commands' final save call)."""
        self.tokenizer.save_pretrained(save_directory, **kwargs)
        self.image_processor.save_pretrained(save_directory, **kwargs)


def text_tokenizer_of(processing_class: Any) -> Any:
    """The tokenizer of a vision-language processor (a :class:`VisionProcessor` or a transformers processor
    with a tokenizer and an image processor), for text-only rows and prompts; a tokenizer as it is."""
    inner = getattr(processing_class, "tokenizer", None)
    if inner is not None and getattr(processing_class, "image_processor", None) is not None:
        return inner
    return processing_class


def _is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image"


def is_multimodal_rows(data: Any) -> bool:
    """Whether ``data``'s first row is chat ``messages`` with an image part (or an ``images`` column)."""
    if data is None or isinstance(data, TokenizedDataset):
        return False
    try:
        rows = load_rows(data)
        row = rows[0] if len(rows) else None
    except Exception:
        return False
    if not isinstance(row, Mapping) or "messages" not in row:
        return False
    if row.get("images"):
        return True
    return has_image_parts(row["messages"])


def _open_image(image: Any) -> Any:
    if isinstance(image, (str, bytes)) or hasattr(image, "__fspath__"):  # a path: Pillow opens it
        from PIL import Image

        image = Image.open(image)
    return image.convert("RGB") if hasattr(image, "convert") else image


def has_image_parts(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(_is_image_part(p) for p in m["content"])
               for m in messages if isinstance(m, Mapping))


def with_image_placeholders(messages: Sequence[Mapping[str, Any]], count: int) -> list[dict[str, Any]]:
    """``messages`` with ``count`` ``{"type": "image"}`` parts at the start of the first user message, as
    TRL places a row's ``images`` column when its messages have no image part."""
    out = [dict(m) for m in messages]
    users = [i for i, m in enumerate(out) if m.get("role") == "user"]
    if not users:
        raise DataFormatError("the row has images but its messages have no user message to put them in")
    first = out[users[0]]
    content = first.get("content")
    parts = content if isinstance(content, list) else [{"type": "text", "text": str(content or "")}]
    first["content"] = [{"type": "image"} for _ in range(count)] + list(parts)
    return out


def _flatten_messages(messages: Sequence[Mapping[str, Any]], row_images: list, proc: VisionProcessor
                      ) -> tuple[list[dict[str, str]], list[Any]]:
    """Messages with string content (each image as its placeholder) and the images in order. A row whose
    messages have no image part gets its ``images`` before the first user message's text (TRL's layout);
    images the parts leave unused are an error, not dropped."""
    if row_images and not has_image_parts(messages):
        messages = with_image_placeholders(messages, len(row_images))
    images: list[Any] = []
    spare = iter(row_images)
    placeholder = proc.vision_start_token + proc.image_token + proc.vision_end_token
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            pieces = []
            for part in content:
                if _is_image_part(part):
                    image = part.get("image")
                    if image is None:
                        image = next(spare, None)
                    if image is None:
                        raise DataFormatError("an image part has no 'image' and the row's 'images' column has no "
                                              "image left for it")
                    images.append(_open_image(image))
                    pieces.append(placeholder)
                elif isinstance(part, Mapping) and part.get("type") == "text":
                    pieces.append(str(part.get("text", "")))
                else:
                    raise DataFormatError(f"unsupported content part {part!r}: use {{'type': 'text', 'text': ...}} "
                                          "or {'type': 'image', 'image': <PIL image or path>}")
            content = "".join(pieces)
        flat.append({"role": message["role"], "content": str(content)})
    unused = len(list(spare))
    if unused:
        raise DataFormatError(f"the row's 'images' column has {len(row_images)} images but its messages' image parts "
                              f"take {len(row_images) - unused}: give one {{'type': 'image'}} part per image, or none "
                              "(then every image goes before the first user message's text)")
    return flat, images


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _assistant_spans(tokenizer: Any, messages: list[dict[str, str]], full: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in ``full``: each turn is what rendering it adds to the
    conversation before it with the generation prompt (its text and end-of-turn token; trailing
    whitespace of the template left out)."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], add_generation_prompt=True) if k else ""
        upto = _render(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataFormatError("the chat template renders a conversation's earlier turns differently once later "
                                  "turns follow, so the assistant turns cannot be located for the completion-only "
                                  "loss; use a template whose renderings are prefixes of each other")
        end = len(before) + len(upto[len(before):].rstrip())
        spans.append((len(before), end))
    return spans


def tokenize_multimodal_row(row: Mapping[str, Any], processor: Any, completion_only_loss: bool = True) -> dict:
    """One image-text ``messages`` row -> ``input_ids``, ``completion_mask``, and (with images)
    ``pixel_values`` and ``image_grid_thw`` (the module docstring has the layout)."""
    proc = VisionProcessor.of(processor)
    tokenizer = proc.tokenizer
    messages, images = _flatten_messages(row["messages"], list(row.get("images") or []), proc)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataFormatError("an image-text SFT row needs an assistant turn to train on")
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = _assistant_spans(tokenizer, messages, full)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    trained = [int(any(a <= s and e <= b and e > s for a, b in spans)) for s, e in offsets]
    if not completion_only_loss:
        trained = [1] * len(ids)
    ids, trained, example = expand_image_tokens(ids, trained, images, proc)
    image_id = proc.token_id(proc.image_token)
    example["input_ids"] = ids
    example["completion_mask"] = [0 if t == image_id else m for t, m in zip(ids, trained)]
    return example


def expand_image_tokens(ids: list[int], mask: list[int], images: list, proc: VisionProcessor
                        ) -> tuple[list[int], list[int], dict[str, Any]]:
    """Expand each ``<|image_pad|>`` of ``ids`` to its image's token count (``t * h * w /
    merge_size**2``, as Qwen3-VL's processor does); ``mask`` follows with 0 on image tokens.
    Returns ``(ids, mask, {"pixel_values", "image_grid_thw"})`` (an empty dict without images)."""
    image_id = proc.token_id(proc.image_token)
    if not images:
        if image_id in ids:
            raise DataFormatError(f"the text contains {proc.image_token} but the row has no image for it")
        return list(ids), list(mask), {}
    out = proc.image_processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    counts = (grid.prod(-1) // proc.merge_size**2).tolist()
    if ids.count(image_id) != len(counts):
        raise DataFormatError(f"the rendered chat has {ids.count(image_id)} {proc.image_token} tokens for "
                              f"{len(counts)} images (does the text itself contain the image token?)")
    expanded_ids, expanded_mask, n = [], [], iter(counts)
    for token, m in zip(ids, mask):
        if token == image_id:
            count = next(n)
            expanded_ids.extend([image_id] * count)
            expanded_mask.extend([0] * count)
        else:
            expanded_ids.append(token)
            expanded_mask.append(m)
    return expanded_ids, expanded_mask, {"pixel_values": out["pixel_values"], "image_grid_thw": grid}


def tokenize_multimodal_prompt(messages: Sequence[Mapping[str, Any]], processor: Any, images: Sequence[Any] = (),
                               **chat_template_kwargs: Any) -> dict[str, Any]:
    """A conversational prompt with image parts (GRPO) -> ``input_ids`` (chat template with the
    generation prompt, image tokens expanded), and with images ``pixel_values`` / ``image_grid_thw``.
    An image part without ``"image"`` takes the next entry of ``images``."""
    proc = VisionProcessor.of(processor)
    flat, opened = _flatten_messages(messages, list(images), proc)
    text = proc.tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True, **chat_template_kwargs)
    ids = list(proc.tokenizer(text, add_special_tokens=False)["input_ids"])
    ids, _, example = expand_image_tokens(ids, [0] * len(ids), opened, proc)
    example["input_ids"] = ids
    return example


def prepare_multimodal_dataset(data: Any, processor: Any, *, max_length: int | None = None,
                               completion_only_loss: bool = True) -> TokenizedDataset:
    """Tokenize every image-text row (:func:`tokenize_multimodal_row`). An example longer than
    ``max_length`` is cut at ``max_length`` when no image token lies past the cut (the images stay
    whole), else dropped (an image cannot be cut); examples left with no trained token are dropped.
    Both are counted in the returned stats."""
    rows = load_rows(data)
    stats = FormattingStats(MULTIMODAL_SHAPE, num_rows=len(rows))
    examples = []
    for row in rows:
        example = tokenize_multimodal_row(row, processor, completion_only_loss)
        if max_length is not None and len(example["input_ids"]) > max_length:
            image_id = VisionProcessor.of(processor).token_id(VisionProcessor.of(processor).image_token)
            if image_id in example["input_ids"][max_length:]:
                stats.num_dropped_too_long += 1
                continue
            example["input_ids"] = example["input_ids"][:max_length]
            example["completion_mask"] = example["completion_mask"][:max_length]
            stats.num_truncated += 1
        if not sum(example["completion_mask"][1:]):
            stats.num_dropped_no_trained_tokens += 1
            continue
        examples.append(example)
        stats.num_tokens += len(example["input_ids"])
        stats.num_trained_tokens += sum(example["completion_mask"][1:])
    stats.num_examples = len(examples)
    if not examples:
        raise DataFormatError(f"no image-text example is left to train on ({stats.as_dict()})")
    return TokenizedDataset(examples, stats)


def rope_positions(rope_index: RopeIndex, ids: torch.Tensor, image_token_id: int,
                   image_grid_thw: Any = None) -> torch.Tensor:
    """The 3-D M-RoPE positions ``[3, L]`` of one example ``ids [L]`` alone, from the model's own
    ``get_rope_index`` (text only: the plain positions on all three channels)."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1).cpu()
    if image_grid_thw is None:
        return torch.arange(ids.shape[1]).view(1, -1).expand(3, -1)
    positions, _ = rope_index(ids, (ids == image_token_id).int(), image_grid_thw=torch.as_tensor(image_grid_thw).cpu())
    return positions[:, 0]


@dataclass
class MultimodalCollator:
    """Padding-free (``max_length=None``: one row) or packed rows of image-text examples.

    Args:
        rope_index: the model's own M-RoPE index function (``Qwen3VLModel.get_rope_index``),
            run on each example alone.
        image_token_id: the image placeholder token (``mm_token_type_ids`` 1 there).
        max_length: pack examples best-fit decreasing into rows of at most this many tokens.
        pad_token_id: fills packed rows' padding (never attended by real tokens nor trained).
    """

    rope_index: RopeIndex
    image_token_id: int
    max_length: int | None = None
    pad_token_id: int | None = None

    def _example(self, example: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.as_tensor(example["input_ids"], dtype=torch.long).unsqueeze(0)
        positions = rope_positions(self.rope_index, ids[0], self.image_token_id,
                                   example.get("image_grid_thw")).unsqueeze(1)
        mask = example.get("completion_mask")
        labels = ids.clone() if mask is None else torch.where(torch.as_tensor(mask).bool(), ids[0], IGNORE_INDEX)[None]
        labels[0, 0] = IGNORE_INDEX  # its shifted prediction would come from the previous document
        return ids[0], labels[0], positions[:, 0].to(torch.long)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not examples:
            raise ValueError("cannot collate an empty list of examples")
        if self.max_length is None:
            rows = [list(range(len(examples)))]
        else:
            rows = pack_best_fit([len(e["input_ids"]) for e in examples], self.max_length)
        built = [[self._example(examples[i]) for i in row] for row in rows]
        width = max(sum(len(ids) for ids, _, _ in row) for row in built)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        batch_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.arange(width).view(1, 1, -1).repeat(3, len(rows), 1)
        document_ids = torch.empty((len(rows), width), dtype=torch.long)
        pixel_values, grids, row_tokens, doc = [], [], [], 0
        for r, (row, parts) in enumerate(zip(rows, built)):
            start = 0
            for i, (ids, lab, pos) in zip(row, parts):
                end = start + len(ids)
                batch_ids[r, start:end], labels[r, start:end], positions[:, r, start:end] = ids, lab, pos
                document_ids[r, start:end] = doc
                doc += 1
                if examples[i].get("pixel_values") is not None:  # token order: row by row, example by example
                    pixel_values.append(torch.as_tensor(examples[i]["pixel_values"]))
                    grids.append(torch.as_tensor(examples[i]["image_grid_thw"]))
                start = end
            document_ids[r, start:] = doc  # the row's padding is a document of its own
            doc += 1
            row_tokens.append(start)
        batch: dict[str, Any] = {
            "input_ids": batch_ids, "labels": labels, "position_ids": positions, "document_ids": document_ids,
            "row_tokens": torch.tensor(row_tokens, dtype=torch.long),
        }
        if pixel_values:
            batch["pixel_values"] = torch.cat(pixel_values)
            batch["image_grid_thw"] = torch.cat(grids)
        num_tokens = sum(row_tokens)
        batch["num_trained_tokens"] = int((labels != IGNORE_INDEX).sum())
        batch["num_tokens"] = num_tokens
        batch["num_padding_tokens"] = labels.numel() - num_tokens
        return batch


def multimodal_processor(processing_class: Any, data: Any) -> VisionProcessor | None:
    """The :class:`VisionProcessor` to tokenize ``data`` with when its rows are image-text
    ``messages`` (:func:`is_multimodal_rows`), else ``None`` (text rows keep the text path)."""
    if not is_multimodal_rows(data):
        return None
    return VisionProcessor.of(processing_class)


def make_multimodal_collator(mode: str, rope_index: RopeIndex, processor: Any, *, max_length: int | None = None
                             ) -> MultimodalCollator:
    """The collator of image-text examples for batch layout ``mode``: ``"padding_free"`` (one row)
    or ``"packed"`` (rows of ``max_length``). ``"padded"`` is refused: it is what a model without
    swiftune's packed attention gets, and its images' positions would then need the model to
    compute M-RoPE per padded row, which this collator does not lay out."""
    proc = VisionProcessor.of(processor)
    if mode == "padded":
        raise ValueError("image-text rows are batched padding-free or packed, which needs swiftune's packed "
                         "attention in the model (swiftune.patch_model on a supported vision-language model); "
                         "padded image-text batches are not supported yet")
    if mode not in ("padding_free", "packed"):
        raise ValueError(f"unknown batch mode {mode!r}; choose 'padding_free' or 'packed'")
    if mode == "packed" and max_length is None:
        raise ValueError("packed batches need max_length (the row length)")
    return MultimodalCollator(rope_index, proc.token_id(proc.image_token),
                              max_length if mode == "packed" else None, proc.tokenizer.pad_token_id)


def load_vision_processor(path: str, **kwargs: Any) -> Any:
    """The processor of a vision-language checkpoint: transformers' ``AutoProcessor`` where it
    loads, else (e.g. Qwen3-VL's video processor needs torchvision, which is not installed) a
    :class:`VisionProcessor` of its tokenizer and image processor, enough for image-text SFT."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(path, **kwargs)
        if getattr(processor, "tokenizer", None) is not None and getattr(processor, "image_processor", None):
            return processor
    except (ImportError, OSError, ValueError, TypeError, AttributeError):
        pass
    try:
        image_processor = AutoImageProcessor.from_pretrained(path, **kwargs)
    except ImportError:  # transformers 5.1x without torchvision: the Auto class refuses, the named class loads
        import transformers
        from transformers.image_processing_base import ImageProcessingMixin

        config, _ = ImageProcessingMixin.get_image_processor_dict(path, **kwargs)
        name = str(config.get("image_processor_type", "")).removesuffix("Fast")
        if not hasattr(transformers, name):
            raise
        image_processor = getattr(transformers, name).from_pretrained(path, **kwargs)
    return VisionProcessor(AutoTokenizer.from_pretrained(path, **kwargs), image_processor)
