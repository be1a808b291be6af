"""SFT throughput and peak memory: swiftune against the tools users would run instead.

Every mode trains the same random-init model shape on the same rows (lengths of the reference
instruction workload, see workload.py) in the same order, with LoRA r=16 on all linear layers,
bf16 weights, gradient checkpointing, AdamW, for the same number of steps; each mode runs in its
own process so that no patching leaks between them. Reported: non-padding tokens per second
over the timed steps (after warm-up), peak GPU memory, padding fraction of the batches.

Modes:
  hf_padded         transformers Trainer + PEFT, right padding to the longest row, sdpa
  trl_padding_free  TRL SFTTrainer, padding_free=True (its own collator and loss)
  trl_liger         the same with use_liger_kernel=True
  swiftune          swiftune SFTTrainer, padding-free (default)
  swiftune_peft_lora
                    swiftune SFTTrainer, padding-free, with PEFT's own LoRA forwards (the fused LoRA
                    linear of swiftune.models.lora_linear switched off: its A/B)
  swiftune_graphs   swiftune SFTTrainer, padding-free, each decoder layer's forward and backward replayed
                    as CUDA graphs (SFTConfig.cuda_graph_layers; an A/B mode: captures per token bucket
                    happen in the first steps, so give it --warmup enough to see the run's buckets)
  swiftune_host_graphs
                    swiftune_graphs with the layer inputs in pinned host memory between forward and backward
                    (SFTConfig(cuda_graph_layers=True, activation_offloading=True): a ring of three on the GPU)
  swiftune_budget_graphs
                    micro-batches of --budget tokens with graphed layers
  swiftune_budget_fit
                    micro-batches of --budget tokens, offloaded checkpointing with its automatic GPU budget:
                    only the layer inputs the GPU (or --gpu-budget-gb) cannot hold go to pinned host memory
  swiftune_offload  swiftune SFTTrainer, padding-free batches, every layer checkpoint in pinned host
                    memory (the least GPU memory at a batch size; an A/B mode)
  swiftune_offload_untiled
                    the same with the MLP and LoRA projections untiled (``get_peft_model(..., tiled_mlp=False)``):
                    tiles bound a long row's temporaries, which a batch of short rows
                    does not need, and each tile is more launches and a recompute of its MLP
  swiftune_budget_offload_untiled, swiftune_budget_fit_untiled
                    swiftune_budget_offload / swiftune_budget_fit with the MLP and projections untiled (the same A/B)
  swiftune_budget   swiftune SFTTrainer, micro-batches of --budget tokens (token budget)
  swiftune_budget_offload
                    the same with every layer checkpoint in pinned host memory and the LoRA
                    projections tiled (use_gradient_checkpointing="offload", GPU budget 0): the
                    least GPU memory (its cost: docs/benchmarks.md)

    python -m benchmarks.sft --model qwen3-8b --batch 16 --modes hf_padded swiftune swiftune_budget
    python -m benchmarks.sft --model qwen3-0.6b --batch 1 2 4 8 16 32        # the batch sweep
    python -m benchmarks.sft --model qwen3-0.6b --batch 16 --full             # full fine-tuning row
    python -m benchmarks.sft --one swiftune --model qwen3-0.6b --batch 8     # one mode, JSON on stdout

The token-budget modes take micro-batches of ``--budget`` tokens whatever the batch size, so they
run once, reported beside batch 16 (or the largest batch of the sweep). One process per mode runs
every batch size of the sweep (a fresh model and trainer per batch size,
peak memory reset between them), so imports and CUDA start-up are paid once per mode; a batch size
that runs out of memory is reported as such and the next one still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

from benchmarks import child_env, module_command, results
from benchmarks.child_output import failure_summary


ALL_MODES = ["hf_padded", "trl_padding_free", "trl_liger", "swiftune", "swiftune_budget", "swiftune_budget_offload"]
# A/B modes, run only when named in --modes
EXTRA_MODES = ["swiftune_peft_lora", "swiftune_offload", "swiftune_offload_untiled", "swiftune_budget_offload_untiled",
               "swiftune_graphs", "swiftune_host_graphs", "swiftune_budget_graphs",
               "swiftune_budget_fit", "swiftune_budget_fit_untiled"]


class CountingCollator:
    """Wraps a collator; counts the real (non-padding) tokens and padding slots it emits."""

    def __init__(self, inner, pad_token_id):
        self.inner, self.pad = inner, pad_token_id
        self.tokens = 0
        self.slots = 0

    def __call__(self, examples):
        self.tokens += sum(len(e["input_ids"]) for e in examples)
        batch = self.inner(examples)
        self.slots += batch["input_ids"].numel()
        return batch


def timing_callback(warmup: int, record: dict, step_sync: str = "each"):
    """Times the steps after ``warmup``. ``step_sync="each"``: the device is synchronised at the end of every
    step, so each step's time is its own (and a step that captured graphs can be left out: the steady
    figure), but the device idles while the host prepares the next step; ``"ends"``: only at the end of the
    warm-up and of the last step, as in a training run, whose host prepares a step while the device still
    runs the one before (no per-step times then: one window)."""
    import torch
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends = state.global_step in (warmup, state.max_steps)
            if torch.cuda.is_available() and (step_sync == "each" or ends):
                torch.cuda.synchronize()
            if step_sync != "each":
                if ends:
                    _window_end(state.global_step == warmup, record)
                return
            now, tokens = time.perf_counter(), record["counter"].tokens
            if state.global_step == warmup:
                record["t0"], record["tokens0"] = now, tokens
                record["frames0"] = _compiled_frames()
            if state.global_step > warmup:  # per timed step: its seconds, tokens and (graphed layers) captures
                captures = record["captures"]() if "captures" in record else 0
                record.setdefault("per_step", []).append(
                    (now - record["t1"], tokens - record["tokens1"], captures - record.get("captures1", 0)))
                record["captures1"] = captures
            elif "captures" in record:
                record["captures1"] = record["captures"]()
            record["t1"], record["tokens1"] = now, tokens

    return Timer()


def _compiled_frames() -> int:
    """The frames torch.compile has compiled in this process so far (flex attention's included): a compile in
    the timed steps costs seconds, and a row's speed read without that count can hide one."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def _compile_stats(record: dict) -> dict:
    """``{"compiled_frames": N, "compiled_frames_timed": M}`` (M of the N in the timed steps; per-step sync only)
    and the slowest timed step's seconds; empty where nothing was compiled and no step was timed apart."""
    out = {}
    frames = _compiled_frames()
    if frames:
        out["compiled_frames"] = frames
        if "frames0" in record:
            out["compiled_frames_timed"] = frames - record["frames0"]
    if record.get("per_step"):
        out["slowest_step_s"] = max(sec for sec, _, _ in record["per_step"])
    return out


def _window_end(start: bool, record: dict) -> None:
    """One end of a timing window synchronised only at its ends: its time, tokens and graph captures."""
    now, tokens = time.perf_counter(), record["counter"].tokens
    captures = record["captures"]() if "captures" in record else 0
    if start:
        record["t0"], record["tokens0"], record["captures0"] = now, tokens, captures
    else:
        record["t1"], record["tokens1"] = now, tokens
        record["window_captures"] = captures - record.get("captures0", 0)


def run_one(mode: str, model_name: str, batch: int, steps: int, warmup: int, budget: int, max_length: int,
            full: bool = False, memory_profile: bool = False, logit_chunk_tokens: int | None = None,
            time_profile: bool = False, host_profile: bool = False, load_in_4bit: bool = False,
            gpu_budget_gb: float | None = None, load_in_fp8: bool = False, deferred_check: bool = False,
            step_sync: str = "each", target_parameters: list[str] | None = None) -> dict:
    """One mode at one batch size; ``full``: every weight trained (no LoRA) in every mode;
    ``memory_profile`` (CUDA): what is alive at the peak of the last warm-up step (untimed);
    ``time_profile`` (CUDA): device time by kind of kernel over that step, against its wall time;
    ``host_profile``: the host's own time in that step by library (cProfile; CPU too);
    ``logit_chunk_tokens``: swiftune modes' ``SFTConfig.logit_chunk_tokens`` (None: automatic);
    ``load_in_4bit``: QLoRA, the decoder's linear weights in NF4 in every mode (LoRA only);
    ``load_in_fp8``: the decoder's linear weights in FP8 (e4m3, per-row scales) in every mode (LoRA only);
    ``gpu_budget_gb`` (CUDA): a smaller GPU emulated (``torch.cuda.set_per_process_memory_fraction``);
    ``deferred_check``: swiftune modes' ``SFTConfig.deferred_nonfinite_check`` (no device sync per step);
    ``target_parameters``: PEFT's ``LoraConfig.target_parameters`` beside ``"all-linear"`` in every mode (MoE experts
    stored as parameters, e.g. gpt-oss's ``mlp.experts.gate_up_proj``, which ``"all-linear"`` does not reach)."""
    import torch
    from peft import LoraConfig

    from benchmarks.workload import (emulate_gpu_budget, random_model, random_token_rows, sample_lengths,
                                     step_context_callback, word_tokenizer)

    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke test of the script
    if gpu_budget_gb is not None and device == "cuda":
        emulate_gpu_budget(gpu_budget_gb)
    model = random_model(model_name, device, torch.bfloat16)
    if load_in_4bit:
        from benchmarks.workload import quantize_linears_4bit

        quantize_linears_4bit(model, torch.bfloat16 if device == "cuda" else torch.float32)
    if load_in_fp8:
        from benchmarks.workload import quantize_linears_fp8

        quantize_linears_fp8(model)
    config = model.config
    n_rows = max(steps * batch * 2, 512)
    rows = random_token_rows(sample_lengths(n_rows, max_length=max_length), config.vocab_size)
    targets = {"target_parameters": list(target_parameters)} if target_parameters else {}
    lora = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM",
                      **targets)
    common = dict(output_dir=f"/tmp/bench_sft_{mode}", max_steps=steps, per_device_train_batch_size=batch,
                  learning_rate=1e-4, logging_steps=10_000, save_strategy="no", report_to="none", bf16=True,
                  gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                  dataloader_pin_memory=device == "cuda", seed=0, disable_tqdm=True, use_cpu=device == "cpu")
    if device == "cpu":
        common["bf16"] = False
    record: dict = {}
    if mode == "hf_padded":
        import peft
        from transformers import Trainer, TrainingArguments

        if not full:
            model = peft.get_peft_model(model, lora)
            model.enable_input_require_grads()

        from benchmarks.workload import pad_to_longest as pad_collate

        counter = CountingCollator(pad_collate, 0)
        trainer = Trainer(model=model, args=TrainingArguments(remove_unused_columns=False, **common),
                          train_dataset=rows, data_collator=counter)
    elif mode.startswith("trl"):
        import datasets
        import trl

        args = trl.SFTConfig(padding_free=True, max_length=None, use_liger_kernel=(mode == "trl_liger"),
                             dataset_num_proc=None, **common)
        tok = word_tokenizer(256)  # pre-tokenized rows: pad and eos ids are all the trainers read
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                 peft_config=None if full else lora, processing_class=tok)
        counter = CountingCollator(trainer.data_collator, 0)
        trainer.data_collator = counter
    else:
        import swiftune
        from swiftune.data import FormattingStats, TokenizedDataset

        offload = mode.removesuffix("_untiled") in ("swiftune_budget_offload", "swiftune_offload")
        # swiftune_budget_fit: offloaded checkpointing with its automatic GPU budget (only the layer inputs the
        # GPU cannot hold go to the host): with --gpu-budget-gb, the least offloading that fits that GPU
        gc_mode = "offload" if offload or mode.removesuffix("_untiled") == "swiftune_budget_fit" else True
        budget_0 = 0 if offload else None  # every layer input to the host, not only those the GPU cannot hold
        if full:
            swiftune.FastModel.for_training(model, use_gradient_checkpointing=gc_mode, offload_gpu_budget_bytes=budget_0)
        else:
            model = swiftune.FastModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=gc_mode,
                                                      offload_gpu_budget_bytes=budget_0,
                                                      tiled_mlp=False if mode.endswith("_untiled") else None,
                                                      **targets)
        examples = [{"input_ids": r["input_ids"], "completion_mask": None} for r in rows]
        data = TokenizedDataset(examples, FormattingStats(data_shape="pretokenized"))
        extra = dict(max_tokens_per_batch=budget) if mode.startswith("swiftune_budget") else {}
        if logit_chunk_tokens is not None:
            extra["logit_chunk_tokens"] = logit_chunk_tokens
        if mode.endswith("_graphs"):
            extra["cuda_graph_layers"] = True
        if mode == "swiftune_host_graphs":
            extra["activation_offloading"] = True
        if deferred_check:
            extra["deferred_nonfinite_check"] = True
        common.pop("gradient_checkpointing_kwargs")
        common["gradient_checkpointing"] = False  # already enabled by get_peft_model / for_training
        trainer = swiftune.SFTTrainer(
            model=model, args=swiftune.SFTConfig(max_length=max_length, **extra, **common),
            train_dataset=data, processing_class=word_tokenizer(256),
        )
        if mode == "swiftune_peft_lora":
            from swiftune.models.lora_linear import unfuse_lora_linears

            unfuse_lora_linears(trainer.model)
        counter = CountingCollator(trainer.data_collator, 0)
        trainer.data_collator = counter
    record["counter"] = counter
    params = list(trainer.model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    if memory_profile and device == "cuda":  # before the timer: its t0 is taken after the profiled step
        from benchmarks.memory_profile import peak_profile

        trainer.add_callback(step_context_callback(warmup, lambda: peak_profile(record)))
    elif time_profile and device == "cuda":  # (one profiler at a time)
        trainer.add_callback(step_context_callback(warmup, lambda: _profiled_step(record, trainer.model)))
    elif host_profile:
        from benchmarks.time_profile import host_time_profile

        trainer.add_callback(step_context_callback(warmup, lambda: host_time_profile(record)))
    if mode.endswith("_graphs"):
        record["captures"] = lambda: _graph_stats(trainer.model).get("captures", 0)
    trainer.add_callback(timing_callback(warmup, record, step_sync))
    trainer.train()
    elapsed = record["t1"] - record["t0"]
    tokens = record["tokens1"] - record["tokens0"]
    return dict(mode=mode, model=model_name, batch=batch,
                finetune="full" if full else ("qlora r=16" if load_in_4bit else "fp8 lora r=16" if load_in_fp8
                                              else "lora r=16"),
                **({"gpu_budget_gb": gpu_budget_gb} if gpu_budget_gb is not None else {}),
                **({"deferred_nonfinite_check": True} if deferred_check and mode.startswith("swiftune") else {}),
                **({"lora_target_parameters": list(target_parameters)} if target_parameters else {}),
                **({"logit_chunk_tokens": logit_chunk_tokens} if logit_chunk_tokens and mode.startswith("swiftune") else {}),
                trainable_fraction=trainable / sum(p.numel() for p in params),
                steps=steps - warmup, tokens_per_s=tokens / elapsed,
                peak_gb=torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0, sec_per_step=elapsed / (steps - warmup),
                padding_fraction=1 - counter.tokens / max(counter.slots, 1),
                **({"peak_profile": record["peak_profile"]} if "peak_profile" in record else {}),
                **({"time_profile": record["profile"]} if "profile" in record else {}),
                **({"host_profile": record["host_profile"]} if "host_profile" in record else {}),
                **({"step_sync": step_sync} if step_sync != "each" else {}),
                **_compile_stats(record),
                **({"graphs": _graph_stats(trainer.model), **_steady_state(record, tokens / elapsed)}
                   if mode.endswith("_graphs") else {}),
                **({"offload": _offload_counts(trainer.model)} if mode.startswith("swiftune") and gc_mode == "offload" else {}))


@contextlib.contextmanager
def _profiled_step(record: dict, model):
    """:func:`benchmarks.time_profile.timed_device_profile` of one step, plus the token slots the step embedded
    (``step_token_slots``: the input ids' elements, padding included; counted from shapes, so no device sync)
    and, with graphed layers, the graphs it captured (``step_captures``: such a step is not a steady one).
    Device milliseconds per token of this step, times the tokens per second of the unprofiled steps, is the
    device's busy share of those steps, free of the profiler's own host cost."""
    from benchmarks.time_profile import timed_device_profile

    slots = [0]

    def count(_module, args):
        slots[0] += args[0].numel()

    captures = record.get("captures", lambda: 0)  # graphed layers: a step that captures also runs eagerly
    before = captures()
    handle = model.get_input_embeddings().register_forward_pre_hook(count)
    try:
        with timed_device_profile(record):
            yield
    finally:
        handle.remove()
    record["profile"]["step_token_slots"] = slots[0]
    record["profile"]["step_captures"] = captures() - before


def _offload_counts(model) -> dict:
    """How the last step's plan placed the layer inputs (kept on the GPU, sent to the host, re-derived),
    and the seconds the run spent allocating pinned host pages (the pool grows with the largest
    micro-batch seen; a later mode in the same process may reuse torch's cached pinned blocks)."""
    from swiftune.training import offload_stats

    stats = offload_stats(model)
    return {"kept": len(stats.get("keep", ())), "offloaded": len(stats.get("offload", ())),
            "derived": len(stats.get("derived", ())), "host_alloc_s": stats.get("host_alloc_seconds", 0.0),
            "host_pinned_gb": stats.get("host_pinned_bytes", 0) / 1e9}


def _steady_state(record: dict, window_tokens_per_s: float) -> dict:
    """The timed steps that captured no graph (a long run's steps once its token buckets are captured):
    their tokens/s, and how many timed steps captured. Timed as one window (``step_sync="ends"``): the
    window's tokens/s when none of its steps captured, else none (how many captures it had instead)."""
    if "window_captures" in record:
        n = record["window_captures"]
        return {"window_captures": n, "steady_tokens_per_s": None if n else window_tokens_per_s}
    steps = record.get("per_step", [])
    steady = [(s, t) for s, t, c in steps if c == 0]
    seconds = sum(s for s, _ in steady)
    return {"steps_capturing": len(steps) - len(steady), "steady_steps": len(steady),
            "steady_tokens_per_s": sum(t for _, t in steady) / seconds if seconds else None}


def _graph_stats(model) -> dict:
    from swiftune.training import graphed_layer_stats

    return graphed_layer_stats(model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch", type=int, nargs="+", default=[16])
    p.add_argument("--modes", nargs="+", default=ALL_MODES)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch for swiftune_budget")
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--full", action="store_true", help="full fine-tuning (every weight, no LoRA) in every mode")
    p.add_argument("--memory-profile", action="store_true",
                   help="CUDA: the allocation sites alive at the peak of the last warm-up step, per mode")
    p.add_argument("--time-profile", action="store_true",
                   help="CUDA: device time by kind of kernel over the last warm-up step, against its wall time "
                        "(is the step bound by the GPU or by the host?); not with --memory-profile")
    p.add_argument("--host-profile", action="store_true",
                   help="the host's own time over the last warm-up step by library and function (cProfile): "
                        "what a host-bound step (small device-busy share in --time-profile) spends it on")
    p.add_argument("--logit-chunk-tokens", type=int, default=None,
                   help="swiftune modes: tokens per chunk of the fused LM head + loss (default: automatic, "
                        "up to 1,024 as free memory allows)")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: the decoder's linear weights in bitsandbytes NF4 (double quantisation) in every mode")
    p.add_argument("--load-in-fp8", action="store_true",
                   help="the decoder's linear weights in FP8 (e4m3, a float32 scale per row) in every mode")
    p.add_argument("--gpu-budget-gb", type=float, default=None,
                   help="CUDA: emulate a GPU of this many GB (1e9 bytes) in every mode")
    p.add_argument("--deferred-nonfinite-check", action="store_true",
                   help="swiftune modes: SFTConfig(deferred_nonfinite_check=True), the NaN/inf guards without a "
                        "device sync per step (an A/B against the same command without it)")
    p.add_argument("--step-sync", choices=["each", "ends"], default="each",
                   help="each: synchronise the device after every timed step (per-step times; the steady figure "
                        "leaves out steps that captured graphs); ends: only around the timed window, so the host "
                        "prepares a step while the device runs the one before, as in training")
    p.add_argument("--lora-target-parameters", nargs="+", default=None, metavar="NAME",
                   help="PEFT target_parameters added to every mode's LoRA (all-linear): MoE experts stored as "
                        "parameters, e.g. mlp.experts.gate_up_proj mlp.experts.down_proj on gpt-oss")
    p.add_argument("--one", help="run a single mode in this process and print its JSON")
    p.add_argument("--out", help="write all rows as JSON here")
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the --out path with .rows.jsonl)")
    args = p.parse_args(argv)
    if args.memory_profile + args.time_profile + args.host_profile > 1:
        p.error("--memory-profile, --time-profile and --host-profile each profile the last warm-up step: "
                "run one at a time")
    if args.load_in_4bit and args.full:
        p.error("--load-in-4bit trains LoRA adapters: not with --full")
    if args.load_in_fp8 and (args.full or args.load_in_4bit):
        p.error("--load-in-fp8 trains LoRA adapters on FP8 weights: not with --full or --load-in-4bit")
    if args.one:
        from benchmarks.workload import reset_cuda_memory

        for batch in args.batch:
            try:
                row = run_one(args.one, args.model, batch, args.steps, args.warmup, args.budget, args.max_length,
                              full=args.full, memory_profile=args.memory_profile,
                              logit_chunk_tokens=args.logit_chunk_tokens, time_profile=args.time_profile,
                              host_profile=args.host_profile, load_in_4bit=args.load_in_4bit,
                              gpu_budget_gb=args.gpu_budget_gb, load_in_fp8=args.load_in_fp8,
                              deferred_check=args.deferred_nonfinite_check, step_sync=args.step_sync,
                              target_parameters=args.lora_target_parameters)
            except Exception as e:  # noqa: BLE001 - out of memory (or a baseline failing): report, go on
                row = dict(mode=args.one, model=args.model, batch=batch,
                           error=f"{type(e).__name__}: {str(e).splitlines()[0][:250]}")
            print("RESULT " + json.dumps(row), flush=True)
            reset_cuda_memory(reset_peak=True)  # what the last run left (model, trainer, optimizer)
        return 0
    rows = []
    for mode in args.modes:
        # a token-budget micro-batch ignores the row count: measure it once, beside batch 16
        batches = [16 if 16 in args.batch else max(args.batch)] if mode.startswith("swiftune_budget") else args.batch
        cmd = [*module_command("sft", "--one", mode), "--model", args.model, "--batch", *map(str, batches),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--budget", str(args.budget),
               "--max_length", str(args.max_length), *(["--full"] if args.full else []),
               *(["--memory-profile"] if args.memory_profile else []),
               *(["--time-profile"] if args.time_profile else []),
               *(["--host-profile"] if args.host_profile else []),
               *(["--load-in-4bit"] if args.load_in_4bit else []),
               *(["--load-in-fp8"] if args.load_in_fp8 else []),
               *(["--deferred-nonfinite-check"] if args.deferred_nonfinite_check else []),
               *(["--step-sync", args.step_sync] if args.step_sync != "each" else []),
               *(["--lora-target-parameters", *args.lora_target_parameters] if args.lora_target_parameters else []),
               *(["--gpu-budget-gb", str(args.gpu_budget_gb)] if args.gpu_budget_gb is not None else []),
               *(["--logit-chunk-tokens", str(args.logit_chunk_tokens)] if args.logit_chunk_tokens else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
        found = {}
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                row = json.loads(line[7:])
                found[row["batch"]] = row
        err = failure_summary(proc.stderr or proc.stdout, 300)
        for batch in batches:
            rows.append(found.get(batch) or dict(mode=mode, model=args.model, batch=batch, error=err))
            print(json.dumps(rows[-1]), flush=True)
    rows.sort(key=lambda r: (r["batch"], args.modes.index(r["mode"])))
    for r in rows:  # (before the table, which comes last)
        if "peak_profile" in r:
            from benchmarks.memory_profile import format_breakdown

            print(f"\nmemory at the peak: {r['mode']} batch {r['batch']}\n{format_breakdown(r['peak_profile'])}")
        if "time_profile" in r:
            from benchmarks.time_profile import format_profile

            print("\n" + format_profile(r["time_profile"], f"{r['mode']} batch {r['batch']}, one step"))
        if "host_profile" in r:
            from benchmarks.time_profile import format_host_profile

            print("\n" + format_host_profile(r["host_profile"], f"{r['mode']} batch {r['batch']}, one step"))
    base = {r["batch"]: r for r in rows if r["mode"] == "hf_padded" and "error" not in r}
    print(f"\n{'mode':<24} {'model':<11} {'batch':>5} {'tok/s':>8} {'x hf_padded':>11} {'peak GB':>8} "
          f"{'s/step':>7} {'padding':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<24} {r['model']:<11} {r['batch']:>5}  FAILED: {r['error'][:150]}")
            continue
        ratio = r["tokens_per_s"] / base[r["batch"]]["tokens_per_s"] if r["batch"] in base else float("nan")
        print(f"{r['mode']:<24} {r['model']:<11} {r['batch']:>5} {r['tokens_per_s']:8.0f} {ratio:11.2f} "
              f"{r['peak_gb']:8.1f} {r['sec_per_step']:7.2f} {r['padding_fraction']:8.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    results.save("sft", argv, rows, args.out, args.rows, warmup=args.warmup, max_length=args.max_length)
    return 0


if __name__ == "__main__":
    sys.exit(main())
