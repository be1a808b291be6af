"""The host's (Python's) own time per SFT step, measured on CPU with tiny widths.

On a GPU the kernels run asynchronously, so a step takes max(GPU time, host time); the host time
is what Python does per step (module calls, autograd nodes, hooks, the Trainer's callbacks and
optimizer loop) and does not depend on the device. A model of the real depth and module
structure (Qwen3, ``--model-depth`` layers, LoRA r=16 on all 7 projections, gradient
checkpointing) but tiny widths (hidden 64) makes the compute negligible, so a CPU step's wall
time is nearly all of that host work. Kernels run through their plain-PyTorch references (the
Triton interpreter must be off: ``TRITON_INTERPRET`` unset), the LoRA linears through swiftune's
fused node, as on the GPU.

Measured in the process's CPU time (not wall time: a shared machine's other processes do not count),
with one intra-op thread, each as the median over ``--steps`` steps after ``--warmup``:

* ``step``: one whole ``Trainer`` optimizer step (data, forward, backward, clipping, optimizer,
  callbacks), from one ``on_step_end`` to the next;
* ``forward_backward``: the loss's forward and backward alone, outside the Trainer, under its
  autocast (and, for swiftune, its step's LoRA casting), on batches of its loader: swiftune's
  ``compute_loss`` (the fused loss), the baseline's ``model(**batch).loss``;
* ``training_step``: the Trainer's ``training_step`` call inside that step (forward, backward, the
  loss guards; swiftune's LoRA casting switch);
* ``trainer_own``: ``step - training_step``: what the Trainer adds per step around it (data,
  gradient clipping, optimizer, scheduler, ``zero_grad``, callbacks);
* ``optimizer``: ``optimizer.step()`` + ``zero_grad()`` alone.

Modes: ``swiftune`` (SFTTrainer, padding-free) and ``baseline`` (transformers ``Trainer`` + PEFT,
unpatched, the same rows padded to the longest). A cProfile of ``--profile-steps`` further
trainer steps, the top 20 by cumulative time (and by own time; then the source files whose
functions were called most, per step), is written per mode to ``--profile-out``; its count of
Python function calls per step (``calls/step``, exact and free of timing noise) is in the table.

    python -m benchmarks.host_overhead --model-depth 36 --steps 20
    python -m benchmarks.host_overhead --model-depth 36 --steps 20 --modes swiftune --out host.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

from benchmarks import results

MODES = ("swiftune", "baseline")
# The process's CPU time, not the wall clock: with one intra-op thread it is the host's own work per step,
# and it does not count the time other processes of a shared machine take from this one.
clock = time.process_time
TOOLS = {"swiftune": "swiftune", "baseline": "transformers+peft"}
ATTENTION = "sdpa"


def tiny_qwen3(depth: int, hidden: int):
    """A random-init Qwen3 causal LM with ``depth`` layers and tiny widths (seed 0, float32 weights)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=depth,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def short_rows(n: int, seed: int = 0, shortest: int = 12, longest: int = 48) -> list[dict]:
    """``n`` pre-tokenized rows of random ids, ``shortest``..``longest`` tokens each."""
    import random

    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(3, 256) for _ in range(rng.randint(shortest, longest))]} for _ in range(n)]


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def _step_timer(record: list[float], first: int, last: int):
    """A callback recording the wall time between consecutive ``on_step_end`` of steps ``first``..``last``."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        previous: float | None = None

        def on_step_end(self, args, state, control, **kwargs):
            now = clock()
            if self.previous is not None and first < state.global_step <= last:
                record.append(now - self.previous)
            self.previous = now

    return StepTimer()


def _step_profiler(profiler: cProfile.Profile, first: int):
    """A callback profiling every step after step ``first`` (to the end of training)."""
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == first:
                profiler.enable()

        def on_train_end(self, args, state, control, **kwargs):
            profiler.disable()

    return StepProfiler()


def build_trainer(mode: str, depth: int, hidden: int, batch: int, max_steps: int, bf16: bool, output_dir: str):
    """The trainer of ``mode`` on the tiny model and short rows; returns ``(trainer, loss_of)`` where
    ``loss_of(model, batch)`` is the mode's training loss of one collated batch."""
    import torch
    from peft import LoraConfig

    from benchmarks.workload import pad_to_longest, word_tokenizer

    model = tiny_qwen3(depth, hidden)
    if bf16:
        model = model.to(torch.bfloat16)
    rows = short_rows(batch * max_steps * 2)
    common = dict(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=batch, learning_rate=1e-4,
                  logging_steps=10_000, save_strategy="no", report_to="none", bf16=bf16, seed=0, disable_tqdm=True,
                  use_cpu=True, dataloader_pin_memory=False)
    if mode == "baseline":
        import peft
        from transformers import Trainer, TrainingArguments

        lora = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
        model.enable_input_require_grads()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer = Trainer(model=model, args=TrainingArguments(remove_unused_columns=False, **common),
                          train_dataset=rows, data_collator=pad_to_longest)

        def loss_of(m, inputs):
            return m(**inputs).loss

        return trainer, loss_of
    if mode != "swiftune":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    import swiftune
    from swiftune.data import FormattingStats, TokenizedDataset

    # attention "reference": one masked attention call per layer, as varlen / flash make one kernel call
    # on the GPU (the CPU's per-document sdpa would add a Python loop over the documents)
    swiftune.patch_model(model, attention=ATTENTION, kernel_backend="auto")
    model = swiftune.FastModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=True)
    data = TokenizedDataset([{"input_ids": r["input_ids"], "completion_mask": None} for r in rows],
                            FormattingStats(data_shape="pretokenized"))
    trainer = swiftune.SFTTrainer(model=model, args=swiftune.SFTConfig(max_length=1024, **common), train_dataset=data,
                                  processing_class=word_tokenizer(256))

    def loss_of(m, inputs):
        return trainer.compute_loss(m, dict(inputs), num_items_in_batch=None)

    return trainer, loss_of


def _forward_backward_times(trainer, loss_of, batches: list, steps: int) -> list[float]:
    """Wall seconds of the loss's forward + backward on each of ``batches`` (cycled ``steps`` times),
    under the trainer's autocast (and swiftune's per-step LoRA casting)."""
    from swiftune.training.lora_casting import training_step_lora_casting

    model = trainer.model
    model.train()
    out = []
    for i in range(steps):
        inputs = trainer._prepare_inputs(dict(batches[i % len(batches)]))
        with contextlib.ExitStack() as stack:
            if hasattr(trainer, "token_meter"):  # swiftune's step: LoRA casting as its training_step sets it
                stack.enter_context(training_step_lora_casting(model, trainer.args))
            start = clock()  # (the casting switch is the trainer's work, counted in the step)
            with trainer.autocast_smart_context_manager():
                loss = loss_of(model, inputs)
            loss.backward()
            out.append(clock() - start)
        model.zero_grad(set_to_none=True)
    return out


def _optimizer_times(trainer, steps: int) -> list[float]:
    """Wall seconds of ``optimizer.step()`` + ``zero_grad()`` with gradients present (lr 0: the
    weights do not move)."""
    import torch

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0)
    out = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.zeros_like(p)
        start = clock()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(clock() - start)
    return out


def calls_by_file(stats: pstats.Stats, steps: int, limit: int = 20) -> str:
    """The ``limit`` source files whose functions were called most, in calls per step (builtins as
    ``~``): where a step's Python calls go, by library, without the timing noise of the rest."""
    per_file: dict[str, int] = {}
    for (filename, _line, _name), (_primitive, calls, *_rest) in stats.stats.items():
        short = filename.split("site-packages/")[-1]
        per_file[short] = per_file.get(short, 0) + calls
    top = sorted(per_file.items(), key=lambda kv: -kv[1])[:limit]
    return "Python calls per step by file\n" + "".join(f"{calls / steps:12.0f}  {name}\n" for name, calls in top)


def profile_top(profiler: cProfile.Profile, limit: int = 20, steps: int = 1) -> str:
    """The ``limit`` functions of ``profiler`` with the largest cumulative time, then those with the
    largest own time, as pstats prints them, then the files called most (per step of ``steps``)."""
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("cumulative").print_stats(limit)
    stats.sort_stats("tottime").print_stats(limit)
    return buf.getvalue() + calls_by_file(stats, steps, limit)


def measure(mode: str, depth: int, hidden: int, batch: int, steps: int, warmup: int, profile_steps: int,
            bf16: bool) -> dict:
    """Host milliseconds per step of ``mode`` (see the module doc) and the cProfile text."""
    total = warmup + steps + profile_steps
    trainer, loss_of = build_trainer(mode, depth, hidden, batch, total, bf16, f"/tmp/host_overhead_{mode}")
    step_seconds: list[float] = []
    profiler = cProfile.Profile()
    trainer.add_callback(_step_timer(step_seconds, warmup, warmup + steps))
    inner_seconds: list[float] = []  # each training_step call (forward + backward + the step's guards)
    inner = trainer.training_step

    def timed_training_step(*a, **k):
        start = clock()
        try:
            return inner(*a, **k)
        finally:
            inner_seconds.append(clock() - start)

    trainer.training_step = timed_training_step
    if profile_steps:
        trainer.add_callback(_step_profiler(profiler, warmup + steps))
    trainer.train()
    loader = trainer.get_train_dataloader()
    batches = [b for b, _ in zip(loader, range(4))]
    _forward_backward_times(trainer, loss_of, batches, warmup)  # warm-up
    fwd_bwd = _forward_backward_times(trainer, loss_of, batches, steps)
    optimizer = _optimizer_times(trainer, steps)
    step_ms, fwd_bwd_ms = _median_ms(step_seconds), _median_ms(fwd_bwd)
    training_step_ms = _median_ms(inner_seconds[warmup:warmup + steps])
    calls = pstats.Stats(profiler).total_calls / profile_steps if profile_steps else None
    return dict(mode=mode, depth=depth, hidden=hidden, batch=batch, steps=steps, bf16=bf16,
                tokens_per_batch=statistics.mean(int(b["input_ids"].numel()) for b in batches),
                step_ms=step_ms, forward_backward_ms=fwd_bwd_ms, optimizer_ms=_median_ms(optimizer),
                training_step_ms=training_step_ms, trainer_own_ms=step_ms - training_step_ms,
                python_calls_per_step=calls,
                profile=profile_top(profiler, steps=profile_steps) if profile_steps else "")


PARTS = (("step", "step_ms"), ("training_step", "training_step_ms"), ("trainer_own", "trainer_own_ms"),
         ("forward_backward", "forward_backward_ms"), ("optimizer", "optimizer_ms"))


def rows_of(measured: list[dict], ctx: results.Context) -> list[results.Row]:
    """The result rows (metric ``host_ms_per_step``, mode ``host_overhead``) of ``measure``'s dicts."""
    out = []
    for m in measured:
        settings = {"depth": m["depth"], "hidden": m["hidden"], "batch": m["batch"], "timed_steps": m["steps"],
                    "bf16": m["bf16"], "layout": "padding_free" if m["mode"] == "swiftune" else "padded"}
        for part, key in PARTS:
            out.append(ctx.row(TOOLS[m["mode"]], "host_overhead", f"qwen3-tiny-d{m['depth']}",
                               {**settings, "part": part}, "host_ms_per_step", m[key]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-depth", type=int, default=36, help="decoder layers (Qwen3-8B: 36)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (tiny: compute negligible)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed steps per part")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=5, help="trainer steps under cProfile (after the timed ones)")
    p.add_argument("--fp32", action="store_true", help="float32 without autocast (default: bf16 as on the GPU)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--out", help="write the measurements as JSON here")
    p.add_argument("--rows", help="write the result rows here (default: the --out path with .rows.jsonl)")
    p.add_argument("--profile-out", default="host_overhead_profile.txt",
                   help="the cProfile top 20 by cumulative time, per mode")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 runs the kernels through the Triton interpreter, whose host time is not the "
                "GPU's: unset it (the kernels then run their plain-PyTorch references on CPU)")
    if args.model_depth < 1 or args.steps < 1 or args.hidden % 4 or args.hidden < 8:
        p.error("--model-depth and --steps must be >= 1, --hidden a multiple of 4 (>= 8)")
    import torch

    if torch.cuda.is_available():
        p.error("a CPU measurement: on a GPU the step's time is the device's too; run with CUDA_VISIBLE_DEVICES=''")
    torch.set_num_threads(1)  # the host's own work, not intra-op threading of tiny ops
    measured = [measure(mode, args.model_depth, args.hidden, args.batch, args.steps, args.warmup,
                        args.profile_steps, not args.fp32) for mode in args.modes]
    if args.profile_out:
        with open(args.profile_out, "w") as f:
            for m in measured:
                f.write(f"===== {m['mode']}: {args.profile_steps} trainer steps, top 20 by cumulative time\n")
                f.write(m["profile"] + "\n")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{k: v for k, v in m.items() if k != "profile"} for m in measured], f, indent=1)
    path = results.rows_path(args.rows, args.out)
    if path:
        ctx = results.run_context("host_overhead", argv)
        n = results.write_rows(path, rows_of(measured, ctx))
        print(f"# {n} result rows: {path}", file=sys.stderr, flush=True)
    print(f"\nhost ms per step, Qwen3 depth {args.model_depth}, hidden {args.hidden}, batch {args.batch}, "
          f"{'fp32' if args.fp32 else 'bf16 autocast'}, median of {args.steps}")
    print(f"{'mode':<10} {'step':>8} {'tr_step':>8} {'trainer':>8} {'fwd+bwd':>8} {'optim':>8} {'tok/batch':>9} "
          f"{'calls/step':>10}")
    for m in measured:
        calls = f"{m['python_calls_per_step']:10.0f}" if m["python_calls_per_step"] else f"{'-':>10}"
        print(f"{m['mode']:<10} {m['step_ms']:8.1f} {m['training_step_ms']:8.1f} {m['trainer_own_ms']:8.1f} "
              f"{m['forward_backward_ms']:8.1f} {m['optimizer_ms']:8.1f} {m['tokens_per_batch']:9.0f} {calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
