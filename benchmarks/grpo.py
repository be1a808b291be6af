"""GRPO on the GPU: one full step timed per phase, and the longest completion that fits.

**Step** (default). One step of ``swiftune.GRPOTrainer`` on a random-init
model (bf16 weights, LoRA r=16 on all linear layers, gradient checkpointing), rollouts included:
``--generations`` (G, default 8) completions of one prompt of ``--prompt-tokens`` (256) random token
ids, sampled by the built-in engine the trainer picks (``--engine``: ``FastRolloutEngine`` on CUDA,
``TransformersRolloutEngine`` on CPU) with **no stop token** (the engine is called with
``stop_token_ids=()``), so every completion runs to ``max_completion_length``
(``--completion-tokens``, default 4096); a token-parity reward (share of even token ids) gives
non-zero advantages; ``beta`` 0.04 so that the reference pass (the same model, adapters disabled)
runs. Phases, each with its wall time and peak GPU memory (``max_memory_allocated`` reset at its
start): ``generation``, ``logps_no_grad`` (reference and, with ``--num-iterations 2``, old
log-probs), ``policy_forward`` (packed, shared-prompt row + chunked log-prob loss),
``policy_backward``, and ``other`` (rewards, packing, optimizer step). Before the timed step one
untimed warm-up compiles the kernels on the same row shape (policy forward + backward, a no-grad
forward, a 16-token generation).

**Bisection** (``--bisect-completion``; the GRPO part of the "largest step" figure). The largest completion
length per row that fits one GPU for the policy loss + backward of ``--bisect-rows`` (G=2) rows,
each the same 256-token prompt + its own completion (``--share-prompt``: swiftune encodes the
prompt once), generation skipped (random completion ids), no optimizer step; found by doubling
then bisection until the bracket is within ``--bisect-tol`` (5%). Every trial reports its time and
peak memory (``--completion-lengths 65536`` measures a fixed size in every mode first: the
"2 x 65,536" comparison). Modes, each in its own process (no patching leaks between them),
baselines first:

  hf_full_logits  plain transformers (sdpa) + PEFT + gradient checkpointing, padded [G, P + L]
                  batch, full logits, ``log_softmax(logits.float()).gather`` (baseline 1)
  trl_grpo        TRL's GRPOTrainer loss path (TRL 1.16: ``add_fused_lm_head`` on the model,
                  ``model(..., labels, fused_lm_head=True).log_probs`` under bf16 autocast) with
                  TRL's gradient checkpointing (baseline 2; only when trl is importable)
  trl_liger       the same with Liger-Kernel's layer kernels (RMSNorm, RoPE, SwiGLU) as TRL 1.16
                  applies them for ``use_liger_kernel=True`` (baseline 3; when liger-kernel is importable)
  trl_selective   full logits + ``trl.trainer.utils.selective_log_softmax`` (TRL's pre-fused path;
                  optional, not in the defaults)
  swiftune        ``swiftune.patch_model`` + LoRA with ``use_gradient_checkpointing="offload"``
                  (offloaded checkpoints within the GPU budget, tiled MLP), packed row,
                  ``completion_logprobs`` (chunked selective log-softmax; its saved hidden states
                  offloaded on CUDA) + ``grpo_loss``

Trials that run out of memory (GPU, or the host budget of offloaded checkpoints) count as not
fitting; a trial that kills its process (host memory exhausted) counts as not fitting and a new
process resumes the search. A mode's search stops before a trial that would overrun
``--time-budget`` (estimated from the largest finished trial, quadratic in length: attention); its
bracket is printed so that a later call resumes it with ``--bisect-lo/--bisect-hi``. On the 8B
shapes one trial at 2 x 256K tokens takes minutes (attention is quadratic per row), so the
swiftune search spans several 10-minute calls. The table is printed last; ``--out`` writes JSON
(``benchmarks/plots.py`` draws it).

    python -m benchmarks.grpo --out grpo.json                       # step, Qwen3-1.7B shape: ~3-5 min on an H200
    python -m benchmarks.grpo --model tiny                          # CPU smoke test (~15 s)
    python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes hf_full_logits trl_grpo trl_liger \\
        --completion-lengths 65536 --out grpo_bisect_base.json      # baselines: ~8 min
    python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \\
        --completion-lengths 65536 --bisect-start 131072 --out grpo_bisect_swiftune.json
    python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune \\
        --bisect-lo 262144 --bisect-hi 524288 --out grpo_bisect_swiftune2.json   # resume from the printed bracket
    python -m benchmarks.grpo --bisect-completion --model qwen3-8b --bisect-modes swiftune --fixed-only \\
        --completion-lengths 296960 --out grpo_3x_trl.json          # one size only: 3x TRL's 2 x 98,304
    python -m benchmarks.grpo --bisect-completion --model tiny --simulate-capacity 1500   # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback

from benchmarks import child_env, module_command, results
from benchmarks.child_output import failure_summary, save_child_output


from benchmarks.memory_profile import format_breakdown, peak_profile
from benchmarks.time_profile import device_time_profile, format_profile
from benchmarks.workload import emulate_gpu_budget, host_rss, reset_cuda_memory, word_tokenizer

BASELINE_MODES = ["hf_full_logits", "trl_grpo", "trl_liger", "trl_selective"]
TRL_HEAD_MODES = ("trl_grpo", "trl_liger")  # TRL's fused LM head
ALL_BISECT_MODES = BASELINE_MODES + ["swiftune"]
MODE_LABELS = {
    "hf_full_logits": "transformers + PEFT, full logits, log_softmax(float32).gather",
    "trl_grpo": "TRL GRPOTrainer loss path (add_fused_lm_head, fused_lm_head=True)",
    "trl_liger": "the same + Liger-Kernel layer kernels (TRL's use_liger_kernel=True)",
    "trl_selective": "full logits + trl selective_log_softmax",
    "swiftune": "swiftune packed row, chunked selective log-softmax, offloaded checkpoints",
}


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def default_bisect_modes() -> list[str]:
    modes = ["hf_full_logits"]
    if trl_available():
        modes.append("trl_grpo")
        if importlib.util.find_spec("liger_kernel") is not None:
            modes.append("trl_liger")
    return modes + ["swiftune"]


# ------------------------------------------------------------------------------------ helpers


def versions() -> dict:
    import peft
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    if trl_available():
        import trl

        out["trl"] = trl.__version__
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return out


class PhaseTimer:
    """Wall time and peak GPU memory of named phases (peak reset at the start of each phase)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.phases: dict[str, dict] = {}

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str):
        import torch

        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            rec = self.phases.setdefault(name, {"s": 0.0, "calls": 0, "peak_gb": 0.0})
            rec["s"] += time.perf_counter() - t0
            rec["calls"] += 1
            if self.cuda:
                rec["peak_gb"] = max(rec["peak_gb"], torch.cuda.max_memory_allocated() / 1e9)


def even_token_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Share of even token ids in the completion: random for a random model, so advantages are non-zero."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def base_model(name: str, device, load_in_4bit: bool = False, load_in_fp8: bool = False):
    """Random-init model of shape ``name`` (bf16 on CUDA), its decoder's linear weights in NF4 with
    ``load_in_4bit`` (QLoRA) or in e4m3 with per-row scales with ``load_in_fp8``."""
    import torch

    from benchmarks.workload import quantize_linears_4bit, quantize_linears_fp8, random_model

    if load_in_4bit and load_in_fp8:
        raise ValueError("load_in_4bit and load_in_fp8 are two formats of the same weights: pick one")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(name, device, dtype)
    if load_in_4bit:
        quantize_linears_4bit(model, dtype)
    if load_in_fp8:
        quantize_linears_fp8(model)
    return model


def build_swiftune_model(name: str, device, checkpointing, offload_gpu_budget_bytes: int | None = None,
                         offload_host_budget_bytes: int | None = None, load_in_4bit: bool = False,
                         load_in_fp8: bool = False):
    """Random-init model of shape ``name``, patched by swiftune, LoRA r=16 on all linear layers."""
    import swiftune

    model = base_model(name, device, load_in_4bit, load_in_fp8)
    swiftune.patch_model(model)
    return swiftune.FastModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=checkpointing,
                                             offload_gpu_budget_bytes=offload_gpu_budget_bytes,
                                             offload_host_budget_bytes=offload_host_budget_bytes)


# --------------------------------------------------------------------------------------- step


def run_step(args) -> dict:
    """One GRPOTrainer step with forced full-length rollouts, timed per phase."""
    import numpy as np
    import torch
    from transformers import TrainerCallback

    from swiftune import GRPOConfig, GRPOTrainer
    from swiftune.rl import SamplingParams, TransformersRolloutEngine, build_policy_row, completion_logprobs
    from swiftune.rl.rollout.fast import FastRolloutEngine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    timer = PhaseTimer(cuda)
    t_start = time.perf_counter()
    model = build_swiftune_model(args.model, device, True)
    vocab = model.config.vocab_size
    tokenizer = word_tokenizer(vocab)
    G, P, L = args.generations, args.prompt_tokens, args.completion_tokens
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, P).tolist() for _ in range(4)]
    rows = [{"prompt": " ".join(f"t{i}" for i in p)} for p in prompts]
    weights_gb = torch.cuda.memory_allocated() / 1e9 if cuda else 0.0
    print(f"# {versions()['device']} model {args.model} G={G} prompt {P} completion {L} beta {args.beta} "
          f"(build {time.perf_counter() - t_start:.0f} s, weights {weights_gb:.1f} GB)", flush=True)

    engine_name = args.engine or ("fast" if cuda else "transformers")
    engine_cls = FastRolloutEngine if engine_name == "fast" else TransformersRolloutEngine

    class FullLengthEngine(engine_cls):
        """The built-in engine with no stop token: every completion runs to max_completion_length."""

        def generate(self, prompt_ids, num_generations, params):
            params = dataclasses.replace(params, stop_token_ids=())
            with timer.phase("generation"):
                return super().generate(prompt_ids, num_generations, params)

    options = {"fused_layers": args.fused_layers} if engine_name == "fast" else {}
    engine = FullLengthEngine(model, pad_token_id=0, seed=0, **options)

    # ---- warm-up: compile the kernels on the step's own row shape, outside the timed step
    share = G > 1 and not args.no_share_prompt
    t0 = time.perf_counter()
    warm_comps = [rng.integers(3, vocab, L).tolist() for _ in range(G)]
    share_error = None

    def warm(share_prompt: bool) -> None:
        row = build_policy_row([prompts[0]] * G, warm_comps, share_prompt=share_prompt, group_ids=[0] * G,
                               device=device)
        model.eval()
        with torch.no_grad():
            completion_logprobs(model, row)
        model.train()
        logps, entropy = completion_logprobs(model, row, return_entropy=True)
        (logps.sum() + entropy.sum() * 0.0).backward()
        model.zero_grad(set_to_none=True)

    # the Trainer runs the model under bf16 autocast (accelerate, bf16=True): warm up the same kernels
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    if args.warmup:
        with autocast:
            try:
                warm(share)
            except Exception as e:  # noqa: BLE001 - report it and fall back to the unshared (varlen) rows
                if not share:
                    raise
                share_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"# shared-prompt rows failed in the warm-up ({share_error}); using unshared rows", flush=True)
                model.zero_grad(set_to_none=True)
                reset_cuda_memory(cuda)
                share = False
                warm(share)
            tg = time.perf_counter()
            engine.generate([prompts[0]], G, SamplingParams(max_tokens=16))
            timer.sync()
            per_token = (time.perf_counter() - tg) / 16
        print(f"# warm-up {time.perf_counter() - t0:.0f} s; decoding ~{per_token * 1e3:.0f} ms/token "
              f"-> generation of {L} tokens ~{per_token * L:.0f} s", flush=True)
        timer.phases.clear()
    warmup_s = time.perf_counter() - t0

    config = GRPOConfig(
        output_dir="/tmp/bench_grpo_step", max_steps=args.steps, per_device_train_batch_size=G, num_generations=G,
        max_prompt_length=P, max_completion_length=L, temperature=1.0, beta=args.beta, loss_type="dapo",
        num_iterations=args.num_iterations, share_prompt=share, learning_rate=1e-6, logging_steps=1,
        save_strategy="no", report_to="none", metrics_file=None, plot_rewards=False, disable_tqdm=True,
        gradient_checkpointing=False,  # already on (get_peft_model)
        bf16=cuda, use_cpu=not cuda, dataloader_pin_memory=False, seed=0,
    )
    trainer = GRPOTrainer(model, [even_token_reward], args=config, train_dataset=rows, processing_class=tokenizer,
                          rollout_engine=engine)

    def wrap(obj, attr: str, phase: str) -> None:
        orig = getattr(obj, attr)

        def timed(*a, **kw):
            with timer.phase(phase):
                return orig(*a, **kw)

        setattr(obj, attr, timed)

    wrap(trainer, "_no_grad_logps", "logps_no_grad")
    wrap(trainer, "compute_loss", "policy_forward")
    wrap(trainer.accelerator, "backward", "policy_backward")
    step: dict = {}
    captured: dict = {}
    orig_score = trainer._generate_and_score

    def score(prompt_rows):
        micro = orig_score(prompt_rows)
        captured["micro"] = micro
        return micro

    trainer._generate_and_score = score

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            timer.phases.clear()  # the reported phases are those of the last step
            timer.sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            step["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            timer.sync()
            step["t1"] = time.perf_counter()
            step["tail_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                step["logs"] = dict(logs)

    trainer.add_callback(StepTimer())
    trainer.train()

    logs = step.get("logs", {})
    step_s = step["t1"] - step["t0"]
    phases = {k: dict(v) for k, v in timer.phases.items()}
    phases["other"] = {"s": step_s - sum(v["s"] for v in phases.values()), "calls": 1, "peak_gb": None}
    micro = captured["micro"]
    lengths = [int(v) for v in torch.bincount(torch.cat([mb.row.seq_index.cpu() for mb in micro]),
                                              minlength=G).tolist()]
    peak = max([v["peak_gb"] for v in phases.values() if v["peak_gb"] is not None] + [step["tail_peak_gb"]])
    gen = phases.get("generation", {"s": float("nan")})
    return dict(
        benchmark="grpo_step", engine=engine_name, fused_layers=options.get("fused_layers", False), steps=args.steps, model=args.model,
        generations=G, prompt_tokens=P, max_completion_length=L,
        completion_lengths=lengths, all_full_length=all(n == L for n in lengths), beta=args.beta,
        num_iterations=args.num_iterations, share_prompt=share, share_prompt_error=share_error,
        policy_row_tokens=sum(mb.row.num_tokens for mb in micro), lora_r=16,
        step_s=step_s, peak_gb=peak, weights_gb=weights_gb, warmup_s=warmup_s, phases=phases,
        generated_tokens=sum(lengths), generation_tokens_per_s=sum(lengths) / gen["s"],
        reward=logs.get("reward"), reward_std=logs.get("reward_std"), loss=logs.get("loss"), kl=logs.get("kl"),
        wall_s=time.perf_counter() - t_start, **versions(),
    )


def print_step_table(r: dict) -> None:
    print(f"\n# GRPO step, {r['model']} shape, LoRA r=16, G={r['generations']}, prompt {r['prompt_tokens']}, "
          f"completions {r['max_completion_length']} (all full length: {r['all_full_length']}), "
          f"share_prompt {r['share_prompt']}, beta {r['beta']}, engine {r.get('engine')}; {r['device']}")
    print(f"{'phase':<16} {'s':>8} {'share':>6} {'peak GB':>8}")
    for name, v in r["phases"].items():
        peak = "-" if v["peak_gb"] is None or r["device"] == "cpu" else f"{v['peak_gb']:.1f}"
        print(f"{name:<16} {v['s']:8.2f} {v['s'] / r['step_s']:6.1%} {peak:>8}")
    print(f"{'step':<16} {r['step_s']:8.2f} {1:6.1%} {r['peak_gb']:8.1f}")
    print(f"generated {r['generated_tokens']} tokens at {r['generation_tokens_per_s']:.0f} tok/s; policy row "
          f"{r['policy_row_tokens']} tokens; reward {r['reward']} (std {r['reward_std']}), loss {r['loss']}")


# ------------------------------------------------------------------------------------ bisection


class OutOfTime(Exception):
    """The next trial would exceed the time budget."""


def search_max_fit(fits, start: int, max_len: int, tol: float = 0.05, granularity: int = 256,
                   lo: int | None = None, hi: int | None = None) -> tuple[int | None, int | None, str]:
    """Largest ``L`` (a multiple of ``granularity``) with ``fits(L)``: doubling from ``start`` (or
    from a known bracket ``lo`` fits / ``hi`` does not), then bisection until ``hi <= lo * (1 + tol)``.

    Returns ``(lo, hi, status)``: ``lo`` the largest length seen to fit (None: none did), ``hi`` the
    smallest seen not to (None: up to ``max_len`` everything fitted); status ``converged``,
    ``no_limit_found``, ``nothing_fits`` or ``out_of_time`` (``fits`` raised :class:`OutOfTime`).
    """
    def snap(n: int) -> int:
        return max(granularity, n // granularity * granularity)

    try:
        if lo is None and hi is None:
            n = snap(start)
            while True:
                if fits(n):
                    lo = n
                    if n >= max_len:
                        return lo, None, "no_limit_found"
                    n = min(snap(n * 2), snap(max_len))
                else:
                    hi = n
                    break
        if lo is None:  # search downwards from the failing size
            n = snap(hi // 2)
            while n < hi:
                if fits(n):
                    lo = n
                    break
                hi = n
                if n == granularity:
                    return None, hi, "nothing_fits"
                n = snap(n // 2)
        if hi is None:  # a known fitting size only: double from it
            n = snap(lo * 2)
            while fits(n):
                lo = n
                if n >= max_len:
                    return lo, None, "no_limit_found"
                n = min(snap(n * 2), snap(max_len))
            hi = n
        while hi > lo * (1 + tol) and hi - lo > granularity:
            mid = snap((lo + hi) // 2)
            if mid <= lo or mid >= hi:
                break
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo, hi, "converged"
    except OutOfTime:
        return lo, hi, "out_of_time"


def failure_frames(e: BaseException, keep: int = 8) -> list[str]:
    """The innermost ``keep`` frames of ``e``'s traceback as ``file:line function`` (paths from the
    package or repository root): an out-of-memory trial then says which step of the policy step
    asked for the allocation that did not fit."""
    def short(path: str) -> str:  # from the package (installed or src/) or from benchmarks/
        for cut in ("site-packages/", "src/"):
            if cut in path:
                return path.rsplit(cut, 1)[1]
        return "benchmarks/" + path.rsplit("benchmarks/", 1)[1] if "benchmarks/" in path else os.path.basename(path)

    return [f"{short(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)[-keep:]]


def crashed_trial(row: dict, e: BaseException, model, seconds: float) -> dict:
    """``row`` of a trial that raised something other than out-of-memory: the exception's first line, its
    innermost frames, the seconds it ran and swiftune's offload counters at that moment (layer inputs
    restored from the host and derived so far: how far backward had got, and whether a derived layer was
    being recomputed)."""
    from swiftune.training.checkpointing import offload_stats

    counters = {k: v for k, v in offload_stats(model).items()
                if k in ("derived", "offloaded", "kept", "derived_inputs", "restored", "derived_recomputed")}
    first = (str(e).splitlines() or [type(e).__name__])[0]
    return {**row, "status": "crashed", "error": f"{type(e).__name__}: {first}"[:600], "where": failure_frames(e, 12),
            "s": seconds, "offload": {k: sorted(v) if isinstance(v, (tuple, list, set, frozenset)) else v for k, v in counters.items()}}


#: Exit codes of a child the kernel killed (SIGKILL: the OOM killer when host memory runs out).
KILLED_EXIT_CODES = (137, -9)


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def _is_host_oom(e: BaseException) -> bool:
    """Host memory ran out: swiftune's offload budget, or torch's CPU allocator (``DefaultCPUAllocator:
    can't allocate memory``, a RuntimeError that names no "out of memory")."""
    return type(e).__name__ == "CheckpointBudgetError" or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e).lower())


def host_budget_bytes(args) -> int | None:
    """``--host-budget-gb`` in bytes (``None``: the machine's available host memory)."""
    gb = getattr(args, "host_budget_gb", None)
    return None if gb is None else int(gb * 1e9)


def build_bisect_model(mode: str, name: str, device, args):
    if mode == "swiftune":
        offload = args.swiftune_checkpointing in ("offload", "offload_all")
        budget = 0 if args.swiftune_checkpointing == "offload_all" else None  # 0: no layer input on the GPU
        host = host_budget_bytes(args) if offload else None
        model = build_swiftune_model(name, device, "offload" if offload else True, budget, host,
                                     getattr(args, "load_in_4bit", False), getattr(args, "load_in_fp8", False))
        kept = getattr(args, "attention_output_layers", 0)
        if offload and (args.host_margin_gb is not None or kept):  # calling again updates the budgets
            from swiftune.training.checkpointing import enable_offloaded_checkpointing

            margin = None if args.host_margin_gb is None else int(args.host_margin_gb * 1e9)
            enable_offloaded_checkpointing(model, budget, host, host_margin_bytes=margin, attention_output_layers=kept,
                                           attention_outputs_on_host=getattr(args, "attention_outputs_on_host", False))
        return model
    import peft

    model = base_model(name, device, getattr(args, "load_in_4bit", False), getattr(args, "load_in_fp8", False))
    model.config.use_cache = False
    if mode == "trl_liger":
        from benchmarks.workload import apply_liger_like_trl

        apply_liger_like_trl(model)
    if mode in TRL_HEAD_MODES:
        from trl.trainer.utils import add_fused_lm_head

        # as GRPOTrainer.__init__ does (log-probs and entropy, temperature 1.0)
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    lora = peft.LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model.train()


def policy_inputs(L: int, P: int, rows: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(L)
    prompt = torch.randint(3, vocab, (P,), generator=g)
    comps = torch.randint(3, vocab, (rows, L), generator=g)
    adv = torch.linspace(1.0, -1.0, rows)  # sum 0, like group advantages
    return prompt, comps, adv


def dapo_loss(logps, adv_per_token):
    """TRL's dapo loss at ratio 1 (one optimizer step per generation): sum(-A * r) / tokens."""
    import torch

    ratio = torch.exp(logps - logps.detach())
    return -(ratio * adv_per_token).sum() / logps.numel()


def policy_step(model, mode: str, L: int, args, device) -> None:
    """Policy forward + loss + backward of ``rows`` completions of length ``L`` on a shared prompt.
    swiftune's step, as ``GRPOTrainer.training_step`` under bf16, leaves LoRA inputs in bf16."""
    from swiftune.training.lora_casting import lora_input_casting

    skip_casts = mode == "swiftune" and device.type == "cuda"
    with lora_input_casting(model, enabled=False) if skip_casts else contextlib.nullcontext():
        _policy_step(model, mode, L, args, device)


def _policy_step(model, mode: str, L: int, args, device) -> None:
    import torch

    P, R = args.prompt_tokens, args.bisect_rows
    prompt, comps, adv = policy_inputs(L, P, R, model.config.vocab_size)
    if mode == "swiftune":
        from swiftune.rl import build_policy_row, completion_logprobs, grpo_loss

        row = build_policy_row([prompt.tolist()] * R, comps.tolist(), share_prompt=args.share_prompt,
                               group_ids=[0] * R, device=device)
        cuda = device.type == "cuda"
        # GRPOTrainer(bf16=True) runs the model under bf16 autocast (accelerate), as the TRL rows do
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            logps, _ = completion_logprobs(model, row, offload=args.offload_logits and cuda)
        loss = grpo_loss(logps, None, adv.to(device), row.seq_index, num_sequences=R, loss_type="dapo").loss
        del logps
    else:
        ids = torch.cat([prompt.expand(R, -1), comps], dim=1).to(device)
        mask = torch.ones_like(ids)
        target = comps.to(device)
        adv_tok = adv.to(device)[:, None].expand(R, L)
        if mode in TRL_HEAD_MODES:
            labels = ids.clone()
            labels[:, :-L] = -100
            cuda = device.type == "cuda"
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
                out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            logps = out.log_probs[:, -L:]
            del out
        else:
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=L + 1, use_cache=False).logits[:, :-1]
            if mode == "trl_selective":
                from trl.trainer.utils import selective_log_softmax

                logps = selective_log_softmax(logits, target)
            else:
                logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, target[..., None]).squeeze(-1)
            del logits
        loss = dapo_loss(logps, adv_tok)
        del logps
    loss.backward()


def bisect_one_mode(args) -> dict:
    """Run in a child process: fixed lengths, then the search, for one mode; TRIAL lines on stdout."""
    import torch

    mode = args.one_bisect
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if cuda and getattr(args, "gpu_budget_gb", None) is not None:  # a smaller GPU, emulated
        emulate_gpu_budget(args.gpu_budget_gb)
    start = time.perf_counter()
    model = build_bisect_model(mode, args.model, device, args)
    trials: list[dict] = []

    def trial(L: int, record: bool = True, repeats: int = 1) -> dict:
        """One policy step of completion ``L`` (``repeats`` > 1: that many steps, the last one timed,
        the first one's time kept as ``first_s``: steady state, with allocator and pinned pages warm)."""
        tokens = args.bisect_rows * (args.prompt_tokens + L)
        row: dict = {"mode": mode, "completion": L, "tokens": tokens}
        if record:  # a trial that kills the process (host memory) is then known to the parent
            print("START " + json.dumps({"completion": L}), flush=True)
        if cuda:
            reset_cuda_memory(synchronize=True, reset_peak=True)
        t0 = time.perf_counter()
        failure = None
        try:
            if args.simulate_kill_above and tokens > args.simulate_kill_above:
                os._exit(137)  # as the kernel's OOM killer would end the process
            if args.simulate_error_above and tokens > args.simulate_error_above:
                raise RuntimeError(f"simulated: an error that says nothing about fitting, at {tokens} tokens")
            if args.simulate_capacity and tokens > args.simulate_capacity:
                raise MemoryError(f"simulated: {tokens} tokens > --simulate-capacity {args.simulate_capacity}")
            for _ in range(repeats - 1):
                policy_step(model, mode, L, args, device)
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                row.setdefault("first_s", time.perf_counter() - t0)
                t0 = time.perf_counter()
            profiled = cuda and record and L == args.profile_completion
            mem_profiled = cuda and record and L == args.memory_profile_completion
            with contextlib.ExitStack() as stack:
                if profiled:
                    stack.enter_context(device_time_profile(row, gaps=True))  # and where the device idles
                if mem_profiled:  # (recording slows the step down: its time is not a timing figure)
                    stack.enter_context(peak_profile(row))
                policy_step(model, mode, L, args, device)
                if cuda:
                    torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - OOM (GPU or host budget) = does not fit; anything else: stop
            host = _is_host_oom(e)  # swiftune's offload budget, or the host's allocator
            if not (_is_oom(e) or host):
                if record:  # the process ends (a CUDA error leaves no usable context): say where, then stop
                    print("TRIAL " + json.dumps(crashed_trial(row, e, model, time.perf_counter() - t0)), flush=True)
                raise
            failure = ("oom_host" if host else "oom", str(e).splitlines()[0][:600], failure_frames(e))
        row["s"] = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        if failure is None:
            row["status"] = "ok"
            row["tokens_per_s"] = tokens / row["s"]
        else:
            row["status"], row["error"], row["where"] = failure
        if cuda:
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            row["reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
        row["host_rss_gb"] = host_rss() / 1e9
        if cuda:
            reset_cuda_memory()
        if record:
            trials.append(row)
            print("TRIAL " + json.dumps(row), flush=True)
        return row

    def estimate(L: int) -> float:
        ok = [t for t in trials if t["status"] == "ok"]
        done = [t for t in ok if t["completion"] <= L] or ok
        if not done:
            return 0.0
        ref = max(done, key=lambda t: t["completion"])
        return ref["s"] * max(1.0, L / ref["completion"]) ** 2  # attention grows quadratically per row

    def fits(L: int) -> bool:
        if time.perf_counter() - start + estimate(L) > args.time_budget:
            raise OutOfTime
        return trial(L)["status"] == "ok"

    warm = trial(min(args.bisect_start, 64 if args.model.startswith("tiny") else 1024), record=False)  # compile kernels
    for L in args.completion_lengths or []:
        failed = shorter_failure(trials, L, args.bisect_hi)
        if failed is not None:  # memory grows with the row: a longer one cannot fit either (minutes saved)
            trials.append({"mode": mode, "completion": L, "status": "skipped", "reason": f"{failed:,} did not fit"})
            continue
        if time.perf_counter() - start + estimate(L) * args.trial_repeats > args.time_budget:
            trials.append({"mode": mode, "completion": L, "status": "skipped"})
            continue
        trial(L, repeats=args.trial_repeats)
    if args.fixed_only:
        lo, hi = bracket_from_trials(trials, args.bisect_lo, args.bisect_hi)
        status = "fixed_only"
    else:
        lo, hi, status = search_max_fit(fits, args.bisect_start, args.bisect_max, args.bisect_tol,
                                        args.bisect_granularity, args.bisect_lo, args.bisect_hi)
    return dict(mode=mode, label=mode_label(mode), max_fit=lo, first_fail=hi, status=status, trials=trials,
                warmup_s=warm["s"], wall_s=time.perf_counter() - start)


def mode_label(mode: str) -> str:
    label = MODE_LABELS[mode]
    if mode.startswith("trl") and trl_available():
        import trl

        label += f" (trl {trl.__version__})"
    return label


def failed_lengths(trials: list[dict], hi: int | None = None) -> list[int]:
    """Completion lengths known not to fit: trials out of memory, and ``hi``, a known failing bound."""
    return [t["completion"] for t in trials if str(t.get("status", "")).startswith("oom")] + ([hi] if hi else [])


def shorter_failure(trials: list[dict], completion: int, hi: int | None = None) -> int | None:
    """The shortest length at or below ``completion`` already known not to fit (a trial out of memory,
    or ``hi``, the bracket a resumed process inherits), or None."""
    bad = [n for n in failed_lengths(trials, hi) if n <= completion]
    return min(bad) if bad else None


def bracket_from_trials(trials: list[dict], lo: int | None = None,
                        hi: int | None = None) -> tuple[int | None, int | None]:
    """(largest length that fitted, smallest larger one that did not), with a known bracket ``lo``/``hi``."""
    ok = [t["completion"] for t in trials if t.get("status") == "ok"] + ([lo] if lo else [])
    lo = max(ok) if ok else None
    bad = [n for n in failed_lengths(trials, hi) if lo is None or n > lo]
    return lo, (min(bad) if bad else None)


def launch_mode(mode: str, args, budget: float, lo: int | None, hi: int | None, fixed: list[int]):
    """One child process for ``mode``; returns (trials, result or None, killed length or None, a summary of what
    else it printed (:func:`~benchmarks.child_output.failure_summary`), exit code). That whole output is appended
    to ``<out>.<mode>.log`` when the run writes ``--out``."""
    cmd = [*module_command("grpo", "--one-bisect", mode), "--time-budget", f"{budget:.0f}",
           "--model", args.model, "--prompt-tokens", str(args.prompt_tokens), "--bisect-rows", str(args.bisect_rows),
           "--bisect-start", str(args.bisect_start), "--bisect-max", str(args.bisect_max),
           "--bisect-tol", str(args.bisect_tol), "--bisect-granularity", str(args.bisect_granularity),
           "--swiftune-checkpointing", args.swiftune_checkpointing, "--trial-repeats", str(args.trial_repeats)]
    for flag, value in (("--bisect-lo", lo), ("--bisect-hi", hi), ("--simulate-capacity", args.simulate_capacity),
                        ("--host-budget-gb", args.host_budget_gb), ("--host-margin-gb", args.host_margin_gb),
                        ("--simulate-kill-above", args.simulate_kill_above),
                        ("--simulate-error-above", args.simulate_error_above),
                        ("--gpu-budget-gb", getattr(args, "gpu_budget_gb", None))):
        if value:
            cmd += [flag, str(value)]
    if fixed:
        cmd += ["--completion-lengths", *map(str, fixed)]
    if args.share_prompt:
        cmd.append("--share-prompt")
    if getattr(args, "load_in_4bit", False):
        cmd.append("--load-in-4bit")
    if getattr(args, "load_in_fp8", False):
        cmd.append("--load-in-fp8")
    if getattr(args, "attention_output_layers", 0):
        cmd += ["--attention-output-layers", str(args.attention_output_layers)]
    if getattr(args, "attention_outputs_on_host", False):
        cmd.append("--attention-outputs-on-host")
    if args.fixed_only:
        cmd.append("--fixed-only")
    if args.profile_completion:
        cmd += ["--profile-completion", str(args.profile_completion)]
    if args.memory_profile_completion:
        cmd += ["--memory-profile-completion", str(args.memory_profile_completion)]
    if not args.offload_logits:
        cmd.append("--no-offload-logits")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    trials, result, output, started = [], None, [], None
    for line in proc.stdout:
        if line.startswith("START "):
            started = json.loads(line[6:])["completion"]
        elif line.startswith("TRIAL "):
            t = json.loads(line[6:])
            trials.append(t)
            started = None
            print_trial(t)
        elif line.startswith("RESULT "):
            result = json.loads(line[7:])
        else:
            output.append(line)
    proc.wait()
    text = "".join(output)
    save_child_output(args.out, mode, text)
    summary = failure_summary(text, 900)
    killed = None
    if result is None and started is not None:
        t = {"mode": mode, "completion": started, "tokens": args.bisect_rows * (args.prompt_tokens + started)}
        if proc.returncode in KILLED_EXIT_CODES:  # killed inside a trial (the kernel's OOM killer): it does not fit
            t.update(status="oom_killed", error=f"process killed (exit {proc.returncode}) during this trial")
            killed = started
        else:  # an error the trial does not count as out of memory: it says nothing about fitting
            t.update(status="crashed", error=f"process ended (exit {proc.returncode}) during this trial: {summary}")
        trials.append(t)
        print_trial(t)
    return trials, result, killed, summary, proc.returncode


def run_bisect(args) -> dict:
    """One child process per mode (baselines first); collect their trials and results.

    A child killed during a trial (e.g. host memory exhausted by offloaded checkpoints) counts that
    length as not fitting, and a new child resumes the search from the bracket found so far.
    """
    modes = args.bisect_modes or default_bisect_modes()
    modes = sorted(modes, key=lambda m: ALL_BISECT_MODES.index(m))
    start = time.perf_counter()
    results: dict[str, dict] = {}
    print(f"# bisection: {args.model}, prompt {args.prompt_tokens}, {args.bisect_rows} rows, modes {modes}", flush=True)
    print_trial(None, header=True)
    for i, mode in enumerate(modes):
        earlier: list[dict] = []  # trials of children killed before they reported
        lo, hi, fixed = args.bisect_lo, args.bisect_hi, list(args.completion_lengths or [])
        for _attempt in range(6):
            budget = (args.time_budget - (time.perf_counter() - start)) / (len(modes) - i)
            new, result, killed, summary, code = launch_mode(mode, args, budget, lo, hi, fixed)
            if result is not None:
                break
            earlier += new
            if killed is None or (budget < 60 and not args.model.startswith("tiny")):
                break
            fixed = [L for L in fixed if L not in {t["completion"] for t in earlier}]
            lo, hi = bracket_from_trials(earlier, args.bisect_lo, args.bisect_hi)
            print(f"# {mode}: process killed at {killed}; resuming with lo={lo} hi={hi}", flush=True)
        if result is None:
            err = summary
            result = dict(mode=mode, label=mode_label(mode), status="crashed", error=err, returncode=code, trials=[])
            print(f"# {mode}: process ended without a result (exit {code}): {err[-300:]}", flush=True)
        result["trials"] = earlier + result["trials"]
        # the bracket of everything measured (fixed lengths and killed trials included)
        result["max_fit"], result["first_fail"] = bracket_from_trials(result["trials"], args.bisect_lo, args.bisect_hi)
        results[mode] = result
    return dict(benchmark="grpo_bisect", model=args.model, prompt_tokens=args.prompt_tokens, rows=args.bisect_rows,
                tolerance=args.bisect_tol, share_prompt=args.share_prompt, offload_logits=args.offload_logits,
                swiftune_checkpointing=args.swiftune_checkpointing, trial_repeats=args.trial_repeats,
                attention_output_layers=args.attention_output_layers,
                attention_outputs_on_host=args.attention_outputs_on_host, host_budget_gb=args.host_budget_gb,
                host_margin_gb=args.host_margin_gb,
                simulate_capacity=args.simulate_capacity,
                simulate_kill_above=args.simulate_kill_above, modes=results, wall_s=time.perf_counter() - start,
                cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), **versions())


def weight_quantization_of(args) -> str | None:
    """The planner's name of the base weights' format the flags ask for (``None``: bf16)."""
    if getattr(args, "load_in_4bit", False):
        return "nf4_double_quant"
    return "fp8" if getattr(args, "load_in_fp8", False) else None


def planner_max_completion(args, gpu_bytes: int | None = None, host_bytes: int | None = None) -> dict:
    """The planner's largest completion per row for the swiftune mode, to print beside its search:
    offloaded checkpoints, tiled MLP and projections, bf16 autocast, and the memory of the attention
    kernel the rows run: per-document sdpa for long rows (``auto``; ``longest``: the tokens its
    float32 dq covers), else flex for shared-prompt rows and torch's varlen for unshared ones.
    Defaults: this GPU (an H200's 149.3 GB off CUDA) and the host memory offloaded checkpoints may
    pin here."""
    import torch

    from swiftune.attention.backends import SDPA_MIN_MEAN_DOC_TOKENS, planner_attention_terms
    from swiftune.memory import max_tokens
    from swiftune.training.checkpointing import host_available_bytes
    from benchmarks.workload import shape_of

    budget_gb = getattr(args, "gpu_budget_gb", None)
    if gpu_bytes is None and budget_gb is not None:  # the emulated GPU
        gpu_bytes = int(budget_gb * 1e9)
    if gpu_bytes is None:
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else int(149.3e9)
    if host_bytes is None:
        host_bytes = host_budget_bytes(args)
    host_bytes = host_available_bytes() if host_bytes is None else host_bytes
    share = args.share_prompt
    P, R = args.prompt_tokens, args.bisect_rows
    # the swiftune step: bf16 autocast, LoRA input casts off (policy_step), projections tiled
    kw = dict(gradient_checkpointing="offload", tiled_projections=True, host_bytes=host_bytes, autocast=True,
              lora_input_casts=False,
              weight_quantization=weight_quantization_of(args),
              attention_output_layers=getattr(args, "attention_output_layers", 0),
              attention_outputs_on_host=getattr(args, "attention_outputs_on_host", False))
    shape = shape_of(args.model)

    def completion_of(tokens: int) -> int:
        return (tokens - P) // R if share else tokens // R - P  # shared: P + R L tokens; else R (P + L)

    from swiftune.memory.shapes import model_shape

    # attention sinks (gpt-oss): sdpa and varlen have no hook for the sink logit, every row runs flex
    kinds = ("flex",) if model_shape(shape).attention_sinks else ("sdpa", "flex" if share else "varlen")
    for kind in kinds:
        # the rows tell the runtime their kernel (RowLayout.attention_kernel) and, for sdpa, the
        # longest sequence one call covers, prompt + completion: its float32 dq covers that many
        # tokens, which grows with the answer (sdpa_rows_max_tokens)
        longest = None
        if kind == "sdpa":
            tokens = sdpa_rows_max_tokens(shape, gpu_bytes, kw, lambda t: P + completion_of(t))
            longest = P + completion_of(tokens)
        else:
            terms = planner_attention_terms(None if kind == "varlen" else kind)
            tokens = max_tokens(shape, gpu_bytes, 16, **kw, **terms)
        completion = completion_of(tokens)
        if P + completion >= SDPA_MIN_MEAN_DOC_TOKENS:  # long rows: auto runs sdpa, as planned
            break
    return {"tokens": tokens, "completion": max(0, completion), "gpu_bytes": gpu_bytes, "host_bytes": host_bytes,
            "attention": kind, "longest": longest}


def sdpa_rows_max_tokens(shape: dict, gpu_bytes: int, kw: dict, longest_of) -> int:
    """The largest token count whose plan fits with per-sequence sdpa whose longest sequence,
    ``longest_of(tokens)``, grows with the row: a bisection between the answers for a float32 dq
    over the whole row (fewer tokens) and over one token (more); the plan is monotone in between."""
    from swiftune.attention.backends import planner_attention_terms
    from swiftune.memory import max_tokens, plan_memory

    def fits(t: int) -> bool:
        terms = planner_attention_terms("sdpa", max(1, longest_of(t)))
        return bool(plan_memory(shape, t, 16, gpu_bytes=gpu_bytes, **kw, **terms).fits)

    # a dq over the whole row covers any of its sequences: lo fits; a dq of one token is less than any: hi does not
    lo = max_tokens(shape, gpu_bytes, 16, **kw, **planner_attention_terms("sdpa", None))
    hi = max_tokens(shape, gpu_bytes, 16, **kw, **planner_attention_terms("sdpa", 1)) + 1
    if lo == 0:
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def planner_bracket(completion: int, granularity: int) -> list[int]:
    """The two lengths around the planner's answer that bracket it within 5% when it is right:
    2% above, then 2.5% below, multiples of ``granularity`` (at least one)."""
    def down(x: float) -> int:
        return max(granularity, int(x) // granularity * granularity)

    return [down(completion * 1.02), down(completion * 0.975)]


def print_trial(t: dict | None, header: bool = False) -> None:
    if header:
        print(f"{'mode':<15} {'completion':>10} {'tokens':>9} {'status':>10} {'s':>8} {'peak GB':>8} {'host GB':>8}")
    if t is None:
        return
    peak = f"{t['peak_gb']:.1f}" if t.get("peak_gb") is not None else "-"
    s = f"{t['s']:.2f}" if t.get("s") is not None else "-"
    host = f"{t['host_rss_gb']:.1f}" if t.get("host_rss_gb") is not None else "-"
    print(f"{t['mode']:<15} {t['completion']:>10} {t.get('tokens', 0):>9} {t['status']:>10} {s:>8} {peak:>8} "
          f"{host:>8}", flush=True)
    if t.get("status") == "crashed" and t.get("where"):
        print(f"#   {t['error']}\n#   at {' <- '.join(reversed(t['where'][-4:]))}\n#   offload counters: {t.get('offload')}",
              flush=True)
    if t.get("profile"):
        print(format_profile(t["profile"], f"{t['mode']} at {t['completion']}"), flush=True)
    if t.get("peak_profile"):
        print(f"# memory at the peak of {t['mode']} at {t['completion']}\n{format_breakdown(t['peak_profile'])}",
              flush=True)


def print_bisect_table(r: dict) -> None:
    print(f"\n# GRPO policy loss + backward, {r['model']} shape, LoRA r=16, prompt {r['prompt_tokens']}, "
          f"{r['rows']} rows; largest completion per row that fits ({r['device']})")
    header = True
    for res in r["modes"].values():
        for t in res["trials"]:
            if t.get("status") != "skipped":
                print_trial(t, header=header)
                header = False
    base = {m: v for m, v in r["modes"].items() if m != "swiftune" and v.get("max_fit")}
    ref_mode = "trl_grpo" if "trl_grpo" in base else next(iter(base), None)
    print(f"\n{'mode':<15} {'max fit / row':>13} {'first fail':>10} {'tokens/step':>11} {'x ' + (ref_mode or 'baseline'):>18} "
          f"{'status':>14}  label")
    for mode, res in r["modes"].items():
        lo, hi = res.get("max_fit"), res.get("first_fail")
        tokens = r["rows"] * (r["prompt_tokens"] + lo) if lo else None
        ratio = (lo / base[ref_mode]["max_fit"]) if lo and ref_mode else float("nan")
        print(f"{mode:<15} {lo if lo else '-':>13} {hi if hi else '-':>10} {tokens if tokens else '-':>11} "
              f"{ratio:18.2f} {res['status']:>14}  {res['label']}")
    plan = r.get("planner")
    if plan:
        print(f"{'planner':<15} {plan['completion']:>13} {'':>10} {plan['tokens']:>11} {'':>18} {'':>14}  "
              f"swiftune.memory.max_tokens ({plan['attention']} attention, {plan['gpu_bytes'] / 1e9:.1f} GB GPU, "
              f"{plan['host_bytes'] / 1e9:.1f} GB host)")


# ------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", help="a shape of benchmarks/workload.py (tiny: CPU smoke test)")
    p.add_argument("--generations", type=int, default=8, help="G of the step")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-tokens", type=int, default=None,
                   help="max_completion_length of the step (default 4096; tiny: 32)")
    p.add_argument("--beta", type=float, default=0.04, help="KL weight (> 0: the reference pass runs)")
    p.add_argument("--num-iterations", type=int, default=1, help="2: the old log-probs pass runs too")
    p.add_argument("--no-share-prompt", action="store_true", help="step: unshared policy rows")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--steps", type=int, default=1,
                   help="optimizer steps; the last one is reported (2: the engine's graphs and cache are warm)")
    p.add_argument("--no-fused-layers", dest="fused_layers", action="store_false",
                   help="FastRolloutEngine(fused_layers=False): each layer's own forward, not the engine's fused loop")
    p.add_argument("--engine", choices=["fast", "transformers"], default=None,
                   help="rollout engine of the step (default: fast on CUDA, transformers on CPU, as GRPOTrainer)")
    p.add_argument("--bisect-completion", action="store_true", help="run the bisection instead of the step")
    p.add_argument("--bisect-modes", nargs="+", choices=ALL_BISECT_MODES, default=None,
                   help="default: hf_full_logits, trl_grpo (when trl is importable), trl_liger (and "
                        "liger-kernel), swiftune")
    p.add_argument("--bisect-rows", type=int, default=2, help="completions per step (G) of the bisection")
    p.add_argument("--bisect-start", type=int, default=None, help="first completion length (default 16384; tiny 64)")
    p.add_argument("--bisect-max", type=int, default=None, help="largest length tried (default 2**20; tiny 4096)")
    p.add_argument("--bisect-tol", type=float, default=0.05)
    p.add_argument("--bisect-granularity", type=int, default=None, help="lengths are multiples of it (256; tiny 16)")
    p.add_argument("--bisect-lo", type=int, default=None, help="resume: a completion length known to fit")
    p.add_argument("--bisect-hi", type=int, default=None, help="resume: a completion length known not to fit")
    p.add_argument("--completion-lengths", type=int, nargs="*", default=None,
                   help="fixed completion lengths measured for every mode before the search")
    p.add_argument("--completion-from-planner", action="store_true",
                   help="bisection: measure two lengths, 2%% above and 2.5%% below the planner's largest completion for "
                        "swiftune on this GPU and host (largest first: a row the host cannot hold fails at once), and "
                        "nothing else; the figure 3 searches of longctx.py bracketed their answers this way")
    p.add_argument("--fixed-only", action="store_true",
                   help="bisection: measure --completion-lengths only, no search (e.g. one size at a target)")
    p.add_argument("--share-prompt", action="store_true",
                   help="bisection: swiftune encodes the prompt once (sdpa for long completions, else flex); "
                        "default: unshared rows, which cost G-1 extra prompt copies (0.1%% at 256 + 256K)")
    p.add_argument("--no-offload-logits", dest="offload_logits", action="store_false",
                   help="bisection: keep the log-prob loss's saved hidden states on the GPU")
    p.add_argument("--swiftune-checkpointing", choices=["offload", "offload_all", "gpu"], default="offload",
                   help="offload: as many layer inputs on the GPU as fit, the rest in pinned host memory; "
                        "offload_all: every one on the host (least GPU memory); gpu: plain checkpointing")
    p.add_argument("--host-budget-gb", type=float, default=None,
                   help="swiftune's offloaded checkpoints may pin at most this much host memory (GB, 1e9 bytes; "
                        "default: what the machine has available less a margin). Two trials side by side on a "
                        "two-GPU host each take the share of a one-GPU machine this way")
    p.add_argument("--host-margin-gb", type=float, default=None,
                   help="host memory offloaded checkpoints leave free (GB; default max(4 GiB, 10%% of the machine's)). "
                        "With two capped trials side by side the default margin of the larger host would cut the "
                        "second trial's share")
    p.add_argument("--trial-repeats", type=int, default=1,
                   help="bisection: run each fixed-length trial this many times in its process and report the "
                        "last (steady state: allocator, kernels and offload's pinned host pages warm); the "
                        "first one's time is kept as first_s")
    p.add_argument("--profile-completion", type=int, default=None,
                   help="bisection: the trial at this completion length runs under torch.profiler; its device "
                        "time by kind of kernel is printed and kept in the JSON (benchmarks/time_profile.py)")
    p.add_argument("--memory-profile-completion", type=int, default=None,
                   help="bisection: the trial at this completion length records the caching allocator's history; "
                        "what is alive at its peak, by allocation site, is printed and kept in the JSON "
                        "(benchmarks/memory_profile.py)")
    p.add_argument("--time-budget", type=float, default=500.0,
                   help="seconds for the bisection, all modes (a 10-minute device call leaves room for start-up)")
    p.add_argument("--simulate-capacity", type=int, default=None,
                   help="smoke tests: trials above this many tokens count as out of memory")
    p.add_argument("--simulate-kill-above", type=int, default=None,
                   help="smoke tests: the process dies (exit 137) in trials above this many tokens")
    p.add_argument("--simulate-error-above", type=int, default=None,
                   help="smoke tests: trials above this many tokens raise an error that is not out of memory")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: the decoder's linear weights in bitsandbytes NF4 (double quantisation), every mode")
    p.add_argument("--attention-output-layers", type=int, default=0,
                   help="swiftune mode, offloaded checkpointing: the last N decoder layers keep their sdpa attention "
                        "outputs on the GPU through the recompute instead of running the kernel again "
                        "(enable_offloaded_checkpointing(attention_output_layers=N)); the planner counts them")
    p.add_argument("--attention-outputs-on-host", action="store_true",
                   help="with --attention-output-layers N: keep those outputs in pinned host memory instead of on "
                        "the GPU (enable_offloaded_checkpointing(attention_outputs_on_host=True))")
    p.add_argument("--load-in-fp8", action="store_true",
                   help="the decoder's linear weights in FP8 (e4m3, per-row scales), every mode "
                        "(LoRA adapters in bf16)")
    p.add_argument("--gpu-budget-gb", type=float, default=None,
                   help="bisection: emulate a GPU of this many GB (1e9 bytes; set_per_process_memory_fraction)")
    p.add_argument("--one-bisect", choices=ALL_BISECT_MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the --out path with .rows.jsonl)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.load_in_4bit and args.load_in_fp8:
        parser.error("--load-in-4bit and --load-in-fp8 are two formats of the same base weights: pick one")
    if args.attention_outputs_on_host and not args.attention_output_layers:
        parser.error("--attention-outputs-on-host says where kept attention outputs go: "
                     "add --attention-output-layers N")
    tiny = args.model.startswith("tiny")  # the CPU shapes of workload.py (tiny, tiny-moe, tiny-gpt-oss)
    if args.completion_tokens is None:
        args.completion_tokens = 32 if tiny else 4096
    if args.bisect_start is None:
        args.bisect_start = 64 if tiny else 16384
    if args.bisect_max is None:
        args.bisect_max = 4096 if tiny else 2**20
    if args.bisect_granularity is None:
        args.bisect_granularity = 16 if tiny else 256

    import torch

    if not tiny and not torch.cuda.is_available():
        print("benchmarks/grpo.py: real shapes need a CUDA device (use a tiny shape on CPU: tiny, tiny-moe, "
              "tiny-gpt-oss)", file=sys.stderr)
        return 2
    if args.one_bisect:
        result = bisect_one_mode(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.bisect_completion:
        plan = None
        if args.completion_from_planner:  # planned before any trial pins host memory
            plan = planner_max_completion(args)
            args.completion_lengths = planner_bracket(plan["completion"], args.bisect_granularity)
            args.fixed_only = True
            print(f"# planner: {plan['completion']:,} completion tokens per row fit ({plan['gpu_bytes'] / 1e9:.1f} GB "
                  f"GPU, {plan['host_bytes'] / 1e9:.1f} GB host); trying {args.completion_lengths}", flush=True)
        result = run_bisect(args)
        if "swiftune" in result["modes"]:
            result["planner"] = plan or planner_max_completion(args)
        print_bisect_table(result)
    else:
        try:
            result = run_step(args)
        except Exception as e:  # noqa: BLE001 - a failed step is a row of the report, not a lost run
            import traceback

            traceback.print_exc()
            result = dict(benchmark="grpo_step", model=args.model, error=f"{type(e).__name__}: {e}"[:500], **versions())
            print(f"\nGRPO step FAILED: {result['error']}")
        else:
            print_step_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if "error" not in result:
        results.save("grpo", argv, json.loads(json.dumps(result, default=str)), args.out, args.rows)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
