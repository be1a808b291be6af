"""Data layer: built-in assets, formatting and masks, packing, collators (CPU, a few seconds)."""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import random
import time
from pathlib import Path

import pytest
import torch
import transformers

from swiftune.data import (
    EOS_TOKEN_ID,
    IGNORE_INDEX,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    PAD_TOKEN_ID,
    TINY_MODEL_FAMILIES,
    DataFormatError,
    PackedCollator,
    PaddedCollator,
    PaddingFreeCollator,
    TokenBudgetBatchSampler,
    batch_by_token_budget,
    build_tokenizer,
    builtin_instruction_dataset,
    cu_seqlens_from_position_ids,
    detect_shape,
    make_collator,
    pack_best_fit,
    pack_dataset,
    packing_efficiency,
    padding_fraction,
    pop_batch_stats,
    position_ids_from_seq_lengths,
    prepare_dataset,
    tiny_model_config,
)
from swiftune.data.builtin import CHATML_TEMPLATE

LENGTHS_PY = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "lengths.py"

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Reverse: cat"},
    {"role": "assistant", "content": "tac"},
]


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    return build_tokenizer()


def trained_text(tok, example: dict) -> str:
    """Decode the tokens an example trains on (completion mask, first token excluded)."""
    ids, mask = example["input_ids"], example["completion_mask"]
    return tok.decode([t for i, (t, m) in enumerate(zip(ids, mask)) if m and i > 0])


# ----------------------------------------------------------------------------- built-in assets


def test_tokenizer_bytes_and_special_tokens(tok):
    assert len(tok) == PAD_TOKEN_ID + 1
    assert (tok.eos_token_id, tok.pad_token_id) == (EOS_TOKEN_ID, PAD_TOKEN_ID)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START_TOKEN_ID, IM_END_TOKEN_ID]
    text = "héllo, wörld ✓"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # id = byte value
    assert tok.decode(ids) == text
    assert tok("<|im_start|>x<|im_end|>")["input_ids"] == [IM_START_TOKEN_ID, ord("x"), IM_END_TOKEN_ID]
    no_pad = build_tokenizer(with_pad_token=False)
    assert no_pad.pad_token is None and len(no_pad) == PAD_TOKEN_ID
    assert no_pad(text)["input_ids"] == ids


def test_tokenizer_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\nÜber 12 + 30<|im_end|>"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.eos_token, loaded.pad_token) == (tok.eos_token, tok.pad_token)
    assert loaded.chat_template == tok.chat_template
    assert loaded.model_max_length == tok.model_max_length
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False) == tok.apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_chat_template_generation_prompt_and_assistant_mask(tok):
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    out = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    trained = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(trained) == "Hello!<|im_end|>tac<|im_end|>"


@pytest.mark.parametrize("family", TINY_MODEL_FAMILIES)
def test_tiny_model_configs_build_and_run(family, tok):
    config = tiny_model_config(family)
    assert config.vocab_size == len(tok)
    assert (config.pad_token_id, config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.tensor([tok("Add 2 and 3.\n5")["input_ids"]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert torch.isfinite(loss) and abs(float(loss) - torch.log(torch.tensor(len(tok))).item()) < 1.0


def test_tiny_model_config_overrides_and_errors():
    config = tiny_model_config("gemma3", num_hidden_layers=4)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert tiny_model_config("llama", hidden_size=64, head_dim=16).hidden_size == 64
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt9'.*qwen3"):
        tiny_model_config("gpt9")


def test_builtin_dataset_deterministic_and_correct():
    rows = builtin_instruction_dataset()
    assert len(rows) >= 300 and rows == builtin_instruction_dataset()
    assert builtin_instruction_dataset(seed=1) != rows
    chats = builtin_instruction_dataset("messages")
    for row, chat in zip(rows, chats):
        user, assistant = chat["messages"]
        assert (user["content"] + "\n", assistant["content"]) == (row["prompt"], row["completion"])
    checks = 0
    for row in rows:
        prompt, completion = row["prompt"].strip(), row["completion"]
        if prompt.startswith("Reverse the word: "):
            assert completion == prompt.split(": ")[1][::-1]
            checks += 1
        elif prompt.startswith("Add "):
            a, b = prompt[4:-1].split(" and ")
            assert int(completion) == int(a) + int(b)
            checks += 1
    assert checks > 100
    with pytest.raises(ValueError, match="unknown form"):
        builtin_instruction_dataset("chat")


# ----------------------------------------------------------------------------- formatting


def test_text_rows_train_every_token_and_end_with_eos(tok):
    ds = prepare_dataset([{"text": "abc"}, {"text": "de<|endoftext|>"}], tok)
    assert ds[0]["input_ids"] == [97, 98, 99, EOS_TOKEN_ID]
    assert ds[1]["input_ids"] == [100, 101, EOS_TOKEN_ID]  # EOS not doubled
    assert all(all(e["completion_mask"]) for e in ds)
    assert ds.stats.data_shape == "text" and ds.stats.num_trained_tokens == 3 + 2


def test_text_field_option(tok):
    ds = prepare_dataset([{"body": "abc"}], tok, text_field="body")
    assert ds[0]["input_ids"] == [97, 98, 99, EOS_TOKEN_ID]


def test_prompt_completion_masks_only_completion(tok):
    rows = builtin_instruction_dataset()[:40]
    ds = prepare_dataset(rows, tok)
    assert len(ds) == 40 and ds.stats.data_shape == "prompt_completion"
    for row, example in zip(rows, ds):
        assert tok.decode(example["input_ids"]) == row["prompt"] + row["completion"] + "<|endoftext|>"
        assert trained_text(tok, example) == row["completion"] + "<|endoftext|>"
    everything = prepare_dataset(rows, tok, completion_only_loss=False)
    assert all(all(e["completion_mask"]) for e in everything)


def test_conversational_prompt_completion(tok):
    rows = [
        {
            "prompt": [{"role": "user", "content": "Uppercase: dog"}],
            "completion": [{"role": "assistant", "content": "DOG"}],
        }
    ]
    example = prepare_dataset(rows, tok)[0]
    assert tok.decode(example["input_ids"]) == (
        "<|im_start|>user\nUppercase: dog<|im_end|>\n<|im_start|>assistant\nDOG<|im_end|>\n"
    )
    assert trained_text(tok, example) == "DOG<|im_end|>\n"


def test_messages_mask_only_assistant_turns(tok):
    example = prepare_dataset([{"messages": CONVERSATION}], tok)[0]
    assert tok.decode(example["input_ids"]) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert trained_text(tok, example) == "Hello!<|im_end|>tac<|im_end|>"
    everything = prepare_dataset([{"messages": CONVERSATION}], tok, assistant_only_loss=False)[0]
    assert all(everything["completion_mask"])


def test_messages_without_generation_markers_use_prefix_renderings():
    tok = build_tokenizer()
    tok.chat_template = CHATML_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    example = prepare_dataset([{"messages": CONVERSATION}], tok)[0]
    assert trained_text(tok, example) == "Hello!<|im_end|>\ntac<|im_end|>\n"


def test_every_input_kind_gives_the_same_examples(tok, tmp_path):
    rows = builtin_instruction_dataset()[:12]
    expected = prepare_dataset(rows, tok).examples
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(rows))
    columns = {key: [r[key] for r in rows] for key in rows[0]}
    inputs = [jsonl, str(array), columns, iter(rows)]
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        parquet = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), parquet)
        inputs.append(parquet)
    if importlib.util.find_spec("datasets") is not None:
        import datasets

        inputs.append(datasets.Dataset.from_list(rows))
        inputs.append(datasets.Dataset.from_list(rows).to_iterable_dataset())
    for data in inputs:
        assert prepare_dataset(data, tok).examples == expected, type(data)


def test_truncation_counts_and_warns(tok, caplog):
    rows = [{"text": "x" * 50}, {"text": "short"}, {"text": "y" * 30}]
    with caplog.at_level(logging.WARNING, logger="swiftune.data.formatting"):
        ds = prepare_dataset(rows, tok, max_length=20)
    assert ds.stats.num_truncated == 2 and ds.lengths == [20, 6, 20]
    assert "2 of 3 rows were longer than max_length=20 and were truncated" in caplog.text
    dropped = prepare_dataset(rows, tok, max_length=20, truncation="drop")
    assert dropped.stats.num_dropped_too_long == 2 and dropped.lengths == [6]
    assert prepare_dataset(rows, tok, max_length=None).lengths == [51, 6, 31]
    with pytest.raises(DataFormatError, match="row 0 has 51 tokens, more than max_length=20.*truncation='truncate'"):
        prepare_dataset(rows, tok, max_length=20, truncation="error")


def test_examples_without_trained_tokens_are_dropped_with_a_warning(tok, caplog):
    rows = [{"prompt": "p" * 30, "completion": "abc"}, {"prompt": "q", "completion": "r"}]
    with caplog.at_level(logging.WARNING, logger="swiftune.data.formatting"):
        ds = prepare_dataset(rows, tok, max_length=16)  # row 0 keeps only prompt tokens
    assert len(ds) == 1 and ds.stats.num_dropped_no_trained_tokens == 1
    assert "1 of 2 rows had no trained tokens" in caplog.text
    with pytest.raises(DataFormatError, match="no example is left to train on"):
        prepare_dataset(rows[:1], tok, max_length=16)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "the dataset is empty"),
        ({"text": []}, "the dataset is empty"),
        (
            [{"instruction": "a", "output": "b"}],
            r"dataset has columns \['instruction', 'output'\]; swiftune accepts 'text'.*'prompt' \+ "
            r"'completion'.*'messages'.*Alpaca-style",
        ),
        ([{"prompt": "a"}], "A 'prompt' column alone is GRPO data"),
        ([{"conversations": []}], "renamed to 'messages'"),
        ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], r"row 1: 'completion' must be a string, got NoneType"),
        ([{"text": 3}], "row 0: 'text' must be a string, got int"),
        (["just a string"], "dataset rows must be dicts"),
        (42, "cannot read a dataset from int"),
        ("/nonexistent/rows.jsonl", "does not exist"),
    ],
)
def test_bad_inputs_say_what_to_change(tok, data, message):
    with pytest.raises(DataFormatError, match=message):
        prepare_dataset(data, tok)


def test_bad_files(tok, tmp_path):
    csv = tmp_path / "rows.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(DataFormatError, match=r"unsupported dataset file type '.csv'.*\.jsonl"):
        prepare_dataset(csv, tok)
    broken = tmp_path / "rows.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataFormatError, match=r"rows.jsonl:2: not valid JSON"):
        prepare_dataset(broken, tok)


def test_chat_data_needs_a_chat_template():
    tok = build_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataFormatError, match="'messages' rows need a chat template.*set tokenizer.chat_template"):
        prepare_dataset([{"messages": CONVERSATION}], tok)
    conversational = [{"prompt": CONVERSATION[1:2], "completion": CONVERSATION[2:3]}]
    with pytest.raises(DataFormatError, match="conversational prompt/completion rows need a chat template"):
        prepare_dataset(conversational, tok)


def test_padded_batches_need_a_pad_token():
    with pytest.raises(ValueError, match="need a pad token.*tokenizer.pad_token = tokenizer.eos_token"):
        make_collator("padded", pad_token_id=build_tokenizer(with_pad_token=False).pad_token_id)
    # Padding-free and packed batches work without one.
    examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    assert make_collator("packed", max_length=4, pad_token_id=None)(examples)["input_ids"].shape == (2, 3)


def test_detect_shape_prefers_messages():
    assert detect_shape(["messages", "prompt", "completion"]) == "messages"
    assert detect_shape(["prompt", "completion", "text"]) == "prompt_completion"


# ----------------------------------------------------------------------------- packing


def reference_best_fit_decreasing(lengths: list[int], max_length: int) -> list[int]:
    """O(n * rows) BFD: the free space left in each row, for comparing with the fast version."""
    free: list[int] = []
    for length in sorted(lengths, reverse=True):
        fits = [i for i, f in enumerate(free) if f >= length]
        if fits:
            best = min(fits, key=lambda i: free[i])
            free[best] -= length
        else:
            free.append(max_length - length)
    return sorted(free)


@pytest.mark.parametrize("seed", range(8))
def test_pack_best_fit_properties_on_random_inputs(seed):
    rng = random.Random(seed)
    max_length = rng.choice([8, 64, 1000])
    lengths = [rng.randint(1, max_length) for _ in range(rng.randint(0, 300))]
    bins = pack_best_fit(lengths, max_length)
    placed = sorted(i for row in bins for i in row)
    assert placed == list(range(len(lengths)))  # every example exactly once
    assert all(sum(lengths[i] for i in row) <= max_length for row in bins)
    assert all(row for row in bins)
    # Same rows as a naive BFD (ties between equal free spaces do not change what fits later).
    assert sorted(max_length - sum(lengths[i] for i in row) for row in bins) == reference_best_fit_decreasing(
        lengths, max_length
    )
    assert pack_best_fit(lengths, max_length) == bins  # deterministic


def test_pack_best_fit_errors():
    with pytest.raises(ValueError, match="example 1 has 9 tokens, more than max_length=8"):
        pack_best_fit([3, 9], 8)
    with pytest.raises(ValueError, match="needs >= 1 token"):
        pack_best_fit([0], 8)


def test_packing_efficiency_on_reference_workload():
    if not LENGTHS_PY.exists():
        pytest.skip(f"reference workload {LENGTHS_PY} not found (CI clones the repo beside ../shared)")
    spec = importlib.util.spec_from_file_location("shared_lengths", LENGTHS_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lengths = module.sample_lengths(5000).tolist()
    bins = pack_best_fit(lengths, 1024)
    efficiency = packing_efficiency(bins, lengths, 1024)
    print(f"\nBFD packing efficiency, sample_lengths(5000), max_length 1024: {efficiency:.4f} ({len(bins)} rows)")
    assert efficiency >= 0.95
    big = module.sample_lengths(100_000, seed=1).tolist()
    start = time.perf_counter()
    pack_best_fit(big, 1024)
    assert time.perf_counter() - start < 1.0


def test_batch_by_token_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    batches = batch_by_token_budget(lengths, 256)
    assert [i for b in batches for i in b] == list(range(500))  # order kept, each once
    assert all(sum(lengths[i] for i in b) <= 256 for b in batches)
    # Greedy: adding the next example would have broken the budget.
    assert all(sum(lengths[i] for i in b) + lengths[b[-1] + 1] > 256 for b in batches[:-1])
    assert max(len(b) for b in batch_by_token_budget(lengths, 10_000, max_examples=7)) == 7
    with pytest.raises(ValueError, match="more than max_tokens=50"):
        batch_by_token_budget([10, 60], 50)


def test_token_budget_batch_sampler_shuffles_per_epoch():
    lengths = [random.Random(i).randint(1, 50) for i in range(200)]
    sampler = TokenBudgetBatchSampler(lengths, 128, seed=3)
    first = list(sampler)
    assert list(sampler) == first and len(sampler) == len(first)
    assert sorted(i for b in first for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 128 for b in first)
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_position_ids_and_cu_seqlens():
    assert position_ids_from_seq_lengths([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]
    cu, max_len = cu_seqlens_from_position_ids(torch.tensor([0, 1, 2, 0, 0, 1]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 6] and max_len == 3
    # Rows are flattened; a row start is a document start even if its position is not 0.
    cu, max_len = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 3], [5, 6, 0, 1]]))
    assert cu.tolist() == [0, 4, 6, 8] and max_len == 4
    cu, max_len = cu_seqlens_from_position_ids(torch.zeros(1, 0, dtype=torch.long))
    assert cu.tolist() == [0] and max_len == 0


def test_pack_dataset_rows(tok):
    examples = prepare_dataset(builtin_instruction_dataset(), tok).examples
    rows = pack_dataset(examples, 256)
    assert all(len(r["input_ids"]) == sum(r["seq_lengths"]) <= 256 for r in rows)
    assert sum(len(r["seq_lengths"]) for r in rows) == len(examples)
    assert sum(sum(r["completion_mask"]) for r in rows) == sum(sum(e["completion_mask"]) for e in examples)


# ----------------------------------------------------------------------------- collators


@pytest.fixture(scope="module")
def chat_examples(tok) -> list[dict]:
    return prepare_dataset(builtin_instruction_dataset("messages")[:10], tok).examples


def loss_terms(batch: dict) -> collections.Counter:
    """Multiset of (context tokens, target) over every trained label, after the model's shift.

    Context of target ``t`` is what position ``t - 1`` may attend to: its own document up to
    ``t - 1`` (documents from ``position_ids``; padded rows have one document per row).
    """
    terms: collections.Counter = collections.Counter()
    ids, labels = batch["input_ids"], batch["labels"]
    positions = batch.get("position_ids")
    for r in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if labels[r, t] == IGNORE_INDEX:
                continue
            start = t - int(positions[r, t]) if positions is not None else 0
            assert start < t, "a trained label whose prediction would cross a document boundary"
            terms[(tuple(ids[r, start:t].tolist()), int(labels[r, t]))] += 1
    return terms


def test_padding_free_row_restarts_positions_and_masks_boundaries(chat_examples):
    batch = PaddingFreeCollator()(chat_examples)
    lengths = [len(e["input_ids"]) for e in chat_examples]
    assert batch["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in batch
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    positions, labels = batch["position_ids"][0], batch["labels"][0]
    assert (positions[starts] == 0).all() and int((positions == 0).sum()) == len(lengths)
    assert (labels[starts] == IGNORE_INDEX).all()  # shifted labels never cross a boundary
    assert (labels[positions == 0] == IGNORE_INDEX).all()
    assert batch["num_trained_tokens"] == sum(sum(e["completion_mask"][1:]) for e in chat_examples)
    assert padding_fraction(batch) == 0.0


def test_first_token_label_is_masked_even_when_trained():
    batch = PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]


def test_packed_rows_fit_and_padding_is_its_own_document(chat_examples):
    batch = PackedCollator(max_length=128, pad_token_id=PAD_TOKEN_ID)(chat_examples)
    rows, width = batch["input_ids"].shape
    assert width <= 128 and rows >= 2 and "attention_mask" not in batch
    real_per_row = (batch["input_ids"] != PAD_TOKEN_ID).sum(1)
    for r in range(rows):
        n = int(real_per_row[r])
        if n < width:  # padding: label -100, positions 0, 1, ... (a separate document)
            assert (batch["labels"][r, n:] == IGNORE_INDEX).all()
            assert batch["position_ids"][r, n:].tolist() == list(range(width - n))
    stats = pop_batch_stats(batch)
    assert stats.num_tokens == sum(len(e["input_ids"]) for e in chat_examples)
    assert stats.num_padding_tokens == rows * width - stats.num_tokens
    assert 0 < stats.padding_fraction < 1 and set(batch) == {"input_ids", "labels", "position_ids"}


def test_pad_to_multiple_of(chat_examples):
    assert PackedCollator(128, PAD_TOKEN_ID, pad_to_multiple_of=64)(chat_examples)["input_ids"].shape[1] == 128
    assert PaddedCollator(PAD_TOKEN_ID, pad_to_multiple_of=16)(chat_examples)["input_ids"].shape[1] % 16 == 0


def test_three_modes_give_the_same_loss_terms(chat_examples, tok):
    # Text examples train their first token too: only the boundary masking keeps it out.
    text_examples = prepare_dataset([{"text": "abc"}, {"text": "hello"}], tok).examples
    chat_examples = chat_examples[:4] + text_examples + chat_examples[4:]
    reference = loss_terms(PaddedCollator(PAD_TOKEN_ID)(chat_examples))
    assert sum(reference.values()) == sum(sum(e["completion_mask"][1:]) for e in chat_examples)
    assert loss_terms(PaddingFreeCollator()(chat_examples)) == reference
    assert loss_terms(PackedCollator(128, PAD_TOKEN_ID)(chat_examples)) == reference
    prepacked = pack_dataset(chat_examples, 128)
    assert loss_terms(PackedCollator(128, PAD_TOKEN_ID)(prepacked)) == reference
    assert loss_terms(PaddingFreeCollator()(prepacked)) == reference


def test_three_modes_give_the_same_model_loss(chat_examples):
    """On a real (tiny) model: transformers finds documents from position_ids when no mask is given."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config("qwen3"), attn_implementation="sdpa")
    losses = {}
    for mode in ("padded", "padding_free", "packed"):
        batch = make_collator(mode, max_length=128, pad_token_id=PAD_TOKEN_ID)(chat_examples)
        stats = pop_batch_stats(batch)
        with torch.no_grad():
            losses[mode] = float(model(**batch, use_cache=False, num_items_in_batch=stats.num_trained_tokens).loss)
    assert losses["padding_free"] == pytest.approx(losses["padded"], rel=1e-5)
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-5)


def test_collator_errors(chat_examples):
    with pytest.raises(ValueError, match="packed batches need max_length"):
        make_collator("packed")
    with pytest.raises(ValueError, match="unknown batch mode 'ragged'"):
        make_collator("ragged")
    with pytest.raises(ValueError, match="one example per row"):
        PaddedCollator(PAD_TOKEN_ID)(pack_dataset(chat_examples, 128))
    with pytest.raises(ValueError, match="more than max_length=16"):
        PackedCollator(16)(chat_examples)
    with pytest.raises(ValueError, match="empty list"):
        PaddingFreeCollator()([])
