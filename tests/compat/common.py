"""What the TRL-vs-swiftune comparisons share: one tiny random model saved once and loaded fresh
for each trainer, the tokenizer, the training arguments both trainers get, and the comparisons.

The model goes through ``save_pretrained`` / ``from_pretrained`` (the real loading code) so that
the two trainers start from bit-identical float32 weights without sharing a module.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

import torch
import transformers

from swiftune.data.builtin import build_tokenizer, tiny_model_config
from tests.helpers import rel_err

# hidden 64, 2 layers, GQA 4/2 heads of 16: small enough for the CPU, large enough for every
# projection (and LoRA target) to matter
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2)

# fp32 on CPU: per-step losses agree to a few ulps; with plain SGD the weight updates are the summed
# gradients times the learning rate, so they agree as closely as the gradients do, less the rounding
# of ``after - before`` itself: a norm weight near 1.0 moved by ~1e-3 keeps ~4 digits of its update
LOSS_TOL = 2e-5
WEIGHT_TOL = 1e-5
UPDATE_TOL = 1e-3


def scratch_dir(prefix: str) -> str:
    """A temporary directory removed when the test process exits (the runs are cached per process,
    so pytest's per-test ``tmp_path`` would not outlive them)."""
    path = tempfile.mkdtemp(prefix=f"swiftune-compat-{prefix}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def save_tiny_model(path, seed: int = 0) -> str:
    """A random tiny Qwen3 (vocabulary of the built-in tokenizer) saved under ``path``."""
    torch.manual_seed(seed)
    config = tiny_model_config("qwen3", **TINY)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


def load_model(path: str) -> transformers.PreTrainedModel:
    """A fresh float32 copy of the saved model, with transformers' default attention (what a TRL
    user gets: TRL's ``model_init_kwargs`` would load the same)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def tokenizer(chat_template: str | None = None):
    """The project's offline byte-level tokenizer (pad token ``<|pad|>``), optionally with another
    chat template."""
    tok = build_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def shared_args(output_dir: str, **overrides) -> dict:
    """``TrainingArguments`` fields both trainers get, with TRL's own re-defaults pinned where they
    differ from transformers' (``bf16=None`` means bf16 autocast in TRL, ``gradient_checkpointing``
    is on in TRL): a TRL user's script on CPU in float32, the same order of examples (``seed`` and
    ``data_seed``), a constant learning rate large enough to move every weight visibly.

    The optimiser is plain SGD, not AdamW: Adam divides each gradient entry by its own running
    magnitude, so entries whose gradient is near zero (float32 rounding noise in both trainers) get
    full-size, sign-random updates, and the weights after a few steps would differ by far more than
    the gradients do. With SGD the weights after the steps compare the gradients themselves."""
    args = dict(output_dir=output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=64, max_steps=3,
                optim="sgd", learning_rate=0.3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=True, seed=7, data_seed=7, dataloader_pin_memory=False, disable_tqdm=True,
                bf16=False, gradient_checkpointing=False)
    args.update(overrides)
    return args


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the trainable parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_tensors(ref: dict, got: dict, tol: float, what: str, ref_start: dict | None = None,
                        update_tol: float | None = None) -> None:
    """Every tensor of ``ref`` is in ``got`` (same names) within ``tol`` by relative norm; with
    ``ref_start`` (the tensors before training) the updates ``got - start`` match ``ref - start``
    within ``update_tol`` too, and every tensor the reference moved moved here."""
    assert ref, f"{what}: the reference has no trainable tensor"
    assert set(got) == set(ref), f"{what}: names differ: only TRL {sorted(set(ref) - set(got))[:4]}, only " \
                                 f"swiftune {sorted(set(got) - set(ref))[:4]}"
    worst = max(ref, key=lambda n: rel_err(got[n], ref[n]))
    assert rel_err(got[worst], ref[worst]) <= tol, f"{what}: {worst} relative error {rel_err(got[worst], ref[worst]):.2e}"
    if ref_start is None:
        return
    moved = {n for n in ref if not torch.equal(ref[n], ref_start[n])}
    assert moved, f"{what}: the reference moved no tensor (nothing was tested)"
    for n in moved:
        ref_update, update = ref[n] - ref_start[n], got[n] - ref_start[n]
        assert update.abs().max() > 0, f"{what}: {n} did not move, TRL's did"
        assert rel_err(update, ref_update) < update_tol, \
            f"{what}: {n} update relative error {rel_err(update, ref_update):.2e}"
