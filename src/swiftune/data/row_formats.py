"""Row shapes beyond text / prompt-completion / messages, with TRL 1.16's meaning.

* **Pre-tokenized rows** (an ``input_ids`` column): TRL's ``SFTTrainer`` takes them as they are.
  Which tokens are trained (TRL's ``_prepare_dataset``):

  - a ``labels`` column is used as is (``-100`` = not trained); mask columns are then ignored;
  - otherwise an ``assistant_masks`` column always applies, and a ``completion_mask`` column only
    when ``completion_only_loss=True`` (left unset, TRL resolves it from the columns: a
    pre-tokenized dataset has no ``prompt``/``completion``, so the mask is *not* applied; swiftune
    does the same and says so once);
  - neither: every token is trained.

  swiftune's examples carry a 0/1 mask over ``input_ids`` (the target of a trained token is the
  token itself), so a ``labels`` column must hold ``input_ids[t]`` or ``-100`` at every position;
  other targets are refused with what to do instead.
* **formatting_func** (TRL's argument): a function of one row returning the text to train on;
  the rows become plain-text rows. The older batched form (a dict of columns in, a list of
  strings out) is recognised too (:func:`apply_formatting_func`).
* **chat_template_kwargs**: keyword arguments for ``apply_chat_template`` (Qwen3's
  ``enable_thinking``), from the config and per row from a ``chat_template_kwargs`` column (the
  row's keys win), :func:`row_template_kwargs`.

A leaf of the data layer (imports nothing else of swiftune), so :mod:`.formatting` builds on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

IGNORE_LABEL = -100
TOKENIZED_COLUMN = "input_ids"
_FORMAT_BATCH = 1000  # rows per call of a batched formatting_func (datasets.map's default batch size)


class DataFormatError(ValueError):
    """The data cannot be turned into training examples; the message says what to change."""


# ----------------------------------------------------------------------------- chat_template_kwargs


def row_template_kwargs(row: Mapping[str, Any], config_kwargs: Mapping[str, Any] | None, index: int) -> dict:
    """``apply_chat_template`` keywords for one row: the config's, updated by the row's own
    ``chat_template_kwargs`` column (as TRL spreads the row's dict last)."""
    out = dict(config_kwargs or {})
    own = row.get("chat_template_kwargs")
    if own is None:
        return out
    if not isinstance(own, Mapping):
        raise DataFormatError(
            f"row {index}: 'chat_template_kwargs' must be a dict of apply_chat_template keywords (e.g. "
            f"{{'enable_thinking': False}}), got {type(own).__name__}"
        )
    out.update(own)
    return out


# ----------------------------------------------------------------------------- formatting_func


def apply_formatting_func(rows: Sequence[Mapping[str, Any]], func: Callable) -> list[dict[str, str]]:
    """``[{"text": func(row)}]`` for every row (TRL's per-example form).

    The batched form of older TRL versions (``func(batch)`` with ``batch`` a dict of column lists,
    returning one string per row) is recognised when ``func`` of the first row returns a list or
    fails: it is then called on batches of up to 1000 rows.
    """
    if not callable(func):
        raise DataFormatError(f"formatting_func must be a function of one row returning a string, got "
                              f"{type(func).__name__}")
    first = rows[0]
    try:
        probe = func(dict(first))
        per_row_error = None
    except Exception as err:  # noqa: BLE001 - a batched function may fail on a single row; tried below
        probe, per_row_error = None, err
    if isinstance(probe, str):
        texts = [probe] + [func(dict(row)) for row in _rows_from(rows, 1)]
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise DataFormatError(f"formatting_func returned {type(text).__name__} for row {index}; it must "
                                      "return the row's text as a string")
        return [{"text": t} for t in texts]
    texts = _batched_texts(rows, func, probe, per_row_error)
    return [{"text": t} for t in texts]


def _rows_from(rows: Sequence[Mapping[str, Any]], start: int):
    for index in range(start, len(rows)):
        yield rows[index]


def _batched_texts(rows: Sequence[Mapping[str, Any]], func: Callable, probe: Any, error: Exception | None) -> list:
    columns = list(rows[0])
    texts: list = []
    for start in range(0, len(rows), _FORMAT_BATCH):
        chunk = [rows[i] for i in range(start, min(start + _FORMAT_BATCH, len(rows)))]
        batch = {c: [row.get(c) for row in chunk] for c in columns}
        try:
            out = func(batch)
        except Exception as err:  # noqa: BLE001 - neither form works: say what both got
            cause = error or err
            raise DataFormatError(
                "formatting_func failed on one row (TRL's form: a dict row -> its text) and on a batch (the "
                f"older batched form: a dict of column lists -> a list of texts): {type(cause).__name__}: {cause}"
            ) from cause
        if not isinstance(out, list) or len(out) != len(chunk) or not all(isinstance(t, str) for t in out):
            got = type(probe).__name__ if error is None else f"an error ({type(error).__name__}: {error})"
            raise DataFormatError(
                f"formatting_func must return a string for one row (it gave {got}), or, in the batched form, a list "
                f"of one string per row of the batch (it gave {_describe(out)} for {len(chunk)} rows)"
            )
        texts.extend(out)
    return texts


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__


# ----------------------------------------------------------------------------- pre-tokenized rows


def _int_list(value: Any, name: str, index: int) -> list[int]:
    if hasattr(value, "tolist"):  # numpy arrays / tensors from a formatted dataset
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in value):
        raise DataFormatError(f"row {index}: {name!r} must be a list of integers, got {type(value).__name__}")
    return list(value)


def tokenized_examples(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    *,
    completion_only_loss: bool | None,
    assistant_only_loss: bool | None,
    vocab_size: int | None = None,
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, mask)`` of pre-tokenized rows, with TRL's rules of the module doc."""
    has_labels = "labels" in columns
    use_assistant = "assistant_masks" in columns and not has_labels
    use_completion = "completion_mask" in columns and not has_labels and completion_only_loss is True
    if assistant_only_loss and not use_assistant and not has_labels:
        raise DataFormatError(
            "assistant_only_loss=True on pre-tokenized rows needs an 'assistant_masks' column (1 on assistant "
            "tokens) or a 'labels' column (-100 off them); add one, or set assistant_only_loss=False"
        )
    if completion_only_loss and "completion_mask" not in columns and not has_labels:
        raise DataFormatError(
            "completion_only_loss=True on pre-tokenized rows needs a 'completion_mask' column (1 on completion "
            "tokens) or a 'labels' column; add one, or leave completion_only_loss unset"
        )
    if "completion_mask" in columns and not has_labels and completion_only_loss is None:
        logger.warning(
            "the pre-tokenized rows have a 'completion_mask' column, which TRL (and swiftune) apply only with "
            "completion_only_loss=True: every token is trained; set completion_only_loss=True to train on the "
            "completion only"
        )
    out = []
    for index, row in enumerate(rows):
        ids = _int_list(row.get(TOKENIZED_COLUMN), TOKENIZED_COLUMN, index)
        if not ids:
            raise DataFormatError(f"row {index}: 'input_ids' is empty; drop the row or give it tokens")
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise DataFormatError(f"row {index}: token id {bad} in 'input_ids' is outside the tokenizer's "
                                  f"vocabulary (0..{vocab_size - 1}); tokenize with the model's own tokenizer")
        if has_labels:
            mask = _mask_from_labels(ids, _int_list(row.get("labels"), "labels", index), index)
        else:
            mask = [1] * len(ids)
            for name, used in (("assistant_masks", use_assistant), ("completion_mask", use_completion)):
                if used:
                    bits = _int_list(row.get(name), name, index)
                    if len(bits) != len(ids):
                        raise DataFormatError(f"row {index}: {name!r} has {len(bits)} entries for {len(ids)} "
                                              "input_ids; give one 0/1 entry per token")
                    mask = [m & (1 if b else 0) for m, b in zip(mask, bits)]
        out.append((ids, mask))
    return out


def _mask_from_labels(ids: list[int], labels: list[int], index: int) -> list[int]:
    if len(labels) != len(ids):
        raise DataFormatError(f"row {index}: 'labels' has {len(labels)} entries for {len(ids)} input_ids; give one "
                              "label per token (-100 where it is not trained)")
    mask = []
    for t, (token, label) in enumerate(zip(ids, labels)):
        if label == IGNORE_LABEL:
            mask.append(0)
        elif label == token:
            mask.append(1)
        else:
            raise DataFormatError(
                f"row {index}: labels[{t}]={label} differs from input_ids[{t}]={token}; swiftune trains each token "
                "on itself (labels unshifted, as transformers and TRL expect: -100 or the input token); shift-free "
                "labels with other targets are not supported: drop the 'labels' column and give a 0/1 "
                "'completion_mask' (with completion_only_loss=True) instead"
            )
    return mask


def as_is_examples(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[dict[str, list[int]]]:
    """Examples of trainer-ready rows for ``dataset_kwargs={"skip_prepare_dataset": True}``: ``input_ids``
    and ``labels`` taken as they are (no truncation, nothing dropped), as TRL's collator takes them."""
    if TOKENIZED_COLUMN not in columns:
        raise DataFormatError(
            f"dataset_kwargs={{'skip_prepare_dataset': True}} takes trainer-ready rows, but the dataset has columns "
            f"{list(columns)} and no 'input_ids'; tokenize it first (with 'labels', -100 on untrained tokens) or "
            "drop skip_prepare_dataset so that swiftune prepares it"
        )
    if "labels" not in columns and ("completion_mask" in columns or "assistant_masks" in columns):
        raise DataFormatError(
            "the dataset has mask columns but no 'labels', and skip_prepare_dataset=True skips building labels, so "
            "it would train on the full sequence (TRL refuses it too); add a 'labels' column (-100 for untrained "
            "tokens) or drop skip_prepare_dataset"
        )
    pairs = tokenized_examples(rows, [c for c in columns if c in (TOKENIZED_COLUMN, "labels")],
                               completion_only_loss=False, assistant_only_loss=False)
    return [{"input_ids": ids, "completion_mask": mask} for ids, mask in pairs]
