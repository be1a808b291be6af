"""The data side of a GRPO generation: which prompt rows each generation takes, on which process.

Moved out of :mod:`swiftune.rl.trainer` to keep it short; the trainer imports these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..data import load_rows


class GenerationBatchSampler(torch.utils.data.Sampler):
    """Yields this process's prompt indices for a generation, each batch ``repeats`` times in a row.

    The Trainer draws one batch per micro-step; the trainer uses the batch of the micro-step that
    starts a generation and ignores the repeats, so the data advance one generation at a time.
    Every process sees different prompts (rank ``r`` takes the ``r``-th slice of each global batch).
    """

    def __init__(self, num_rows: int, prompts_per_batch: int, repeats: int, *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1):
        self.num_rows, self.per_batch, self.repeats = num_rows, prompts_per_batch, repeats
        self.seed, self.shuffle, self.rank, self.world = seed, shuffle, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.num_rows // (self.per_batch * self.world)) * self.repeats

    def __iter__(self):
        if self.shuffle:  # epoch e: the (e+1)-th permutation of one generator seeded once, as TRL's RepeatSampler
            g = torch.Generator().manual_seed(self.seed)  # draws them epoch after epoch (here also on resume)
            for _ in range(self.epoch + 1):
                order = torch.randperm(self.num_rows, generator=g).tolist()
        else:
            order = list(range(self.num_rows))
        global_batch = self.per_batch * self.world
        for b in range(self.num_rows // global_batch):
            chunk = order[b * global_batch:(b + 1) * global_batch]
            mine = chunk[self.rank * self.per_batch:(self.rank + 1) * self.per_batch]
            for _ in range(self.repeats):
                yield mine


class EpochLoader(torch.utils.data.DataLoader):
    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


# End-of-turn tokens of common chat templates: stop tokens for conversational prompts when present.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def prompt_rows_of(data: Any, what: str) -> Sequence[Any]:
    """The rows of ``data``, each with a non-empty ``prompt`` (a string or a list of messages); a row
    without one raises a ``ValueError`` naming it here, not when its generation comes."""
    rows = load_rows(data)
    if len(rows) == 0 or "prompt" not in rows[0]:
        raise ValueError(f"{what} rows need a 'prompt' column (a string or a list of messages)")
    # a datasets.Dataset gives the column without reading the other columns' rows
    prompts = rows["prompt"] if hasattr(rows, "column_names") else (row.get("prompt") for row in rows)
    for i, prompt in enumerate(prompts):
        if not (isinstance(prompt, str) or is_conversational(prompt)):
            raise ValueError(f"{what} row {i}: a prompt must be a string or a list of messages (dicts with a "
                             f"'role'), got {type(prompt).__name__} {prompt!r:.80}")
        if not (prompt.strip() if isinstance(prompt, str) else prompt):
            raise ValueError(f"{what} row {i}: the prompt is empty ({prompt!r}); give each row a prompt or drop "
                             "the row")
    return rows


def reward_columns(prompt_rows: Sequence[Any], group_size: int) -> dict[str, list]:
    """The dataset's other columns for the reward functions, one value per completion (each prompt row's
    repeated ``group_size`` times). The columns are those of every row of the generation; a row without
    one gives ``None`` there (plain lists of dicts may differ row to row: the first row's keys alone
    missed later rows' columns, and a later row without one of them raised a ``KeyError``)."""
    names: dict[str, None] = {}
    for row in prompt_rows:
        names.update(dict.fromkeys(k for k in row if k != "prompt"))
    return {k: [row.get(k) for row in prompt_rows for _ in range(group_size)] for k in names}


def prompt_token_ids(tokenizer: Any, prompt: Any, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of one prompt as the policy sees it: a string as it is (no special tokens added), a list
    of messages through the tokenizer's chat template with the generation prompt (and
    ``chat_template_kwargs``)."""
    if is_conversational(prompt):
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise ValueError(f"a prompt must be a string or a list of messages, got {type(prompt).__name__}")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def generation_stop_ids(tokenizer: Any, model: Any, conversational: bool, extra: Any = None) -> list[int]:
    """The token ids that end a completion: the tokenizer's and the model's generation config's end of
    sequence, ``extra`` (``stop_token_ids``), and for conversational prompts the chat template's end of
    turn (:data:`END_OF_TURN_TOKENS` the vocabulary has). A plain-text prompt does not stop at an end of
    turn, as in training on plain prompts."""
    ids = set(as_int_list(tokenizer.eos_token_id))
    ids |= set(as_int_list(getattr(getattr(model, "generation_config", None), "eos_token_id", None)))
    ids |= set(as_int_list(extra))
    if conversational:
        vocab = tokenizer.get_vocab()
        ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    return sorted(ids)


def collate_prompt_rows(rows: list) -> dict[str, list]:
    return {"prompt_rows": list(rows)}


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in prompt)


def as_int_list(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple, set)) else [int(x)]
