"""Thirty training steps: swiftune's SFTTrainer against plain transformers ``Trainer`` + PEFT.

The reference is the unpatched model (eager attention) under transformers' own ``Trainer``, on
right-padded batches built by a collator written here, with the model's own loss (summed over the
trained tokens of the batch, divided by their count, as ``num_items_in_batch`` does). swiftune runs
what a user gets by default: patched kernels (Triton through the interpreter on CPU), padding-free
rows, the fused chunked loss. Same initial weights, same seed, so the same sampler order and the
same optimizer; after 30 steps every trainable tensor must agree to fp32 tolerance.

The optimizer is plain SGD (with transformers' gradient clipping and schedule): AdamW divides each
element's step by the root of its own second moment, so elements whose gradient sits at fp32
rounding level take O(1) relative steps from rounding noise alone, and after 30 steps the weights
of two exactly-equivalent fp32 runs differ by ~3e-3 of their update (measured on the Llama case).
That measures Adam's amplification of rounding, not the trainers; with SGD they agree to ~1e-4 of
their update (bound: 1e-3; a wrong gradient term is off by O(0.1)).

On the GPU machine both run on CUDA in fp32 with swiftune's default (compiled Triton) kernels. On a
CPU the default kernel backend is the PyTorch references, and that is what runs here (the Triton
interpreter would take minutes for 30 steps; tests/test_gradient_parity.py runs the interpreted
kernels against the unpatched model case by case).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

import swiftune
from swiftune.data.formatting import TokenizedDataset
from tests.helpers import VOCAB, rel_err, tiny_model

STEPS = 30
BATCH = 4
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAD_ID = VOCAB - 1
CUDA = torch.cuda.is_available()
# what SFTConfig's kernel_backend="auto" runs on this machine when TRITON_INTERPRET is unset
KERNELS = "auto" if CUDA else "reference"


def _examples(count: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(4, 14, (1,), generator=g))
        prompt = int(torch.randint(1, n - 1, (1,), generator=g))
        ids = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (n - prompt)})
    return out


class _PlainRows(torch.utils.data.Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def _pad_collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding, attention mask, labels = ids on completion tokens, -100 elsewhere."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), PAD_ID)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[r, :n] = torch.tensor(e["input_ids"])
        mask[r, :n] = 1
        labels[r, :n] = torch.where(torch.tensor(e["completion_mask"], dtype=torch.bool), ids[r, :n], -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _common(tmp_path, name: str) -> dict:
    return dict(output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=BATCH,
                learning_rate=0.1, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=7,
                data_seed=7, logging_steps=10, save_strategy="no", report_to=[], use_cpu=not CUDA,
                dataloader_num_workers=0, max_grad_norm=1.0, optim="sgd")


def _lora(model):
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0,
                                            init_lora_weights=False))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_thirty_sft_steps_equal_plain_trainer_with_peft(tmp_path, family):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on the GPU too
    base = tiny_model(family, num_hidden_layers=1)
    examples = _examples()
    torch.manual_seed(0)

    reference = _lora(copy.deepcopy(base)).train()
    seen_reference: list[list[int]] = []

    class Recording(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen_reference.append(sorted(inputs["input_ids"][inputs["attention_mask"].bool()].tolist()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    plain = Recording(model=reference, args=transformers.TrainingArguments(**_common(tmp_path, "plain"),
                                                                             remove_unused_columns=False),
                      train_dataset=_PlainRows(examples), data_collator=_pad_collate)
    plain.train()

    model = swiftune.patch_model(copy.deepcopy(base), kernel_backend=KERNELS)
    model = swiftune.FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                              use_gradient_checkpointing=False, init_lora_weights=False)
    initial = _lora(copy.deepcopy(base))
    model.load_state_dict(initial.state_dict())
    seen_swiftune: list[list[int]] = []

    class RecordingSFT(swiftune.SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen_swiftune.append(sorted(inputs["input_ids"].flatten().tolist()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    from swiftune.data.formatting import FormattingStats

    stats = FormattingStats(num_rows=len(examples), num_examples=len(examples), data_shape="tokenized",
                            num_tokens=sum(len(e["input_ids"]) for e in examples),
                            num_trained_tokens=0, num_truncated=0)
    args = swiftune.SFTConfig(**_common(tmp_path, "swiftune"), metrics_file=None, plot_loss=False,
                              kernel_backend=KERNELS)
    assert args.batch_mode == "padding_free"
    trainer = RecordingSFT(model=model, args=args, train_dataset=TokenizedDataset(examples, stats),
                           processing_class=_Tokenizer())
    trainer.train()

    assert seen_swiftune == seen_reference, "the two trainers saw different batches"
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    want = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    start = {n: p for n, p in initial.named_parameters() if p.requires_grad}
    assert trained.keys() == want.keys() and len(want) == 2 * 7 * base.config.num_hidden_layers
    for name, p in want.items():
        p, got, before = p.detach().cpu(), trained[name].detach().cpu(), start[name].detach().cpu()
        assert not torch.equal(p, before), f"{name} did not train in the reference"
        moved = (p - before).norm()
        err = (got - p).norm() / moved
        assert err < 1e-3, f"{name}: differs from the reference by {float(err):.2e} of its update"
        assert rel_err(got, p) < 1e-4, name


class _Tokenizer:
    """The trainer needs only the pad id (and save hooks) for pre-tokenized data."""

    pad_token_id = PAD_ID
    eos_token_id = 0

    def save_pretrained(self, *args, **kwargs):
        return ()
