"""Turn user data into tokenized training examples with a per-token completion mask.

Input: a ``datasets.Dataset`` (any object with ``column_names`` that yields dict rows), a list of
dicts, a dict of columns, or a path to a ``.jsonl``/``.json``/``.parquet`` file.
Row shapes (TRL's names):

* ``text`` (or ``text_field``): language modelling, every token trained, EOS appended.
* ``prompt`` + ``completion``: strings, concatenated token-wise (prompt tokens, then completion
  tokens, then EOS); or conversational lists of messages rendered with the chat template.
  Completion-only loss by default (``completion_only_loss=None`` means on).
* ``messages``: a conversation rendered with the chat template; only assistant turns trained by
  default (``assistant_only_loss=None`` means on).
* ``input_ids`` (pre-tokenized, optionally ``labels`` / ``assistant_masks`` / ``completion_mask``):
  TRL's rules, :mod:`swiftune.data.row_formats`, which also applies ``formatting_func`` and the
  chat template kwargs. Files are read by :mod:`swiftune.data.row_files`.

Output: :class:`TokenizedDataset`, a torch ``Dataset`` of ``{"input_ids": list[int],
"completion_mask": list[int]}`` (1 = the token is a training target) plus
:class:`FormattingStats` (truncated / dropped counts, token totals).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from swiftune.data.chat_templates import marked_template_for
from swiftune.data.row_files import load_rows
from swiftune.data.row_formats import (
    TOKENIZED_COLUMN,
    DataFormatError,
    apply_formatting_func,
    as_is_examples,
    row_template_kwargs,
    tokenized_examples,
)

logger = logging.getLogger(__name__)

DataShape = Literal["text", "prompt_completion", "messages", "tokenized"]
TruncationMode = Literal["keep_start", "keep_end"]
Truncation = Literal["truncate", "error", "drop"]

_ACCEPTED_SHAPES = (
    "'{text}' (plain text), 'prompt' + 'completion' (strings or lists of messages), "
    "'messages' (a list of {{'role', 'content'}} dicts), or pre-tokenized 'input_ids'"
)
_TOKENIZE_CHUNK = 1024  # rows per fast-tokenizer call: batching is much faster than one by one

# Roles chat templates know: OpenAI's (with developer), the older function role and Llama 3.1's ipython.
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")
_ROLE_HINTS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant",
               "chatgpt": "assistant", "observation": "tool"}


@dataclass
class FormattingStats:
    """What :func:`prepare_dataset` did; also logged as warnings where rows were changed."""

    data_shape: str
    num_rows: int = 0
    num_examples: int = 0
    num_truncated: int = 0
    num_dropped_too_long: int = 0
    num_dropped_no_trained_tokens: int = 0
    num_tokens: int = 0
    num_trained_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TokenizedDataset(torch.utils.data.Dataset):
    """Tokenized examples (``input_ids``, ``completion_mask``) and the stats of their making."""

    def __init__(self, examples: list[dict[str, list[int]]], stats: FormattingStats):
        self.examples = examples
        self.stats = stats

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]

    @property
    def lengths(self) -> list[int]:
        """Token count of every example, for packing and token-budget batching."""
        return [len(e["input_ids"]) for e in self.examples]


def _column_names(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    names = getattr(rows, "column_names", None) if not isinstance(rows, list) else None
    return list(names) if names is not None else list(rows[0])


def detect_shape(columns: Iterable[str], text_field: str = "text") -> DataShape:
    """Which row shape the columns describe: ``input_ids`` (pre-tokenized, as TRL checks it first),
    then ``messages``, which wins over ``prompt``/``completion``."""
    columns = list(columns)
    if TOKENIZED_COLUMN in columns:
        return "tokenized"
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if text_field in columns:
        return "text"
    hint = ""
    if "prompt" in columns:
        hint = " A 'prompt' column alone is GRPO data; SFT also needs 'completion'."
    elif "conversations" in columns:
        hint = " ShareGPT-style 'conversations' must be renamed to 'messages' with role/content keys."
    elif {"instruction", "output"} <= set(columns):
        hint = " Alpaca-style data: map 'instruction' (+ 'input') to 'prompt' and 'output' to 'completion'."
    raise DataFormatError(
        f"dataset has columns {columns}; swiftune accepts {_ACCEPTED_SHAPES.format(text=text_field)}."
        f"{hint}"
    )


# ----------------------------------------------------------------------------- tokenizing


def _tokenize_texts(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    ids: list[list[int]] = []
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        chunk = texts[start : start + _TOKENIZE_CHUNK]
        ids.extend(tokenizer(chunk, add_special_tokens=add_special_tokens)["input_ids"])
    return ids


def _column(rows: Sequence[Mapping], name: str, kind: type | tuple[type, ...] = str) -> list:
    """Values of column ``name``; a missing or wrongly typed value names its row."""
    values = []
    for index, row in enumerate(rows):
        value = row.get(name)
        if not isinstance(value, kind):
            raise DataFormatError(
                f"row {index}: {name!r} must be {_kind_name(kind)}, got {type(value).__name__}"
                + (f" (the row has keys {sorted(row)})" if value is None else "")
            )
        values.append(value)
    return values


def check_messages(messages: Any, where: str) -> None:
    """Raise :class:`DataFormatError` naming ``where`` (e.g. ``"row 3: 'messages'"``) and the message
    unless ``messages`` is a list of ``{"role", "content"}`` dicts with known roles
    (:data:`KNOWN_ROLES`) and string (or content-part list) contents; ``content`` may be null only
    on an assistant message with ``tool_calls``."""
    if not isinstance(messages, list):
        raise DataFormatError(f"{where} must be a list of messages, got {type(messages).__name__}")
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataFormatError(
                f"{where}: message {k} is {type(message).__name__}, not a {{'role': ..., 'content': ...}} dict")
        role = message.get("role")
        if role not in KNOWN_ROLES:
            hint = f"; {role!r} is written {_ROLE_HINTS[role]!r}" if isinstance(role, str) and role in _ROLE_HINTS \
                else ""
            what = "has no 'role'" if role is None else f"has the unknown role {role!r}"
            raise DataFormatError(
                f"{where}: message {k} {what}; roles are {', '.join(KNOWN_ROLES)}{hint} (ShareGPT data: map "
                "'from'/'value' with human -> user, gpt -> assistant)"
            )
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            state = "null" if "content" in message else "missing"
            raise DataFormatError(
                f"{where}: message {k} ({role}) has content {state}; give every message a string content "
                "(\"\" if it is empty; rows whose completion / assistant turns are all empty are dropped)"
            )
        if content is not None and not isinstance(content, (str, list)):
            raise DataFormatError(
                f"{where}: message {k} ({role}) has content of type {type(content).__name__}; it must be a string "
                "(or a list of content parts)"
            )


def _is_empty_turn(message: Mapping) -> bool:
    """A message with nothing in it: empty content and no tool calls."""
    return message.get("content") in ("", []) and not message.get("tool_calls")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({str: "a string", list: "a list of messages"}.get(k, k.__name__) for k in kinds)


def _with_eos(ids: list[int], eos_id: int | None) -> list[int]:
    if eos_id is None or (ids and ids[-1] == eos_id):
        return ids
    return ids + [eos_id]


def _require_eos(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise DataFormatError(
            "the tokenizer has no eos_token; text and prompt/completion examples end with EOS so "
            "the model learns to stop: set tokenizer.eos_token"
        )
    return tokenizer.eos_token_id


def _require_chat_template(tokenizer: Any, why: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataFormatError(
            f"{why} need a chat template, and this tokenizer has none: load the instruct model's "
            "tokenizer, set tokenizer.chat_template (e.g. ChatML), or give the data as plain "
            "'prompt'/'completion' strings"
        )


def _render_chat(tokenizer: Any, messages: list, **kwargs: Any) -> dict[str, list[int]]:
    # return_dict=True keeps one output type across transformers versions.
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return {k: list(v) for k, v in out.items()}


def _chat_kwargs(row: Mapping, template_kwargs: Mapping[str, Any] | None, index: int) -> dict[str, Any]:
    """``apply_chat_template`` keywords of one row: its ``tools`` and the chat template kwargs."""
    return {"tools": row.get("tools"), **row_template_kwargs(row, template_kwargs, index)}


def _has_generation_markers(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", "")
    return "generation" in template and "endgeneration" in template


def _text_examples(rows: Sequence[Mapping], tokenizer: Any, text_field: str) -> list[tuple[list[int], list[int]]]:
    eos = _require_eos(tokenizer)
    texts = _column(rows, text_field)
    out = []
    for ids in _tokenize_texts(tokenizer, texts, add_special_tokens=True):
        ids = _with_eos(ids, eos)
        out.append((ids, [1] * len(ids)))
    return out


def _prompt_completion_examples(
    rows: Sequence[Mapping], tokenizer: Any, completion_only: bool, template_kwargs: Mapping[str, Any] | None = None,
    assistant_only: bool = False,
) -> list[tuple[list[int], list[int]]]:
    # The first row decides between plain strings and conversational lists, for every row.
    kind = list if isinstance(rows[0].get("prompt"), list) else str
    prompt_texts, completion_texts = _column(rows, "prompt", kind), _column(rows, "completion", kind)
    if kind is list:
        for index, (p, c) in enumerate(zip(prompt_texts, completion_texts)):
            check_messages(p, f"row {index}: 'prompt'")
            check_messages(c, f"row {index}: 'completion'")
        examples = [
            _conversational_prompt_completion(tokenizer, p, c, _chat_kwargs(r, template_kwargs, i), completion_only)
            for i, (p, c, r) in enumerate(zip(prompt_texts, completion_texts, rows))
        ]
        if not assistant_only:
            return examples
        # TRL: the assistant mask of the whole conversation, ANDed with the completion mask
        use_markers = _has_generation_markers(tokenizer)
        marked = None if use_markers else marked_template_for(tokenizer)
        out = []
        for i, ((ids, mask), p, c, r) in enumerate(zip(examples, prompt_texts, completion_texts, rows)):
            assistant_ids, assistant = _messages_example(tokenizer, {"messages": list(p) + list(c)}, True, use_markers,
                                                         _chat_kwargs(r, template_kwargs, i), marked)
            if assistant_ids != ids:
                raise DataFormatError(f"row {i}: the assistant tokens could not be located in the conversation; "
                                      "add {% generation %} markers to the chat template, or pass "
                                      "assistant_only_loss=False")
            out.append((ids, [int(m and a) for m, a in zip(mask, assistant)]))
        return out
    if assistant_only:
        logger.warning("assistant_only_loss applies to conversational rows; ignored for plain-text prompt/completion "
                       "rows (as TRL)")
    eos = _require_eos(tokenizer)
    # Prompt and completion are tokenized apart and concatenated: the boundary is exact and the
    # completion tokens are those the model would generate after seeing the prompt tokens.
    prompts = _tokenize_texts(tokenizer, prompt_texts, add_special_tokens=True)
    completions = _tokenize_texts(tokenizer, completion_texts, add_special_tokens=False)
    out = []
    for prompt_ids, completion_ids in zip(prompts, completions):
        # an empty completion has nothing to learn but the EOS appended to it: no trained token (dropped)
        trained = 1 if completion_ids or not completion_only else 0
        completion_ids = _with_eos(completion_ids, eos)
        mask = [0 if completion_only else 1] * len(prompt_ids) + [trained] * len(completion_ids)
        out.append((prompt_ids + completion_ids, mask))
    return out


def _conversational_prompt_completion(
    tokenizer: Any, prompt: list, completion: list, chat: dict, completion_only: bool
) -> tuple[list[int], list[int]]:
    _require_chat_template(tokenizer, "conversational prompt/completion rows")
    prompt_ids = _render_chat(tokenizer, prompt, add_generation_prompt=True, **chat)["input_ids"]
    ids = _render_chat(tokenizer, list(prompt) + list(completion), **chat)["input_ids"]
    if ids[: len(prompt_ids)] != prompt_ids:
        raise DataFormatError(
            "the chat template renders the prompt differently once the completion is appended, so "
            "the completion tokens cannot be located; use a template whose prompt rendering "
            "(add_generation_prompt=True) is a prefix of the full conversation"
        )
    n = len(prompt_ids)
    trained = 0 if completion_only and all(_is_empty_turn(m) for m in completion) else 1  # empty: dropped
    return ids, [0 if completion_only else 1] * n + [trained] * (len(ids) - n)


def _messages_example(tokenizer: Any, row: Mapping, assistant_only: bool, use_markers: bool,
                      chat: dict, marked: str | None = None) -> tuple[list[int], list[int]]:
    messages = row["messages"]
    if not assistant_only:
        ids = _render_chat(tokenizer, messages, **chat)["input_ids"]
        return ids, [1] * len(ids)
    if use_markers:
        out = _render_chat(tokenizer, messages, return_assistant_tokens_mask=True, **chat)
        ids, mask = out["input_ids"], out["assistant_masks"]
    elif marked is not None:  # swiftune's marked equivalent of the tokenizer's template (chat_templates)
        out = _render_chat(tokenizer, messages, return_assistant_tokens_mask=True, chat_template=marked, **chat)
        ids, mask = out["input_ids"], out["assistant_masks"]
        if ids != _render_chat(tokenizer, messages, **chat)["input_ids"]:
            raise DataFormatError(
                "this conversation renders differently under swiftune's marked copy of the tokenizer's chat "
                "template (swiftune.data.chat_templates) than under the template itself; add {% generation %} "
                "markers to the tokenizer's template, or pass assistant_only_loss=False to train on every token"
            )
    else:
        ids, mask = _assistant_mask_by_prefixes(tokenizer, messages, chat)
    if all(_is_empty_turn(m) for m in messages if m.get("role") == "assistant"):
        mask = [0] * len(ids)  # only empty assistant turns (their end-of-turn tokens are not content): dropped
    return ids, mask


def _assistant_mask_by_prefixes(tokenizer: Any, messages: list, chat: dict) -> tuple[list[int], list[int]]:
    """Assistant-turn mask for templates without ``{% generation %}`` markers.

    For assistant turn ``i``: the tokens between the rendering of ``messages[:i]`` with the
    generation prompt and the rendering of ``messages[:i+1]`` are that turn. This needs the
    template to be prefix-stable (rendering more messages only appends), which ChatML, Llama 3
    and most templates are; when it is not, the error says what to do.
    """
    ids = _render_chat(tokenizer, messages, **chat)["input_ids"]
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start_ids = _render_chat(tokenizer, messages[:i], add_generation_prompt=True, **chat)["input_ids"]
        end_ids = _render_chat(tokenizer, messages[: i + 1], **chat)["input_ids"]
        if ids[: len(start_ids)] != start_ids or ids[: len(end_ids)] != end_ids:
            raise DataFormatError(
                "cannot locate assistant turns: the chat template is not prefix-stable and has no "
                "{% generation %} markers; add the markers around assistant content, or pass "
                "assistant_only_loss=False to train on every token"
            )
        mask[len(start_ids) : len(end_ids)] = [1] * (len(end_ids) - len(start_ids))
    return ids, mask


def _check_flags(shape: DataShape, completion_only_loss: bool | None, assistant_only_loss: bool | None) -> None:
    if shape == "tokenized":  # the mask columns decide: row_formats.tokenized_examples checks them
        return
    if completion_only_loss and shape != "prompt_completion":
        logger.warning("completion_only_loss applies to prompt/completion data; ignored for %r data", shape)
    if assistant_only_loss and shape not in ("messages", "prompt_completion"):
        logger.warning("assistant_only_loss applies to 'messages' data; ignored for %r data", shape)


def prepare_dataset(
    data: Any,
    tokenizer: Any,
    *,
    max_length: int | None = 1024,
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool | None = None,
    truncation: Truncation = "truncate",
    text_field: str = "text",
    truncation_mode: TruncationMode = "keep_start",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    formatting_func: Callable | None = None,
    skip_prepare: bool = False,
) -> TokenizedDataset:
    """Tokenize ``data`` into examples ``{"input_ids", "completion_mask"}`` ready for a collator.

    Args:
        data: a ``datasets.Dataset``, a list of dicts, a dict of columns, or a
            ``.jsonl``/``.json``/``.parquet`` path.
        tokenizer: a transformers tokenizer (a chat template is needed for conversational data).
        max_length: longest example in tokens; ``None`` keeps every example whole.
        completion_only_loss: train only completion tokens of prompt/completion rows
            (``None``: yes); on pre-tokenized rows, apply their ``completion_mask`` (``None``: no, as TRL).
        assistant_only_loss: train only assistant turns of ``messages`` rows (``None``: yes).
            Uses the template's ``{% generation %}`` markers when present, else swiftune's marked
            copy of a known template that is not prefix-stable (Qwen3's, :mod:`.chat_templates`),
            else prefix renderings.
        truncation: for examples longer than ``max_length``: ``"truncate"`` cuts them to
            ``max_length`` tokens (counted, warned), ``"error"`` raises, ``"drop"`` skips them.
        text_field: the column of plain-text rows (TRL's ``dataset_text_field``).
        truncation_mode: which tokens ``"truncate"`` keeps: the first (``"keep_start"``) or the last
            (``"keep_end"``) ``max_length``, TRL's ``truncation_mode``.
        chat_template_kwargs: keywords for ``apply_chat_template`` (e.g. ``enable_thinking``); a
            row's own ``chat_template_kwargs`` column updates them.
        formatting_func: TRL's: a function of one row returning its text (or the batched form);
            the rows become plain text. Ignored, with a warning, on pre-tokenized rows (as TRL).
        skip_prepare: TRL's ``skip_prepare_dataset``: the rows are trainer-ready (``input_ids``,
            optional ``labels``) and are taken as they are, untruncated.

    Pre-tokenized rows (an ``input_ids`` column) follow TRL's rules (:mod:`.row_formats`).
    Examples left with no trained token (besides the first, which has no context) are dropped
    with a warning; all of them dropped is an error.
    """
    if truncation not in ("truncate", "error", "drop"):
        raise ValueError(f"truncation must be 'truncate', 'error' or 'drop', got {truncation!r}")
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end', got {truncation_mode!r}")
    rows = load_rows(data)
    if len(rows) == 0:
        raise DataFormatError(
            "the dataset is empty (0 rows); check the path, split or filter that produced it"
        )
    columns = _column_names(rows)
    if skip_prepare:
        examples = as_is_examples(rows, columns)
        stats = FormattingStats(data_shape="tokenized", num_rows=len(rows), num_examples=len(examples),
                                num_tokens=sum(len(e["input_ids"]) for e in examples),
                                num_trained_tokens=sum(sum(e["completion_mask"][1:]) for e in examples))
        return TokenizedDataset(examples, stats)
    if formatting_func is not None:
        if TOKENIZED_COLUMN in columns:
            logger.warning("the dataset is already tokenized (it has 'input_ids'): formatting_func is ignored, as TRL "
                           "does; remove formatting_func or pass rows that are not tokenized")
        else:
            rows, text_field = apply_formatting_func(rows, formatting_func), "text"
            columns = ["text"]
    shape = detect_shape(columns, text_field)
    _check_flags(shape, completion_only_loss, assistant_only_loss)

    if shape == "tokenized":
        pairs = tokenized_examples(rows, columns, completion_only_loss=completion_only_loss,
                                   assistant_only_loss=assistant_only_loss, vocab_size=len(tokenizer))
    elif shape == "text":
        pairs = _text_examples(rows, tokenizer, text_field)
    elif shape == "prompt_completion":
        # assistant_only_loss=None stays off here (TRL's default, False): only messages rows default to on
        pairs = _prompt_completion_examples(rows, tokenizer, completion_only_loss is not False, chat_template_kwargs,
                                            assistant_only=bool(assistant_only_loss))
    else:
        _require_chat_template(tokenizer, "'messages' rows")
        assistant_only = assistant_only_loss is not False
        use_markers = _has_generation_markers(tokenizer)
        # a template that is not prefix-stable (Qwen3's) gets swiftune's equivalent with markers
        marked = marked_template_for(tokenizer) if assistant_only and not use_markers else None
        for index, messages in enumerate(_column(rows, "messages", list)):
            check_messages(messages, f"row {index}: 'messages'")
        pairs = [_messages_example(tokenizer, r, assistant_only, use_markers, _chat_kwargs(r, chat_template_kwargs, i),
                                   marked)
                 for i, r in enumerate(rows)]

    stats = FormattingStats(data_shape=shape, num_rows=len(rows))
    examples: list[dict[str, list[int]]] = []
    for index, (ids, mask) in enumerate(pairs):
        if max_length is not None and len(ids) > max_length:
            if truncation == "error":
                raise DataFormatError(
                    f"row {index} has {len(ids)} tokens, more than max_length={max_length}; raise "
                    "max_length, or pass truncation='truncate' (keep the start) or 'drop'"
                )
            if truncation == "drop":
                stats.num_dropped_too_long += 1
                continue
            cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, mask = ids[cut], mask[cut]
            stats.num_truncated += 1
        # The first token is never a target (nothing precedes it), so it does not count.
        trained = sum(mask[1:])
        if trained == 0:
            stats.num_dropped_no_trained_tokens += 1
            continue
        examples.append({"input_ids": list(ids), "completion_mask": [int(m) for m in mask]})
        stats.num_tokens += len(ids)
        stats.num_trained_tokens += trained
    stats.num_examples = len(examples)
    _report(stats, max_length)
    return TokenizedDataset(examples, stats)


def _report(stats: FormattingStats, max_length: int | None) -> None:
    if stats.num_truncated:
        logger.warning(
            "%d of %d rows were longer than max_length=%s and were truncated (pass "
            "truncation='drop' or 'error', or raise max_length, to avoid it)",
            stats.num_truncated, stats.num_rows, max_length,
        )
    if stats.num_dropped_too_long:
        logger.warning(
            "%d of %d rows were longer than max_length=%s and were dropped",
            stats.num_dropped_too_long, stats.num_rows, max_length,
        )
    if stats.num_dropped_no_trained_tokens:
        logger.warning(
            "%d of %d rows had no trained tokens (empty completion or assistant turns, or all cut "
            "off by max_length=%s) and were dropped",
            stats.num_dropped_no_trained_tokens, stats.num_rows, max_length,
        )
    if stats.num_examples == 0:
        raise DataFormatError(
            f"no example is left to train on out of {stats.num_rows} rows "
            f"({stats.num_dropped_too_long} too long, {stats.num_dropped_no_trained_tokens} with no "
            "trained tokens); raise max_length, or check that completions / assistant turns are not empty"
        )
