"""A TRL 1.16 SFT user's data, config fields and metrics on swiftune (issue #27, SFT side).

References are never swiftune: TRL's documented rules written out in plain Python (how labels
come from pre-tokenized columns, how formatting_func and EOS make text), transformers'
``apply_chat_template``, the unpatched transformers model's own logits, and float64 formulas
(the DFT loss and its gradient).
"""

import json
import math
import warnings

import pytest
import torch
import transformers

from swiftune.data import build_tokenizer, make_collator, prepare_dataset
from swiftune.data.formatting import DataFormatError
from swiftune.errors import ConfigError
from swiftune.sft import SFTConfig, SFTTrainer
from swiftune.sft.trainer import head_loss
from tests.helpers import builtin_qwen3, rel_err

FAST = dict(kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
            logging_steps=1, seed=1, data_seed=1, dataloader_pin_memory=False, disable_tqdm=True)


@pytest.fixture()
def tokenizer():
    return build_tokenizer()


def trl_labels(row: dict, completion_only_loss: bool | None) -> list[int]:
    """TRL 1.16 ``SFTTrainer._prepare_dataset`` on a pre-tokenized row: a ``labels`` column as is,
    else ``assistant_masks`` always and ``completion_mask`` only when completion_only_loss=True."""
    if "labels" in row:
        return list(row["labels"])
    masks = [row["assistant_masks"]] if "assistant_masks" in row else []
    if completion_only_loss and "completion_mask" in row:
        masks.append(row["completion_mask"])
    return [t if all(m[i] for m in masks) else -100 for i, t in enumerate(row["input_ids"])]


def swiftune_labels(example: dict) -> list[int]:
    """Labels of one example as swiftune's collator builds them, first token aside (never a target:
    nothing precedes it, in TRL the model's shift drops it too)."""
    batch = make_collator("padded", pad_token_id=0)([example])
    return batch["labels"][0].tolist()[1:]


def tokenized_rows(tokenizer, n=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(12, 40, (1,), generator=gen))
        ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        cut = int(torch.randint(3, length - 3, (1,), generator=gen))
        rows.append({"input_ids": ids, "assistant_masks": [0] * cut + [1] * (length - cut),
                     "completion_mask": [0] * (cut + 1) + [1] * (length - cut - 1)})
    return rows


@pytest.mark.parametrize("columns, completion_only_loss", [
    (("assistant_masks",), None), (("completion_mask",), True), (("completion_mask",), None),
    (("assistant_masks", "completion_mask"), True), (("labels",), None), ((), None)])
def test_pretokenized_rows_train_what_trl_trains(tokenizer, columns, completion_only_loss):
    rows = []
    for row in tokenized_rows(tokenizer):
        kept = {"input_ids": row["input_ids"], **{c: row[c] for c in columns if c in row}}
        if "labels" in columns:
            kept["labels"] = [t if m else -100 for t, m in zip(row["input_ids"], row["assistant_masks"])]
        rows.append(kept)
    data = prepare_dataset(rows, tokenizer, max_length=None, completion_only_loss=completion_only_loss,
                           assistant_only_loss=None)
    assert data.stats.data_shape == "tokenized" and len(data) == len(rows)
    for row, example in zip(rows, data.examples):
        assert example["input_ids"] == row["input_ids"]
        assert swiftune_labels(example) == trl_labels(row, completion_only_loss)[1:]


def test_pretokenized_errors_and_truncation_keep_end(tokenizer):
    rows = tokenized_rows(tokenizer, n=2)
    bad = [{"input_ids": r["input_ids"], "labels": [t + 1 for t in r["input_ids"]]} for r in rows]
    with pytest.raises(DataFormatError, match=r"labels\[0\]"):
        prepare_dataset(bad, tokenizer)
    with pytest.raises(DataFormatError, match="assistant_masks"):
        prepare_dataset([{"input_ids": rows[0]["input_ids"]}], tokenizer, assistant_only_loss=True)
    with pytest.raises(DataFormatError, match="has 3 entries"):
        prepare_dataset([{"input_ids": [1, 2, 3, 4], "assistant_masks": [1, 1, 1]}], tokenizer)
    # TRL's truncation_mode: keep_start keeps ids[:max_length], keep_end ids[-max_length:]
    plain = [{"input_ids": r["input_ids"]} for r in rows]
    for mode, cut in (("keep_start", slice(None, 10)), ("keep_end", slice(-10, None))):
        data = prepare_dataset(plain, tokenizer, max_length=10, truncation_mode=mode)
        assert [e["input_ids"] for e in data.examples] == [r["input_ids"][cut] for r in plain]
    # skip_prepare_dataset: trainer-ready rows as they are (no truncation); masks without labels refused
    ready = [{"input_ids": r["input_ids"], "labels": trl_labels(r, None)} for r in rows]
    data = prepare_dataset(ready, tokenizer, max_length=10, skip_prepare=True)
    assert [e["input_ids"] for e in data.examples] == [r["input_ids"] for r in rows]
    with pytest.raises(DataFormatError, match="no 'labels'"):
        prepare_dataset(rows, tokenizer, skip_prepare=True)


def test_formatting_func_per_row_and_batched_give_trls_text(tokenizer):
    rows = [{"question": f"what is {i}?", "answer": f"it is {i * 7}"} for i in range(5)]

    def per_row(row):
        return f"Q: {row['question']}\nA: {row['answer']}"

    def batched(batch):
        return [f"Q: {q}\nA: {a}" for q, a in zip(batch["question"], batch["answer"])]

    # TRL: {"text": formatting_func(row)}, EOS appended as text, then tokenized; every token trained
    expected = [tokenizer(per_row(r) + tokenizer.eos_token)["input_ids"] for r in rows]
    for func in (per_row, batched):
        data = prepare_dataset(rows, tokenizer, formatting_func=func)
        assert [e["input_ids"] for e in data.examples] == expected
        assert all(all(e["completion_mask"]) for e in data.examples)
    with pytest.raises(DataFormatError, match="formatting_func"):
        prepare_dataset(rows, tokenizer, formatting_func=lambda row: 3)


THINK_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and enable_thinking is defined and enable_thinking is false %}"
    "{{- 'NOTHINK ' }}{%- endif %}{{- message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_chat_template_kwargs_from_the_config_and_per_row(tokenizer):
    tokenizer.chat_template = THINK_TEMPLATE
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [{"messages": messages}, {"messages": messages, "chat_template_kwargs": {"enable_thinking": True}}]

    def render(**kw):
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]

    data = prepare_dataset(rows, tokenizer, assistant_only_loss=False,
                           chat_template_kwargs={"enable_thinking": False})
    assert data.examples[0]["input_ids"] == list(render(enable_thinking=False))
    assert data.examples[1]["input_ids"] == list(render(enable_thinking=True))  # the row's own wins
    assert data.examples[0]["input_ids"] != data.examples[1]["input_ids"]
    # assistant-only masks by prefix renderings see the same keywords: the assistant turn is trained
    masked = prepare_dataset(rows[:1], tokenizer, chat_template_kwargs={"enable_thinking": False})
    ids, mask = masked.examples[0]["input_ids"], masked.examples[0]["completion_mask"]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "NOTHINK hello<|im_end|>\n"


def dft_float64(hidden, weight, labels, num_items=None):
    h, w = hidden.double(), weight.double()
    keep = labels != -100
    logp = torch.log_softmax(h[keep] @ w.T, dim=-1).gather(1, labels[keep, None]).squeeze(1)
    count = num_items if num_items is not None else keep.sum()
    return (-logp * logp.exp().detach()).sum() / count


@pytest.mark.parametrize("num_items", [None, 37])
def test_dft_loss_and_gradients_match_a_float64_formula(num_items):
    torch.manual_seed(0)
    n, hidden_size, vocab = 48, 16, 300
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    labels = torch.randint(0, vocab, (n,))
    labels[::5] = -100
    loss = head_loss(hidden, head, None, labels, num_items, chunk_tokens=32, loss_type="dft")
    loss.backward()
    h_ref, w_ref = hidden.detach().double().requires_grad_(), head.weight.detach().double().requires_grad_()
    ref = dft_float64(h_ref, w_ref, labels, num_items)
    ref.backward()
    assert rel_err(loss.detach(), ref.detach()) < 1e-5
    assert rel_err(hidden.grad, h_ref.grad) < 1e-5 and rel_err(head.weight.grad, w_ref.grad) < 1e-5
    nll = head_loss(hidden.detach(), head, None, labels, num_items, loss_type="nll")
    assert rel_err(nll.detach(), ref.detach()) > 0.1  # a different loss, not nll under another name


def reference_eval(rows, loss_type):
    """Eval loss, token accuracy and logits of the unpatched transformers model, per example."""
    model = builtin_qwen3(lora=False).eval()
    nll, weighted, correct, count, logits, entropy = 0.0, 0.0, 0, 0, [], 0.0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            out = model(ids).logits[0].double()
            labels = torch.tensor(trl_labels(row, None))[1:]
            keep = labels != -100
            logp = torch.log_softmax(out[:-1][keep], -1).gather(1, labels[keep, None]).squeeze(1)
            nll, weighted = nll - logp.sum(), weighted - (logp * logp.exp()).sum()
            correct += int((out[:-1][keep].argmax(-1) == labels[keep]).sum())
            full = torch.log_softmax(out[:-1][keep], -1)
            entropy -= float((full.exp() * full).sum())
            count += int(keep.sum())
            logits.append(out)
    loss = (weighted if loss_type == "dft" else nll) / count
    return float(loss), correct / count, count, torch.cat(logits), entropy / count


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_evaluate_compute_metrics_and_trl_metric_names(tokenizer, tmp_path, loss_type):
    rows = [{"input_ids": r["input_ids"], "assistant_masks": r["assistant_masks"]} for r in tokenized_rows(tokenizer)]
    ref_loss, ref_acc, ref_count, ref_logits, ref_entropy = reference_eval(rows, loss_type)
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction)
        return {"labelled": float((prediction.label_ids != -100).sum())}

    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                     per_device_eval_batch_size=8, learning_rate=0.0, loss_type=loss_type,
                     pad_to_multiple_of=64, eval_packing=(loss_type == "dft"), **FAST)
    trainer = SFTTrainer(model=builtin_qwen3(lora=False), args=args, train_dataset=rows, eval_dataset=rows,
                         processing_class=tokenizer, compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    assert abs(metrics["eval_loss"] - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    assert abs(metrics["eval_mean_token_accuracy"] - ref_acc) <= 1.0 / ref_count
    assert abs(metrics["eval_entropy"] - ref_entropy) < 1e-5 * ref_entropy  # one eval batch: TRL's batch mean
    # compute_metrics got the model's logits (padding included: a 64 multiple) and unshifted labels
    (prediction,) = seen
    logits = torch.as_tensor(prediction.predictions)
    assert logits.shape[-1] == 260 and logits.reshape(-1, 260).shape[0] % 64 == 0
    real = torch.as_tensor(prediction.label_ids).reshape(-1) != -100
    assert metrics["eval_labelled"] == ref_count == int(real.sum())
    if not args.eval_packing:  # packed rows hold the examples in bin-packing order
        flat = logits.reshape(-1, 260)[: ref_logits.shape[0]]
        assert rel_err(flat.double(), ref_logits) < 1e-4
    # rows handed to evaluate() are prepared as at construction (TRL does the same)
    assert abs(trainer.evaluate(eval_dataset=rows)["eval_loss"] - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    # so are rows handed to predict() (it read a raw row's input_ids: a KeyError on text rows)
    assert abs(trainer.predict(rows).metrics["test_loss"] - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    # transformers' named eval datasets: each evaluated as its own, under its name (a dict was read as columns)
    half_loss = reference_eval(rows[:4], loss_type)[0]
    named = SFTTrainer(model=builtin_qwen3(lora=False), args=args, train_dataset=rows,
                       eval_dataset={"all": rows, "half": rows[:4]}, processing_class=tokenizer).evaluate()
    assert abs(named["eval_all_loss"] - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    assert abs(named["eval_half_loss"] - half_loss) < 1e-5 * max(1.0, abs(half_loss))
    if loss_type == "dft":
        return
    # training logs TRL's num_tokens: every input token of the epoch (2 steps x 4 rows = all 8 rows)
    trainer.train()
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f if '"loss"' in line]
    assert steps[-1]["num_tokens"] == sum(len(r["input_ids"]) for r in rows)


def test_trl_fields_checked_at_construction():
    def config(**fields):
        return SFTConfig(output_dir="/tmp/swiftune-trl-fields", report_to="none", **fields)

    for fields, name in [(dict(packing_strategy="wrapped"), "packing_strategy"),
                         (dict(packing_strategy="bfd_splitt"), "packing_strategy"),
                         (dict(loss_type="kto"), "loss_type"), (dict(truncation_mode="middle"), "truncation_mode"),
                         (dict(pad_to_multiple_of=0), "pad_to_multiple_of"),
                         (dict(dataset_kwargs={"num_proc": 2}), "dataset_kwargs"),
                         (dict(model_init_kwargs={"attn_implementation": "sdpa"}), "attention_backend"),
                         (dict(router_aux_loss_coef=-0.01), "router_aux_loss_coef"),
                         (dict(chat_template_path="/nonexistent.jinja"), "chat_template_path"),
                         (dict(eval_packing=True, max_length=None), "eval_packing"),
                         (dict(eos_token=""), "eos_token"), (dict(use_liger_kernel=True), "use_liger_kernel"),
                         (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1 is not applied"),
                         (dict(neftune_noise_alpha=-1.0), "neftune_noise_alpha")]:
        with pytest.raises(ConfigError, match=name):
            config(**fields)
    assert config(pad_to_multiple_of="auto").pad_to_multiple_of is None
    assert config(pad_to_multiple_of="64").pad_to_multiple_of == 64
    assert config(model_init_kwargs='{"dtype": "float32"}').model_init_kwargs == {"dtype": "float32"}
    with pytest.warns(FutureWarning, match="bfd-requeue"):
        assert config(packing_strategy="bfd-requeue").packing_strategy == "bfd_split"
    with pytest.warns(FutureWarning, match="chunked_nll"):
        assert config(loss_type="chunked_nll").loss_type == "nll"
    with pytest.warns(UserWarning, match="dataset_num_proc"):
        config(dataset_num_proc=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second config says nothing more
        config(dataset_num_proc=4)
    offload = config(activation_offloading=True, gradient_checkpointing=True)
    assert offload.gradient_checkpointing is False  # offloaded checkpointing already checkpoints every layer


def test_trainer_applies_tokens_template_offloading_and_refusals(tmp_path):
    tokenizer = build_tokenizer()
    template = tmp_path / "chat.jinja"
    template.write_text(THINK_TEMPLATE)
    rows = [{"text": "hello there, general"}] * 4
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                     chat_template_path=str(template), activation_offloading=True, **FAST)
    model = builtin_qwen3(lora=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    assert tokenizer.chat_template == THINK_TEMPLATE
    assert tokenizer.eos_token_id == 258 and model.config.eos_token_id == 258
    assert 258 in list(model.generation_config.eos_token_id)
    assert tokenizer.pad_token_id == 256 and model.config.pad_token_id == 256
    assert trainer.train_dataset.examples[0]["input_ids"][-1] == 258  # the text rows end with the new EOS
    assert getattr(model, "_swiftune_offload_checkpointing", False)
    bad = SFTConfig(output_dir=str(tmp_path / "bad"), eos_token="<|nope|>", **FAST)
    with pytest.raises(ConfigError, match="eos_token"):
        SFTTrainer(model=builtin_qwen3(lora=False), args=bad, train_dataset=rows, processing_class=build_tokenizer())
    with pytest.raises(ConfigError, match="compute_loss_func"):  # needs full logits: refused, never ignored
        SFTTrainer(model=builtin_qwen3(lora=False), args=args, train_dataset=rows, processing_class=build_tokenizer(),
                   compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)
    only = SFTConfig(output_dir=str(tmp_path / "co"), completion_only_loss=True, **FAST)
    with pytest.raises(ConfigError, match="formatting_func"):
        SFTTrainer(model=builtin_qwen3(lora=False), args=only, train_dataset=rows, processing_class=tokenizer,
                   formatting_func=lambda row: row["text"])


@pytest.mark.parametrize("packing", [False, True])
def test_neftune_noise_is_sized_as_in_trls_padded_batches(tmp_path, tokenizer, packing):
    """transformers' hook sizes NEFTune's noise by the embedded batch's width: TRL's padded batch is as
    wide as its longest example, a padding-free row as the whole batch (the noise was sqrt(batch) times
    weaker). Here every step's noise is bounded by alpha / sqrt(longest document x width), reaches
    near that bound, is absent in evaluation and gone after training."""
    alpha, seen = 5.0, []
    rows = [{"text": "ab " * (2 + 5 * (i % 4))} for i in range(16)]
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, neftune_noise_alpha=alpha, packing=packing,
                     max_length=64, **FAST)
    model = builtin_qwen3(lora=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:4], processing_class=tokenizer)
    embeddings = model.get_input_embeddings()

    def probe(module, inputs, output):  # registered after the trainer's hook: sees the noisy output
        ids = inputs[0]
        clean = torch.nn.functional.embedding(ids, module.weight)
        seen.append((module.training, float((output - clean).abs().max()), ids.shape))

    def longest(module, args, kwargs):
        positions = kwargs.get("position_ids")
        seen.append(("longest", int(positions.max()) + 1 if positions is not None else None))

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            embeddings.register_forward_hook(probe)

    trainer.add_callback(Probe())
    handle = model.register_forward_pre_hook(longest, with_kwargs=True)
    trainer.train()
    handle.remove()
    steps = [(seen[i - 1][1], seen[i]) for i in range(1, len(seen))
             if seen[i][0] is True and seen[i - 1][0] == "longest"]
    assert len(steps) == 2
    for longest_doc, (_, noise, shape) in steps:
        bound = alpha / math.sqrt(longest_doc * embeddings.weight.shape[1])
        assert 0.9 * bound < noise <= bound * (1 + 1e-6), (noise, bound, shape)
        assert longest_doc < shape[1] or packing  # padding-free: one row wider than its longest document
    seen.clear()
    trainer.evaluate()
    assert seen and all(noise == 0 for training, noise, _ in seen if training is False)
    assert not embeddings._forward_hooks or all(h is probe for h in embeddings._forward_hooks.values())


def test_model_init_kwargs_load_a_path_and_shuffle_dataset_reorders(tmp_path):
    model_dir = tmp_path / "model"
    builtin_qwen3(lora=False).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    rows = [{"text": f"row number {i} " * (1 + i % 3)} for i in range(12)]
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, model_init_kwargs={"torch_dtype": "bfloat16"},
                     shuffle_dataset=True, **FAST)
    trainer = SFTTrainer(model=str(model_dir), args=args, train_dataset=rows)
    assert trainer.model.dtype == torch.bfloat16  # TRL's torch_dtype, as transformers' dtype
    unshuffled = prepare_dataset(rows, trainer.processing_class).examples
    shuffled = trainer.train_dataset.examples
    assert shuffled != unshuffled and sorted(map(str, shuffled)) == sorted(map(str, unshuffled))
    with pytest.warns(UserWarning, match="model_init_kwargs"):  # an instance: TRL ignores them too, and says so
        SFTTrainer(model=builtin_qwen3(lora=False), args=args, train_dataset=rows, processing_class=build_tokenizer())


def test_bfd_split_packs_long_documents_as_max_length_pieces(tmp_path, tokenizer):
    rows = tokenized_rows(tokenizer, n=6, seed=2)
    rows = [{"input_ids": r["input_ids"], "assistant_masks": r["assistant_masks"]} for r in rows]
    args = SFTConfig(output_dir=str(tmp_path), max_length=16, packing=True, packing_strategy="bfd_split", **FAST)
    trainer = SFTTrainer(model=builtin_qwen3(lora=False), args=args, train_dataset=rows, processing_class=tokenizer)
    # TRL's bfd_split: each row cut into pieces of max_length tokens, each piece its own document
    expected = []
    for r in rows:
        for start in range(0, len(r["input_ids"]), 16):
            if any(r["assistant_masks"][start + 1:start + 16]):
                expected.append(r["input_ids"][start:start + 16])
    packed = trainer.train_dataset.examples
    documents = []
    for row in packed:
        assert len(row["input_ids"]) <= 16
        offset = 0
        for n in row["seq_lengths"]:
            documents.append(row["input_ids"][offset:offset + n])
            offset += n
    assert sorted(documents) == sorted(expected) and max(len(r["input_ids"]) for r in rows) > 16


# ---------------------------------------------------------------- training metrics: entropy, mean_token_accuracy

def _full_logit_stats(h, w, b, labels, softcap):
    """float64 reference on the full logits: per-token entropy and arg-max hit (ignored: 0 / False)."""
    z = torch.nn.functional.linear(h.double(), w.double(), None if b is None else b.double())
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, -1)
    ent = -(logp.exp() * logp).sum(-1)
    keep = labels != -100
    return torch.where(keep, ent, 0.0), (z.argmax(-1) == labels) & keep


@pytest.mark.parametrize("backend, softcap, vocab_chunk, reduction, bias", [
    ("reference", None, None, "mean", False), ("reference", 7.0, None, "mean", True),
    ("auto", None, None, "mean", False), ("auto", 7.0, None, "sum", True),
    ("reference", None, 128, "mean", False), ("auto", 5.0, 100, "mean", False),
    ("reference", 7.0, None, "none", True),
])
def test_token_stats_of_the_fused_loss_equal_the_full_logits(device, backend, softcap, vocab_chunk, reduction, bias):
    """Entropy and arg-max hit per token from the fused loss's chunk loop (Triton blocks: interpreted on
    CPU, compiled on CUDA; PyTorch blocks; vocabulary split in blocks) equal the float64 full-logits
    formula, and asking for them changes neither the loss nor any gradient."""
    from swiftune.losses import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    V, H = 300, 32
    w = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    bb = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    h = torch.randn(3, 17, H, generator=g).requires_grad_()
    labels = torch.randint(0, V, (3, 17), generator=g)
    with torch.no_grad():
        top = torch.nn.functional.linear(h, w, bb).argmax(-1)
    labels[:, ::3] = top[:, ::3]  # a third of the tokens are hits
    labels[0, :5] = -100
    labels[2, -4:] = -100
    w, h, labels = (t.detach().to(device).requires_grad_(t.requires_grad) for t in (w, h, labels))
    bb = None if bb is None else bb.detach().to(device).requires_grad_()
    kw = dict(reduction=reduction, bias=bb, logit_softcap=softcap, chunk_tokens=24, vocab_chunk=vocab_chunk,
              backend=backend)
    loss, stats = linear_cross_entropy(h, w, labels, return_token_stats=True, **kw)
    assert stats.entropy.shape == labels.shape and stats.is_top1.dtype == torch.bool
    assert not stats.entropy.requires_grad
    ref_ent, ref_hit = _full_logit_stats(h.detach(), w.detach(), None if bb is None else bb.detach(), labels, softcap)
    assert rel_err(stats.entropy.double(), ref_ent) < 1e-5
    assert torch.equal(stats.is_top1, ref_hit) and 0 < int(ref_hit.sum()) < int((labels != -100).sum())
    params = [t for t in (h, w, bb) if t is not None]
    grads = torch.autograd.grad(loss.sum(), params)
    plain = linear_cross_entropy(h, w, labels, **kw)
    plain_grads = torch.autograd.grad(plain.sum(), params)
    assert torch.equal(loss, plain)
    for a, b_ in zip(grads, plain_grads):
        assert torch.equal(a, b_) and a.abs().sum() > 0


class _RecordingSFTTrainer(SFTTrainer):
    """Keeps a copy of every training micro-batch (the reference below recomputes its metrics)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.seen_batches.append({k: inputs[k].detach().clone() for k in ("input_ids", "position_ids", "labels")})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _reference_token_metrics(model, batch):
    """TRL 1.16's per-micro-batch entropy and token accuracy from the unpatched float64 model, document by
    document (a padding-free or packed row holds documents whose positions restart at 0)."""
    ent, hits, count = 0.0, 0, 0
    device = next(model.parameters()).device  # the trainer's batches may be on CUDA, the reference is not
    for ids, pos, labels in zip(*(batch[k].to(device) for k in ("input_ids", "position_ids", "labels"))):
        starts = (pos == 0).nonzero().squeeze(1).tolist() + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:]):
            with torch.no_grad():
                logits = model(ids[None, a:b]).logits[0, :-1].double()
            target = labels[a + 1:b]
            keep = target != -100
            logp = torch.log_softmax(logits[keep], -1)
            ent += float(-(logp.exp() * logp).sum())
            hits += int((logits[keep].argmax(-1) == target[keep]).sum())
            count += int(keep.sum())
    return (ent / count, hits / count) if count else (0.0, 0.0)


def _echo_model():
    """The built-in tiny Qwen3 with its LM head set to its embedding: it tends to predict the token it
    reads, so doubled letters give a share of arg-max hits strictly between 0 and 1."""
    model = builtin_qwen3(lora=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * 8)
    return model


@pytest.mark.parametrize("packing, loss_type", [(False, "nll"), (True, "dft")])
def test_training_logs_trls_entropy_and_mean_token_accuracy(tokenizer, tmp_path, packing, loss_type):
    """Training logs TRL's ``entropy`` and ``mean_token_accuracy`` (completion-only labels, 2 accumulated
    micro-batches per step: the per-micro-batch shares averaged), equal to the unpatched float64 model's."""
    words = ("abc", "garden", "river", "stone", "moon", "piano", "cloud", "tiger")
    rows = [{"prompt": f"Double: {w}\n", "completion": "".join(c + c for c in w)} for w in words]
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, learning_rate=0.0, packing=packing, max_length=64,
                     loss_type=loss_type, **FAST)
    trainer = _RecordingSFTTrainer(model=_echo_model(), args=args, train_dataset=rows,
                                   processing_class=tokenizer)
    trainer.seen_batches = []
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and len(trainer.seen_batches) == 4
    reference = _echo_model().double().eval()
    for step, log in enumerate(logs):
        per_micro = [_reference_token_metrics(reference, b) for b in trainer.seen_batches[2 * step:2 * step + 2]]
        want_ent = sum(e for e, _ in per_micro) / 2
        want_acc = sum(a for _, a in per_micro) / 2
        assert abs(log["entropy"] - want_ent) < 1e-5 * want_ent and want_ent > 0
        assert abs(log["mean_token_accuracy"] - want_acc) < 1e-9 and 0.1 < want_acc < 0.9
    with open(tmp_path / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f if '"loss"' in line]
    assert all("entropy" in line and "mean_token_accuracy" in line for line in lines)


# ---------------------------------------------------------------- Qwen3's chat template with assistant_only_loss

_CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "river"}}}
_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a word.",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
QWEN3_CONVERSATIONS = [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse abc"},
      {"role": "assistant", "content": "<think>\nreverse it\n</think>\n\ncba"},
      {"role": "user", "content": "And xyz?"}, {"role": "assistant", "content": "\n\nzyx"}], {}),
    ([{"role": "user", "content": "Look up river"},
      {"role": "assistant", "content": "Let me check.", "reasoning_content": "\nuse the tool\n",
       "tool_calls": [_CALL, {"function": {"name": "lookup", "arguments": '{"q": "stream"}'}}]},
      {"role": "tool", "content": "a stream"}, {"role": "tool", "content": "flowing water"},
      {"role": "assistant", "content": "", "tool_calls": [_CALL]},
      {"role": "user", "content": "<tool_response>\nwater\n</tool_response>"},
      {"role": "assistant", "content": "<think>done</think>A river is a stream."}], {"tools": _TOOLS}),
    ([{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
      {"role": "system", "content": "Now in French."}, {"role": "user", "content": [{"type": "text", "text": "x"}]},
      {"role": "assistant", "content": "un", "reasoning_content": "french"}], {}),
]


def _qwen3_reference_template() -> str:
    """Qwen3's own chat template, from TRL's copy (which TRL compares tokenizers' templates with)."""
    pytest.importorskip("trl")
    import importlib.resources

    path = importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja"
    if not path.is_file():
        pytest.skip("this trl has no copy of Qwen3's chat template")
    return path.read_text(encoding="utf-8")


def test_swiftune_qwen3_template_renders_as_qwen3s(tokenizer):
    from swiftune.data.chat_templates import QWEN3_TEMPLATE, marked_template_for

    qwen3 = _qwen3_reference_template()
    cases = QWEN3_CONVERSATIONS + [
        (QWEN3_CONVERSATIONS[1][0][:-1], {"add_generation_prompt": True}),
        (QWEN3_CONVERSATIONS[1][0][:-1], {"add_generation_prompt": True, "enable_thinking": False}),
        (QWEN3_CONVERSATIONS[2][0][:3], {"add_generation_prompt": True, "tools": _TOOLS, "enable_thinking": True}),
    ]
    for messages, kwargs in cases:
        want = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=qwen3, **kwargs)
        got = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=QWEN3_TEMPLATE, **kwargs)
        assert got == want, (messages, kwargs)
    tokenizer.chat_template = qwen3
    assert marked_template_for(tokenizer) == QWEN3_TEMPLATE
    for other in (qwen3.replace("'<|im_end|>' + '\\n'", "'<|im_end|>\\n\\n'"),  # looks like Qwen3's, renders otherwise
                  build_tokenizer().chat_template):  # ChatML
        tokenizer.chat_template = other
        assert marked_template_for(tokenizer) is None


def _qwen3_reference_labels(tokenizer, template, messages, tools):
    """Tokens and assistant mask from the real template's rendering: the text after each
    ``<|im_start|>assistant\\n`` header through its ``<|im_end|>\\n`` is the turn (byte-level tokens:
    the pieces tokenize to the whole)."""
    import re

    full = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, tools=tools)
    ids, mask = [], []
    for piece in re.split(r"(?=<\|im_start\|>)", full):
        header = "<|im_start|>assistant\n"
        body_start = len(header) if piece.startswith(header) else len(piece)
        for text, trained in ((piece[:body_start], 0), (piece[body_start:], 1)):
            part = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += part
            mask += [trained] * len(part)
    assert ids == tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, return_dict=True,
                                                tokenize=True)["input_ids"]
    return ids, mask


def test_assistant_only_loss_on_qwen3s_template(tokenizer):
    """Qwen3's real template (not prefix-stable, no markers) with assistant_only_loss: the tokens are the
    template's own and exactly the assistant turns train; the last turn also agrees with the prefix
    rendering ``apply_chat_template(messages[:-1], add_generation_prompt=True)``."""
    qwen3 = _qwen3_reference_template()
    tokenizer.chat_template = qwen3
    rows = [{"messages": m, **({"tools": kw["tools"]} if "tools" in kw else {})} for m, kw in QWEN3_CONVERSATIONS]
    data = prepare_dataset(rows, tokenizer, max_length=None, assistant_only_loss=True)
    assert len(data) == len(rows)
    for row, example in zip(rows, data.examples):
        ids, mask = _qwen3_reference_labels(tokenizer, qwen3, row["messages"], row.get("tools"))
        assert example["input_ids"] == ids
        assert example["completion_mask"] == mask and 0 < sum(mask) < len(mask)
        messages = row["messages"]
        if messages[-2]["role"] == "user":
            start = len(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                                      return_dict=True, tools=row.get("tools"))["input_ids"])
            assert example["completion_mask"][start - 1:] == [0] + [1] * (len(ids) - start)
    # a Qwen3-like template that renders otherwise is not replaced: the prefix method refuses it as before
    tokenizer.chat_template = qwen3.replace("'<|im_end|>' + '\\n'", "'<|im_end|>\\n\\n'")
    assert tokenizer.chat_template != qwen3
    with pytest.raises(DataFormatError, match="prefix-stable"):
        prepare_dataset(rows[1:2], tokenizer, max_length=None, assistant_only_loss=True)


def test_a_row_the_marked_template_renders_otherwise_is_refused(tokenizer, monkeypatch):
    """The per-row check: tokens from swiftune's marked copy must be the tokenizer's own template's."""
    import swiftune.data.formatting as formatting
    from swiftune.data.chat_templates import QWEN3_TEMPLATE

    tokenizer.chat_template = _qwen3_reference_template()
    drifted = QWEN3_TEMPLATE.replace("{{- turn.answer }}", "{{- turn.answer + '!' }}")
    assert drifted != QWEN3_TEMPLATE
    monkeypatch.setattr(formatting, "marked_template_for", lambda tok: drifted)
    rows = [{"messages": QWEN3_CONVERSATIONS[1][0]}]  # an earlier turn takes the branch that drifted
    with pytest.raises(DataFormatError, match="renders differently"):
        prepare_dataset(rows, tokenizer, max_length=None, assistant_only_loss=True)


def test_named_datasets_are_told_from_a_dict_of_columns():
    from swiftune.data import is_named_datasets

    assert is_named_datasets({"a": [{"text": "x"}], "b": "rows.jsonl"})
    assert not is_named_datasets({"text": ["x", "y"]})
    assert not is_named_datasets({"messages": [[{"role": "user", "content": "x"}]]})
    assert not is_named_datasets({"input_ids": [[1, 2]], "labels": [[1, 2]]})
    assert not is_named_datasets({})
