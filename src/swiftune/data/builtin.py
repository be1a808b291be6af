"""Built-in tiny assets: a byte-level tokenizer, tiny model configs and an instruction dataset.

Everything here is built by the project with no download, deterministically, so that tests
and the no-argument ``swiftune sft`` run work on a machine without network access.

* :func:`build_tokenizer`: 256 byte tokens (id = byte value, no BPE merges: merges learned by a
  trainer could change between ``tokenizers`` versions, and byte-level tokens make the built-in
  character tasks easy to learn), special tokens ``<|endoftext|>`` (eos), ``<|im_start|>``,
  ``<|im_end|>`` and optionally ``<|pad|>``, plus a Qwen-style ChatML chat template whose
  assistant turns are wrapped in ``{% generation %}`` so ``return_assistant_tokens_mask`` works.
* :func:`tiny_model_config`: random-init configs of a few families, sized for CPU tests.
* :func:`builtin_instruction_dataset`: a few hundred templated instruction rows, simple enough
  that a tiny model visibly learns them (its loss falls) in a short CPU run.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Literal

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"

#: Token ids of the built-in tokenizer: bytes are 0..255, then the special tokens. The pad
#: token comes last so the other ids are the same with and without it.
EOS_TOKEN_ID = 256
IM_START_TOKEN_ID = 257
IM_END_TOKEN_ID = 258
PAD_TOKEN_ID = 259

#: Longest sequence the tiny tokenizer and models declare (``model_max_length``,
#: ``max_position_embeddings``). Overridable per call.
BUILTIN_MAX_LENGTH = 2048

#: ChatML (Qwen-style). Assistant content and its closing ``<|im_end|>`` sit inside
#: ``{% generation %}`` so they are the tokens ``return_assistant_tokens_mask`` marks: the model
#: learns to end its turn. The newline after ``<|im_end|>`` belongs to the template, not the turn.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet the ByteLevel pre-tokenizer uses."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _byte_level_tokenizer(with_pad_token: bool) -> Tokenizer:
    """A ``tokenizers`` byte-level BPE model with no merges: every byte is one token."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    # use_regex=False: with no merges the pre-tokenizer's word splitting changes nothing, so skip it.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN] + ([PAD_TOKEN] if with_pad_token else [])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def build_tokenizer(
    with_pad_token: bool = True, model_max_length: int = BUILTIN_MAX_LENGTH
) -> transformers.PreTrainedTokenizerFast:
    """Build the built-in byte-level tokenizer (no download, deterministic).

    Vocabulary: ids 0..255 are the bytes, 256 ``<|endoftext|>`` (eos), 257 ``<|im_start|>``,
    258 ``<|im_end|>`` and, when ``with_pad_token``, 259 ``<|pad|>``. Without a pad token the
    tokenizer stands for the many real tokenizers that lack one (tests of the errors).
    Its ChatML template supports ``add_generation_prompt`` and ``return_assistant_tokens_mask``.
    """
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_tokenizer(with_pad_token),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN if with_pad_token else None,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


# Architecture knobs shared by every family: GQA with 4 query heads and 2 key/value heads of
# dimension 32, so that heads * head_dim == hidden_size (some families assume it).
_COMMON_SIZES: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)

_CONFIG_CLASSES: dict[str, str] = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma": "GemmaConfig",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
}

# Per-family extras: Gemma 2/3 scale queries by query_pre_attn_scalar (256 by default, meant for
# head_dim 256) and alternate sliding and full attention layers; keep both meaningful at this size.
_FAMILY_EXTRAS: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=None),
    "gemma2": dict(
        query_pre_attn_scalar=32,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma3": dict(
        query_pre_attn_scalar=32,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
    ),
}

TINY_MODEL_FAMILIES: tuple[str, ...] = tuple(_CONFIG_CLASSES)


def tiny_model_config(
    family: str = "qwen3", vocab_size: int | None = None, **overrides: Any
) -> transformers.PretrainedConfig:
    """A small random-init config (hidden 128, 2 layers, 4 q / 2 kv heads of 32) for ``family``.

    ``family`` is one of :data:`TINY_MODEL_FAMILIES`. ``vocab_size`` defaults to the built-in
    tokenizer's (with pad token), and pad/bos/eos ids match that tokenizer (bos = eos =
    ``<|endoftext|>``, as Qwen does). ``overrides`` are passed to the config class last, so any
    field can be changed (e.g. ``num_hidden_layers=4``; a ``layer_types`` list is trimmed or
    extended to match a changed ``num_hidden_layers``).
    """
    if family not in _CONFIG_CLASSES:
        raise ValueError(
            f"unknown tiny model family {family!r}; choose one of {', '.join(TINY_MODEL_FAMILIES)}"
        )
    config_class = getattr(transformers, _CONFIG_CLASSES[family])
    kwargs: dict[str, Any] = dict(_COMMON_SIZES)
    kwargs.update(
        vocab_size=vocab_size if vocab_size is not None else PAD_TOKEN_ID + 1,
        max_position_embeddings=BUILTIN_MAX_LENGTH,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    kwargs.update(_FAMILY_EXTRAS.get(family, {}))
    kwargs.update(overrides)
    if "layer_types" in kwargs and "layer_types" not in overrides:
        # Alternate sliding/full over however many layers were asked for.
        pattern = _FAMILY_EXTRAS[family]["layer_types"]
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(kwargs["num_hidden_layers"])]
    if kwargs["pad_token_id"] is not None and kwargs["pad_token_id"] >= kwargs["vocab_size"]:
        kwargs["pad_token_id"] = None  # a smaller vocab than the tokenizer's: no pad row to point at
    return config_class(**kwargs)


# ----------------------------------------------------------------------------- dataset

_WORDS: tuple[str, ...] = (
    "apple", "river", "stone", "cloud", "tiger", "piano", "candle", "garden", "silver", "rocket",
    "forest", "window", "yellow", "planet", "bridge", "castle", "dragon", "orange", "pencil",
    "spider", "winter", "summer", "button", "mirror", "jungle", "copper", "basket", "lemon",
    "honey", "ocean", "train", "paper", "green", "light", "music", "bread", "horse", "flower",
    "table", "chair", "water", "earth", "storm", "smile", "dream", "glass", "night", "sugar",
    "cat", "dog", "sun", "moon", "star", "tree", "bird", "fish", "book", "door", "ship", "king",
)

_FIXED_QA: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", "Paris."),
    ("What color is the sky on a clear day?", "Blue."),
    ("How many days are in a week?", "Seven."),
    ("What is the opposite of hot?", "Cold."),
    ("Which animal says meow?", "A cat."),
    ("What do bees make?", "Honey."),
    ("How many legs does a spider have?", "Eight."),
    ("What is frozen water called?", "Ice."),
)


def _task_row(task: int, rng: random.Random) -> tuple[str, str]:
    """One templated (prompt, completion) pair; each task is a rule a tiny model can pick up."""
    word = rng.choice(_WORDS)
    if task == 0:
        return f"Reverse the word: {word}", word[::-1]
    if task == 1:
        return f"Uppercase: {word}", word.upper()
    if task == 2:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return f"Add {a} and {b}.", str(a + b)
    if task == 3:
        return f"Sort the letters: {word}", "".join(sorted(word))
    if task == 4:
        return f"How many letters are in {word}?", str(len(word))
    return _FIXED_QA[rng.randrange(len(_FIXED_QA))]


@functools.lru_cache(maxsize=8)
def _builtin_pairs(num_rows: int, seed: int) -> tuple[tuple[str, str], ...]:
    rng = random.Random(seed)
    # Round-robin over the six tasks so every slice of the dataset has all of them.
    return tuple(_task_row(i % 6, rng) for i in range(num_rows))


def builtin_instruction_dataset(
    form: Literal["prompt_completion", "messages"] = "prompt_completion",
    num_rows: int = 360,
    seed: int = 0,
) -> list[dict]:
    """A small instruction dataset, generated deterministically (same rows for the same seed).

    Tasks: reverse a word, uppercase it, add two numbers below 50, sort a word's letters, count
    its letters, and a few fixed questions. ``form="prompt_completion"`` gives rows
    ``{"prompt": "question\\n", "completion": "answer"}``; ``form="messages"`` gives the same rows as
    ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``.
    """
    pairs = _builtin_pairs(num_rows, seed)
    if form == "prompt_completion":
        # The newline separates question from answer once the two are concatenated.
        return [{"prompt": p + "\n", "completion": c} for p, c in pairs]
    if form == "messages":
        return [
            {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
            for p, c in pairs
        ]
    raise ValueError(f"unknown form {form!r}; choose 'prompt_completion' or 'messages'")
