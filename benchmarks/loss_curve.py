"""SFT loss curves, step by step: swiftune (packed rows) against plain transformers + PEFT (padded).

The loss-curve figure. Both modes train the same random-init model (same base weights, same LoRA r=16
initialisation on all linear layers, checked by a checksum) on the same examples in the same
order (a fixed, pre-shuffled sequence read sequentially; each step's examples are fingerprinted
and compared), with the same optimizer (AdamW, constant learning rate), each in its own process:

  hf_padded        transformers Trainer + PEFT, each example its own row right-padded to the
                   longest of the batch (attention_mask), sdpa, gradient checkpointing (baseline 1)
  swiftune_packed  swiftune SFTTrainer with the in-batch best-fit-decreasing packed collator
                   (``make_collator("packed", max_length)``): the same examples per step as the
                   baseline, packed into rows of ``max_length`` (``packing=True`` would bin-pack the
                   whole dataset, so its steps would hold other examples than the baseline's)

``--compare fp8`` draws FP8's curve instead (to be within 1% of bf16 on the same rows): both modes
are swiftune's packed SFTTrainer on the same rows, one on the bf16 base and one on the same base with
every decoder linear weight quantised to FP8 (e4m3, a float32 scale per row: ``load_in_fp8=True``'s
layers) before the same LoRA initialisation (the adapters' checksum is compared, not the base's):

  swiftune_packed      the bf16 base (the reference of this comparison)
  swiftune_packed_fp8  the FP8 base

The loss of each step (the value ``compute_loss`` returns: mean over the step's trained tokens)
is recorded; reported are the maximum per-step absolute and relative differences. bf16 on CUDA
(as a user trains), float32 on CPU and for ``--model tiny``.

Data: rows of the reference lengths (workload.py) whose tokens follow a fixed random bigram chain
over a sub-vocabulary (4 successors per token), so the loss actually falls during the run
(random uniform tokens would keep it flat at ln(vocab)). Baseline labels mask the first token of
each row, as the loss never predicts it (this keeps transformers' token count equal to the number
of loss terms in every version).

    python -m benchmarks.loss_curve --out loss_curve.json   # + .png; qwen3-0.6b, b8, 200 steps: ~2-3 min (H200)
    python -m benchmarks.loss_curve --compare fp8 --out loss_curve_fp8.json     # FP8 base vs bf16 base, same rows
    python -m benchmarks.loss_curve --model tiny --steps 10                       # CPU smoke test (~20 s)
    python -m benchmarks.loss_curve --one swiftune_packed --model tiny --steps 3  # one mode, JSON on stdout
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

from benchmarks import child_env, module_command, results
from benchmarks.child_output import failure_summary


MODES = ["hf_padded", "swiftune_packed"]
# the two modes of each comparison: (reference, measured)
COMPARISONS = {"hf": ("hf_padded", "swiftune_packed"), "fp8": ("swiftune_packed", "swiftune_packed_fp8")}
LABELS = {"hf_padded": "transformers + PEFT, padded (baseline 1)", "swiftune_packed": "swiftune, packed rows",
          "swiftune_packed_fp8": "swiftune, packed rows, FP8 base weights"}
LORA_SEED = 1234


def bigram_rows(n: int, vocab_size: int, seed: int = 0, max_length: int = 1024) -> list[dict]:
    """``n`` pre-tokenized rows of the reference lengths following a fixed random bigram chain."""
    import numpy as np

    from benchmarks.workload import sample_lengths

    rng = np.random.default_rng(seed + 7)
    sub = min(1024, vocab_size // 2)
    words = rng.choice(np.arange(2, vocab_size), size=sub, replace=False)  # ids 0/1: pad/eos, unused
    successors = rng.integers(0, sub, size=(sub, 4))
    rows = []
    for length in sample_lengths(n, seed=seed, max_length=max_length):
        state = np.empty(int(length), dtype=np.int64)
        state[0] = rng.integers(sub)
        picks = rng.integers(0, 4, size=int(length))
        for t in range(1, int(length)):
            state[t] = successors[state[t - 1], picks[t]]
        rows.append({"input_ids": words[state].tolist()})
    return rows


class RecordingCollator:
    """Wraps a collator; fingerprints the examples of every batch (order-independent within it)."""

    def __init__(self, inner):
        self.inner = inner
        self.fingerprints: list[str] = []
        self.tokens: list[int] = []

    def __call__(self, examples):
        ids = sorted(tuple(e["input_ids"]) for e in examples)
        self.fingerprints.append(hashlib.sha1(repr(ids).encode()).hexdigest()[:12])
        self.tokens.append(sum(len(e["input_ids"]) for e in examples))
        return self.inner(examples)


def build_model(name: str, dtype, device, fp8: bool = False):
    """The random-init model of ``name`` with LoRA r=16 on every linear layer (seeded: the same adapters
    in every mode); ``fp8``: its decoder's linear weights quantised to FP8 first, as
    ``load_in_fp8=True`` loads them."""
    import peft
    import torch

    from benchmarks.workload import random_model

    model = random_model(name, device, dtype)
    if fp8:
        from swiftune.models.fp8_linear import quantize_model_fp8

        quantize_model_fp8(model)
    lora = peft.LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(LORA_SEED)
        model = peft.get_peft_model(model, lora)
    return model


def checksum(model, trainable_only: bool = False) -> float:
    """A position-weighted sum of the parameters (of the trainable ones: the LoRA adapters)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    with torch.no_grad():
        return float(sum(p.detach().double().sum() * (i % 7 + 1) for i, p in enumerate(params)))


def sequential(trainer_cls):
    """``trainer_cls`` reading the dataset in its stored order (the same order in every mode)."""
    import torch

    class Sequential(trainer_cls):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return Sequential


def run_one(mode: str, args) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp32 = device == "cpu" or args.model == "tiny" or args.dtype == "float32"
    dtype = torch.float32 if fp32 else torch.bfloat16
    model = build_model(args.model, dtype, device, fp8=mode == "swiftune_packed_fp8")
    rows = bigram_rows(args.steps * args.batch, model.config.vocab_size, seed=args.seed, max_length=args.max_length)
    common = dict(output_dir=f"/tmp/bench_loss_curve_{mode}", max_steps=args.steps,
                  per_device_train_batch_size=args.batch, learning_rate=args.lr, lr_scheduler_type="constant",
                  warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=10_000, save_strategy="no",
                  report_to="none", bf16=not fp32, seed=args.seed, disable_tqdm=True, use_cpu=device == "cpu",
                  dataloader_pin_memory=False)
    if mode == "hf_padded":
        from transformers import Trainer, TrainingArguments

        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()

        from benchmarks.workload import pad_to_longest as pad_collate

        collator = RecordingCollator(pad_collate)
        init = checksum(model, trainable_only=args.compare == "fp8")
        trainer = sequential(Trainer)(model=model, args=TrainingArguments(remove_unused_columns=False, **common),
                                      train_dataset=rows, data_collator=collator)
    else:
        import swiftune
        from swiftune.data import FormattingStats, TokenizedDataset, make_collator
        from swiftune.training.loading import enable_gradient_checkpointing

        swiftune.patch_model(model)
        enable_gradient_checkpointing(model, True)
        examples = [{"input_ids": r["input_ids"], "completion_mask": None} for r in rows]
        data = TokenizedDataset(examples, FormattingStats(data_shape="pretokenized"))
        collator = RecordingCollator(make_collator("packed", max_length=args.max_length, pad_token_id=0))
        init = checksum(model, trainable_only=args.compare == "fp8")
        from benchmarks.workload import word_tokenizer

        trainer = sequential(swiftune.SFTTrainer)(
            model=model, args=swiftune.SFTConfig(max_length=args.max_length, metrics_file=None, plot_loss=False,
                                                 **common),
            train_dataset=data, processing_class=word_tokenizer(256), data_collator=collator,
        )
    losses: list[float] = []
    orig = trainer.compute_loss

    def recording_compute_loss(*a, **kw):
        out = orig(*a, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        losses.append(float(loss.detach().float()))
        return out

    trainer.compute_loss = recording_compute_loss
    t0 = time.perf_counter()
    trainer.train()
    return dict(mode=mode, model=args.model, batch=args.batch, steps=args.steps, dtype=str(dtype).replace("torch.", ""),
                losses=losses, fingerprints=collator.fingerprints[: args.steps], tokens=collator.tokens[: args.steps],
                init_checksum=init, train_s=time.perf_counter() - t0,
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu")


def compare(a: list[float], b: list[float]) -> dict:
    """Per-step differences of ``a`` (swiftune) against ``b`` (the baseline)."""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    rel = [d / max(abs(y), 1e-12) for d, y in zip(diffs, b)]
    return dict(abs_diff=diffs, rel_diff=rel, max_abs_diff=max(diffs), max_rel_diff=max(rel),
                max_abs_diff_step=diffs.index(max(diffs)) + 1, first_step_abs_diff=diffs[0],
                mean_abs_diff=sum(diffs) / len(diffs))


def plot(result: dict, path: str) -> bool:
    """Both curves and their difference; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no PNG (benchmarks/plots.py draws it from the JSON)")
        return False
    ref_mode, our_mode = COMPARISONS[result.get("compare", "hf")]
    base, ours = result["modes"][ref_mode], result["modes"][our_mode]
    steps = list(range(1, len(base["losses"]) + 1))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    ax.plot(steps, base["losses"], label=LABELS[ref_mode], lw=2.2, color="#999999")
    ax.plot(steps, ours["losses"], label=LABELS[our_mode], lw=1.0, color="#d62728", ls="--")
    ax.set_ylabel("training loss")
    ax.set_title(f"SFT loss, {result['model']} shape, LoRA r=16, batch {result['batch']}, {result['dtype']}")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot(steps, result["abs_diff"], color="#1f77b4", lw=1.0)
    ax2.set_ylabel("|difference|")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    ax2.set_title(f"max |diff| {result['max_abs_diff']:.2e} (relative {result['max_rel_diff']:.2e})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="a shape of benchmarks/workload.py (tiny: CPU smoke test)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["auto", "float32"], default="auto", help="auto: bf16 on CUDA, float32 on CPU")
    p.add_argument("--compare", choices=sorted(COMPARISONS), default="hf",
                   help="hf: swiftune packed vs transformers + PEFT padded; fp8: FP8 base weights vs bf16 (swiftune)")
    p.add_argument("--one", choices=[*MODES, "swiftune_packed_fp8"],
                   help="run a single mode in this process and print its JSON")
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the --out path with .rows.jsonl)")
    p.add_argument("--png", default=None, help="write the plot here (default: next to --out)")
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    start = time.perf_counter()
    runs: dict[str, dict] = {}
    ref_mode, our_mode = COMPARISONS[args.compare]
    for mode in (ref_mode, our_mode):
        cmd = [*module_command("loss_curve", "--one", mode), "--compare", args.compare, "--model", args.model, "--batch",
               str(args.batch), "--steps", str(args.steps), "--lr", str(args.lr), "--max_length", str(args.max_length),
               "--seed", str(args.seed), "--dtype", args.dtype]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not found:
            print(f"{mode}: FAILED: {failure_summary(proc.stderr or proc.stdout, 600)}", file=sys.stderr)
            return 1
        runs[mode] = json.loads(found[-1][7:])
        r = runs[mode]
        print(f"# {mode}: {len(r['losses'])} steps in {r['train_s']:.1f} s, loss {r['losses'][0]:.4f} -> "
              f"{r['losses'][-1]:.4f}", flush=True)
    base, ours = runs[ref_mode], runs[our_mode]
    result = dict(benchmark="loss_curve", compare=args.compare, reference=ref_mode, measured=our_mode, model=args.model, batch=args.batch, steps=args.steps, lr=args.lr,
                  max_length=args.max_length, dtype=base["dtype"], device=base["device"],
                  same_data=base["fingerprints"] == ours["fingerprints"],
                  same_init=abs(base["init_checksum"] - ours["init_checksum"]) <= 1e-9 * abs(base["init_checksum"]),
                  modes=runs, **compare(ours["losses"], base["losses"]))
    try:
        import peft
        import torch
        import transformers

        result.update(torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__)
    except ImportError:
        pass
    png = args.png or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if png and plot(result, png):
        result["png"] = png
    print(f"\n# SFT loss per step, {args.model} shape, LoRA r=16, batch {args.batch}, {result['dtype']}, "
          f"{args.steps} steps ({result['device']}); same data: {result['same_data']}, "
          f"same init: {result['same_init']}")
    print(f"{'step':>5} {ref_mode:>16} {our_mode:>19} {'|diff|':>9} {'rel':>9}")
    n = len(base["losses"])
    show = sorted(set([0, 1, 2, n // 4, n // 2, 3 * n // 4, n - 1, result["max_abs_diff_step"] - 1]))
    for i in show:
        if 0 <= i < n:
            print(f"{i + 1:>5} {base['losses'][i]:16.5f} {ours['losses'][i]:19.5f} {result['abs_diff'][i]:9.2e} "
                  f"{result['rel_diff'][i]:9.2e}")
    print(f"max |diff| {result['max_abs_diff']:.3e} at step {result['max_abs_diff_step']}, max relative "
          f"{result['max_rel_diff']:.3e}, mean |diff| {result['mean_abs_diff']:.3e}; "
          f"wall {time.perf_counter() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    results.save("loss_curve", argv, result, args.out, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
