"""The same SFT script through ``trl.SFTTrainer`` (TRL 1.16, unpatched: the reference) and
``swiftune.SFTTrainer``, changing only the import.

Both get the same tiny random model (saved once, loaded fresh for each), the same tokenizer and
rows, the same order (``seed``/``data_seed``, the Trainer's shuffling), the same optimiser and the
same LoRA ``peft_config``; then per-step training losses, the trainable weights after the steps
(and the updates they made), the evaluation loss and TRL's logged metrics must agree to float32
precision, for each of TRL's data shapes.

TRL pads its batches here (its ``padding_free`` needs FlashAttention); swiftune runs its default,
padding-free rows with positions restarting per example. The losses must still agree: that is the
point of padding-free batching.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest

trl = pytest.importorskip("trl")

import datasets  # noqa: E402  (after the skip: TRL brings it)
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import swiftune  # noqa: E402
from swiftune.errors import ConfigError  # noqa: E402
from tests.compat.common import (LOSS_TOL, UPDATE_TOL, WEIGHT_TOL, assert_same_tensors, load_model,  # noqa: E402
                                 save_tiny_model, scratch_dir, shared_args, tokenizer, trainable)

# A chat template written for this test, with TRL's {% generation %} markers (TRL's
# assistant_only_loss needs them, or swaps in a template of its own): the assistant's text and its
# end-of-turn token are the trained tokens.
GENERATION_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{{- '<|im_start|>bot: ' }}{%- generation %}{{- m['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + ': ' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>bot: ' }}{%- endif %}"
)

# 6 rows, batches of 2: three steps see every row once (swiftune's loss kernels run through the Triton
# interpreter on CPU, whose cost grows with the trained tokens, so the rows are few and short)
WORDS = ("apple", "river", "stone", "cloud", "tiger", "piano")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def messages_rows(words):
    """Chats of one or two exchanges (the second exchange's assistant turn is trained too)."""
    rows = []
    for i, w in enumerate(words):
        chat = [{"role": "user", "content": f"reverse {w}"}, {"role": "assistant", "content": w[::-1]}]
        if i % 3 == 0:
            chat += [{"role": "user", "content": "and upper?"}, {"role": "assistant", "content": w.upper()}]
        rows.append({"messages": chat})
    return rows


def prompt_completion_rows(words):
    return [{"prompt": f"Sort the letters of {w}: ", "completion": "".join(sorted(w))} for w in words]


def tokenized_rows(words, with_mask: bool):
    """Pre-tokenized rows (TRL's ``input_ids`` shape); ``with_mask`` adds a ``completion_mask`` over
    the part after the colon."""
    tok = tokenizer()
    rows = []
    for w in words:
        prompt, completion = tok(f"count {w}:")["input_ids"], tok(f" {len(w)} letters")["input_ids"]
        row = {"input_ids": prompt + completion + [tok.eos_token_id]}
        if with_mask:
            row["completion_mask"] = [0] * len(prompt) + [1] * (len(completion) + 1)
        rows.append(row)
    return rows


def text_rows(words):
    """Plain text of 6 to 30 tokens for packing into rows of 24: the longest is cut to 24 (both
    trainers truncate with keep_start), the others share rows."""
    return [{"text": " ".join(words[a:b])} for a, b in ((0, 1), (0, 2), (2, 3), (0, 5))]


def lora_config():
    return peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")


@dataclass(frozen=True)
class Case:
    """One script: the rows, the SFTConfig fields both trainers get, LoRA or full fine-tuning."""

    rows: str
    lora: bool = False
    eval: bool = False
    config: tuple = ()  # (name, value) pairs for both SFTConfigs
    trl_only: tuple = ()  # fields only TRL's config gets
    template: str | None = None


ROWS = {
    "messages": lambda: messages_rows(WORDS),
    "short_messages": lambda: [{"messages": [{"role": "user", "content": w[:3]},
                                             {"role": "assistant", "content": w[2::-1]}]} for w in WORDS],
    "prompt_completion": lambda: prompt_completion_rows(WORDS),
    "conversational_prompt_completion": lambda: [
        {"prompt": [{"role": "user", "content": f"reverse {w}"}], "completion": [{"role": "assistant", "content": w[::-1]}]}
        for w in WORDS],
    "tokenized_mask": lambda: tokenized_rows(WORDS, with_mask=True),
    "text": lambda: text_rows(WORDS),
    "split_text": lambda: [{"text": " ".join(WORDS[:5])}, {"text": WORDS[5]}],
}
EVAL_ROWS = {"messages": lambda: messages_rows(("lemon", "honey", "ocean", "train")),
             "prompt_completion": lambda: prompt_completion_rows(("lemon", "honey", "ocean", "train"))}

CASES = {
    # TRL's assistant_only_loss defaults to False, swiftune's to None (= on for messages): set it, as a TRL
    # user who wants it does
    "messages_assistant_only": Case("messages", eval=True, config=(("assistant_only_loss", True),),
                                    template=GENERATION_TEMPLATE),
    # TRL's default for messages: the loss over the whole conversation (swiftune: assistant_only_loss=False)
    # (short chats: every token of them trains)
    "messages_full_conversation_lora": Case("short_messages", lora=True, config=(("assistant_only_loss", False),),
                                            template=GENERATION_TEMPLATE),
    # completion_only_loss left at its default (None: completion-only on prompt/completion rows, both)
    "prompt_completion_lora": Case("prompt_completion", lora=True, eval=True),
    # pre-tokenized rows: a completion_mask applies with completion_only_loss=True (TRL's rule)
    "tokenized_completion_mask": Case("tokenized_mask", config=(("completion_only_loss", True),)),
    # TRL's "bfd" packing and swiftune's: both best-fit decreasing into rows of max_length, documents kept
    # whole and separate (TRL's bfd rows are padding-free with restarting position_ids, which transformers'
    # masks turn into a block-diagonal attention). Which documents share a row may differ between the two
    # implementations (tie-breaking of equal lengths), so one batch holds every packed row: the per-step loss
    # (a sum over the batch's trained tokens over their count) then does not depend on the grouping, and
    # each step is one epoch. TRL's "wrapped" cuts documents and attends across them: no swiftune
    # counterpart (refused; see test_wrapped_packing_is_refused).
    "text_packing_bfd": Case("text", config=(("packing", True), ("max_length", 24),
                                             ("per_device_train_batch_size", 64)),
                             trl_only=(("packing_strategy", "bfd"),)),
    # bfd_split: a document longer than max_length becomes max_length pieces, each its own document (its
    # first token predicted by nothing); rows of 12 here, so the 30-token text is split in three
    "text_packing_bfd_split": Case("split_text", config=(("packing", True), ("max_length", 12),
                                                         ("packing_strategy", "bfd_split"),
                                                         ("per_device_train_batch_size", 64))),
    # two micro-batches of one row per step: both normalise by the step's trained tokens (the Trainer's
    # num_items_in_batch), so the step equals one batch of two
    "prompt_completion_accumulated": Case("prompt_completion", config=(("per_device_train_batch_size", 1),
                                                                      ("gradient_accumulation_steps", 2))),
    # conversational prompt/completion rows with assistant_only_loss: TRL ANDs the template's assistant mask with the
    # completion mask (here it leaves out the newline after <|im_end|>); swiftune ignored the flag on these rows
    "conversational_prompt_completion_assistant_only": Case("conversational_prompt_completion",
                                                            config=(("assistant_only_loss", True),),
                                                            template=GENERATION_TEMPLATE),
    # shuffle_dataset: TRL reorders the prepared rows with datasets' shuffle(seed); one row per step, so the
    # losses tell whether the same rows come in the same order (swiftune's own permutation did not)
    "prompt_completion_shuffled": Case("prompt_completion", config=(("shuffle_dataset", True),
                                                                   ("per_device_train_batch_size", 1))),
    # TRL's Dynamic Fine-Tuning loss: each token's loss weighted by its detached probability
    "prompt_completion_dft": Case("prompt_completion", config=(("loss_type", "dft"),)),
}


@dataclass
class Run:
    losses: list[float]
    logs: list[dict]
    eval: dict
    start: dict
    end: dict


@functools.lru_cache(maxsize=None)
def model_dir() -> str:
    return save_tiny_model(scratch_dir("sft-model"))


@functools.lru_cache(maxsize=None)
def run(trainer_kind: str, case_name: str) -> Run:
    """Train the case through TRL ("trl") or swiftune ("swiftune") and evaluate (when the case has eval
    rows); cached, so every test of a case shares one run of each trainer."""
    case = CASES[case_name]
    fields = shared_args(scratch_dir(f"sft-{trainer_kind}"), **dict(case.config))
    if trainer_kind == "trl":
        config = trl.SFTConfig(**fields, **dict(case.trl_only))
        trainer_class = trl.SFTTrainer
    else:
        # reference attention: the CPU path (swiftune's packed attention, plain PyTorch); the loss runs its
        # own kernels either way
        config = swiftune.SFTConfig(**fields, kernel_backend="reference",
                                    attention_backend="reference", plot_loss=False, metrics_file=None)
        trainer_class = swiftune.SFTTrainer
    train = datasets.Dataset.from_list(ROWS[case.rows]())
    evaluation = datasets.Dataset.from_list(EVAL_ROWS[case.rows]()) if case.eval else None
    # TRL seeds before wrapping the model with PEFT (its adapters start from args.seed); swiftune leaves the
    # global RNG as the script left it, so the script seeds (see test_lora_init_follows_the_seed_as_in_trl)
    transformers.set_seed(config.seed)
    trainer = trainer_class(model=load_model(model_dir()), args=config, train_dataset=train, eval_dataset=evaluation,
                            processing_class=tokenizer(case.template),
                            peft_config=lora_config() if case.lora else None)
    start = trainable(trainer.model)
    trainer.train()
    logs = [dict(h) for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate() if case.eval else {}
    return Run([h["loss"] for h in logs], logs, metrics, start, trainable(trainer.model))


@pytest.mark.parametrize("case_name", list(CASES))
def test_losses_and_weights_equal_trls(case_name):
    ref, got = run("trl", case_name), run("swiftune", case_name)
    assert len(ref.losses) == len(got.losses) == 3
    for step, (a, b) in enumerate(zip(ref.losses, got.losses), start=1):
        assert torch.isfinite(torch.tensor(b))
        assert abs(a - b) <= LOSS_TOL * abs(a), f"step {step}: TRL {a:.7f}, swiftune {b:.7f}"
    assert len(set(ref.losses)) > 1, "the loss did not change: the steps trained nothing"
    assert_same_tensors(ref.end, got.end, WEIGHT_TOL, case_name, ref_start=ref.start, update_tol=UPDATE_TOL)
    if CASES[case_name].lora:
        assert all("lora_" in n for n in ref.end), "LoRA: only the adapters train"


@pytest.mark.parametrize("case_name", [n for n, c in CASES.items() if c.eval])
def test_eval_loss_equals_trls(case_name):
    ref, got = run("trl", case_name).eval, run("swiftune", case_name).eval
    assert abs(ref["eval_loss"] - got["eval_loss"]) <= LOSS_TOL * ref["eval_loss"], (ref, got)


def test_start_is_the_same_model():
    """The comparison starts from the same weights (and, for LoRA, the same adapters): else every
    equality above would be luck."""
    for name in ("messages_assistant_only", "prompt_completion_lora"):
        assert_same_tensors(run("trl", name).start, run("swiftune", name).start, 0.0, name)


# ---------------------------------------------------------------------------------------------- metrics

# TRL 1.16's names beyond transformers' own (loss, grad_norm, learning_rate, epoch, step), in training and
# evaluation logs. A name swiftune does not log would be a strict xfail with the reason, not a dropped test
# (mean_token_accuracy and entropy in training, and eval_entropy, were until f379234).
TRAIN_METRICS = ["num_tokens", "mean_token_accuracy", "entropy"]
EVAL_METRICS = ["eval_loss", "eval_num_tokens", "eval_mean_token_accuracy", "eval_entropy"]
TRANSFORMERS_NAMES = {"loss", "grad_norm", "learning_rate", "epoch", "step"}
TRANSFORMERS_EVAL_NAMES = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"}


def _names(params):
    return {p if isinstance(p, str) else p.values[0] for p in params}


def test_the_metric_lists_cover_what_trl_logs():
    """Every name TRL logged is one of the checks below (a name TRL adds in a later 1.16.x fails here)."""
    ref = run("trl", "messages_assistant_only")
    logged = set().union(*(h.keys() for h in ref.logs))
    assert logged - TRANSFORMERS_NAMES == _names(TRAIN_METRICS)
    assert set(ref.eval) - TRANSFORMERS_EVAL_NAMES == _names(EVAL_METRICS)


@pytest.mark.parametrize("name", TRAIN_METRICS)
def test_training_metric_logged_as_trl_does(name):
    """Present in every training log, with TRL's value: ``num_tokens`` counts the non-padding input
    tokens seen so far (TRL's padded batches, swiftune's padding-free rows: the same tokens);
    ``mean_token_accuracy`` the share of trained tokens whose arg-max logit is the label; ``entropy``
    their mean entropy (one micro-batch per step here, so TRL's per-micro-batch means are the step's)."""
    ref, got = run("trl", "messages_assistant_only"), run("swiftune", "messages_assistant_only")
    assert all(name in h for h in got.logs), f"{name} missing from swiftune's logs: {sorted(got.logs[0])}"
    for a, b in zip(ref.logs, got.logs):
        assert abs(a[name] - b[name]) <= 1e-4 * max(1.0, abs(a[name])), (name, a[name], b[name])


@pytest.mark.parametrize("name", EVAL_METRICS)
def test_eval_metric_logged_as_trl_does(name):
    """Present after ``evaluate()`` with TRL's value (one evaluation batch holds every row, so TRL's
    mean over batches and swiftune's over tokens are the same number)."""
    ref, got = run("trl", "messages_assistant_only").eval, run("swiftune", "messages_assistant_only").eval
    assert name in got, f"{name} missing from swiftune's eval metrics: {sorted(got)}"
    assert abs(ref[name] - got[name]) <= 1e-4 * max(1.0, abs(ref[name])), (name, ref[name], got[name])


# ---------------------------------------------------------------------------------------------- differences


def test_wrapped_packing_is_refused(tmp_path):
    """TRL's ``packing_strategy="wrapped"`` cuts documents mid-sequence and trains across their
    boundaries; swiftune never does, so the field is refused (docs/trl_compat.md), before any model
    loads, with what to set instead."""
    with pytest.raises(ConfigError, match="packing_strategy.*bfd"):
        swiftune.SFTConfig(**shared_args(str(tmp_path)), packing=True, packing_strategy="wrapped")


def test_lora_init_follows_the_seed_as_in_trl(tmp_path):
    """The same script, run twice with the RNG in another state before the trainer: TRL's adapters
    start from ``args.seed`` either way; swiftune's must too."""
    rows = datasets.Dataset.from_list(prompt_completion_rows(WORDS[:4]))
    args = shared_args(str(tmp_path))
    torch.manual_seed(1234)  # whatever the script did before
    ref = trl.SFTTrainer(model=load_model(model_dir()), args=trl.SFTConfig(**args), train_dataset=rows,
                         processing_class=tokenizer(), peft_config=lora_config())
    torch.manual_seed(4321)
    got = swiftune.SFTTrainer(model=load_model(model_dir()), args=swiftune.SFTConfig(
        **args, kernel_backend="reference", attention_backend="reference", plot_loss=False, metrics_file=None),
        train_dataset=rows, processing_class=tokenizer(), peft_config=lora_config())
    assert_same_tensors(trainable(ref.model), trainable(got.model), 0.0, "LoRA init")


def trl_and_swiftune_losses(name: str, rows, max_steps: int, config_kwargs: dict | None = None,
                            trainer_kwargs: dict | None = None) -> dict[str, list[float]]:
    """Each step's logged loss of TRL's SFTTrainer and swiftune's on ``rows``, same model, seed and settings."""
    losses = {}
    for kind, config_class, trainer_class, extra in (
            ("trl", trl.SFTConfig, trl.SFTTrainer, {}),
            ("swiftune", swiftune.SFTConfig, swiftune.SFTTrainer,
             dict(kernel_backend="reference", attention_backend="reference", plot_loss=False, metrics_file=None))):
        config = config_class(**shared_args(scratch_dir(f"{name}-{kind}"), max_steps=max_steps),
                              **(config_kwargs or {}), **extra)
        transformers.set_seed(config.seed)
        trainer = trainer_class(model=load_model(model_dir()), args=config, train_dataset=rows,
                                processing_class=tokenizer(), **(trainer_kwargs or {}))
        trainer.train()
        losses[kind] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses


def test_remove_unused_columns_true_keeps_the_completion_only_loss():
    """A TRL config that sets ``remove_unused_columns=True`` (TRL's own default) trains what TRL trains."""
    rows = datasets.Dataset.from_list(prompt_completion_rows(WORDS))
    losses = trl_and_swiftune_losses("sft-columns", rows, 1, config_kwargs=dict(remove_unused_columns=True))
    assert abs(losses["trl"][0] - losses["swiftune"][0]) <= LOSS_TOL * losses["trl"][0], losses


def test_a_trl_data_collator_trains_what_trl_trains():
    """A script that passes TRL's own ``DataCollatorForLanguageModeling``: the collator reads TRL's
    ``labels`` column (falling back to ``input_ids``), so swiftune must hand it TRL's columns, or the
    prompt tokens train too (they did: swiftune's examples carry a ``completion_mask`` instead)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = datasets.Dataset.from_list(prompt_completion_rows(WORDS))
    collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer().pad_token_id)
    losses = trl_and_swiftune_losses("sft-collator", rows, 2, trainer_kwargs=dict(data_collator=collator))
    assert len(losses["swiftune"]) == 2
    for a, b in zip(losses["trl"], losses["swiftune"]):
        assert abs(a - b) <= LOSS_TOL * a, losses
