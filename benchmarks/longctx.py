"""Long-context training step: peak memory, host memory and time vs tokens, beside the planner.

One training step = forward + loss + backward + AdamW step, on one row of ``T`` tokens of a
random-init model (bf16 weights, LoRA r=16 on all linear layers), for growing ``T``.  Modes
(each measured in this process, on the same GPU):

  baseline     plain transformers (sdpa) + PEFT + transformers' gradient checkpointing
               (non-reentrant) + ``F.cross_entropy(logits.float())`` on the full logits;
               stops at its first OOM
  trl          TRL 1.16's SFT step: the same PEFT model and checkpointing, TRL's fused LM head
               (``add_fused_lm_head``, as ``SFTTrainer`` adds it) under bf16 autocast, loss =
               mean of ``-log_probs``; one causal sequence per row (below)
  trl_liger    the same with Liger-Kernel's layer kernels, as ``use_liger_kernel=True`` applies
               them in TRL 1.16 (its fused linear cross entropy off: TRL's head computes the loss)
  ckpt         swiftune: patched model (fused kernels, packed varlen attention), tiled MLP, fused
               chunked cross entropy (``swiftune.sft.sft_loss``), checkpoints kept on the GPU
               (transformers' checkpointing): the reference for the offload overhead
  offload      the same with ``enable_offloaded_checkpointing`` (automatic GPU budget: only the
               layer inputs that do not fit go to pinned host memory)
  offload_all  the same with every layer input offloaded (``gpu_budget_bytes=0``): worst-case
               transfer overhead

On CUDA the swiftune modes run their step as ``swiftune.SFTTrainer(bf16=True)`` does: bf16
autocast, PEFT's float32 copies of LoRA inputs switched off (``--no-autocast``: neither, as the
results recorded before 2026-11-30 ran).

Rows report the step time (median of ``--repeats`` after one warm-up step at the first size),
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, pinned host bytes and process RSS,
the planner's prediction for the same setup (``swiftune.memory.plan_memory``) and the ratios
measured / predicted.  A row that runs out of GPU memory (or whose checkpoints fit neither budget)
is reported as OOM and the mode's larger sizes are skipped.  ``--bisect`` then searches the
largest token count that fits between the last OK and the first OOM row (granularity
``--bisect-granularity``).  Rows are documents of ``--doc-tokens`` tokens (``position_ids``
restart; 0: one sequence), which keeps attention cost linear in ``T``: swiftune's packed
attention respects the boundaries, the sdpa baseline attends across them (more work, the same
memory).  The TRL modes ignore the document boundaries and train one causal sequence per row:
with position_ids restarting, transformers builds a ``T x T`` packed-sequence mask for sdpa
(flash-attn, which TRL's padding-free mode relies on, is not installed on the device machine);
one sequence has the memory of flash-attn's varlen path and the time of full attention.  The
table is printed last; ``--out`` writes JSON.

    python -m benchmarks.longctx --out longctx.json                       # default: ~5-7 min on an H200
    python -m benchmarks.longctx --tokens 409600 --modes offload --doc-tokens 0   # one 400K sequence (attention
                                                                  # dominates: ~8-10 min, over a 10-min call limit?)
    python -m benchmarks.longctx --model tiny                             # CPU smoke test (~1 min)
    python -m benchmarks.longctx --modes trl_liger --tokens 32768 65536 --bracket-from-fit --bisect trl_liger \
        --bisect-tol 0.05 --doc-tokens 0   # TRL + Liger: trials where a line through two rows fills the GPU
    python -m benchmarks.longctx --modes offload --tokens-from-planner --bisect offload --bisect-tol 0.05 \
        --doc-tokens 8192          # the largest row that fits, within 5%, starting at the planner's answer
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import contextlib
import functools
import json
import statistics
import sys
import time


import torch
import torch.nn.functional as F
from benchmarks import results
from benchmarks.workload import apply_liger_like_trl, host_rss, reset_cuda_memory

DEFAULT_MODES = ["baseline", "ckpt", "offload", "offload_all"]
ALL_MODES = ["baseline", "trl", "trl_liger", "ckpt", "offload", "offload_all"]
TRL_MODES = ("trl", "trl_liger")
DEFAULT_TOKENS = [8192, 32768, 65536, 131072, 262144, 409600]
TINY_TOKENS = [256, 1024, 2048]


# ------------------------------------------------------------------------------------ models


def build_model(name: str, mode: str, device: torch.device, mlp_tile: int | None, projections: bool):
    """A random-init model of shape ``name`` set up for ``mode`` (LoRA r=16 all-linear)."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.workload import random_model

    model = random_model(name, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.config.use_cache = False
    if mode == "baseline" or mode in TRL_MODES:
        if mode == "trl_liger":
            apply_liger_like_trl(model)
        if mode in TRL_MODES:  # as SFTTrainer.__init__ adds it (log-probs, entropy and accuracy outputs)
            from trl.trainer.utils import add_fused_lm_head

            add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
        hf = model.get_base_model()
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mode in TRL_MODES:
            model.enable_input_require_grads()
        return model.train()
    import swiftune
    from swiftune.models.tiled_mlp import enable_tiled_mlp

    swiftune.patch_model(model)
    model = swiftune.FastModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=False)
    enable_tiled_mlp(model, tile_tokens=mlp_tile, projections=projections)
    return model.train()


def set_checkpointing(model, mode: str) -> None:
    """Switch a swiftune model between GPU checkpointing and the two offload settings."""
    from swiftune.training.checkpointing import disable_offloaded_checkpointing, enable_offloaded_checkpointing

    hf = model.get_base_model()
    disable_offloaded_checkpointing(model)
    if mode == "ckpt":
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        if getattr(hf, "is_gradient_checkpointing", False):
            hf.gradient_checkpointing_disable()
        enable_offloaded_checkpointing(model, gpu_budget_bytes=0 if mode == "offload_all" else None)


# -------------------------------------------------------------------------------------- step


def make_batch(tokens: int, vocab: int, doc_tokens: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    doc = doc_tokens if doc_tokens > 0 else tokens
    pos = (torch.arange(tokens) % doc)[None]
    return {"input_ids": ids.to(device), "position_ids": pos.to(device)}


def step(model, mode: str, batch: dict, optimizer, autocast: bool = False) -> float:
    """One training step. ``autocast``: swiftune's step as ``swiftune.SFTTrainer`` runs it with
    ``bf16=True`` (bf16 autocast, LoRA inputs left in bf16 through forward and backward)."""
    from swiftune.training.lora_casting import lora_input_casting

    ids = batch["input_ids"]
    swiftune_bf16 = autocast and mode not in TRL_MODES and mode != "baseline"
    with lora_input_casting(model, enabled=False) if swiftune_bf16 else contextlib.nullcontext():
        if mode == "baseline":
            logits = model(**batch, use_cache=False).logits
            loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
            del logits
        elif mode in TRL_MODES:  # SFTTrainer.compute_loss of TRL 1.16 (loss_type "nll"), Trainer's bf16 autocast
            with torch.autocast("cuda", dtype=torch.bfloat16) if ids.is_cuda else contextlib.nullcontext():
                out = model(input_ids=ids, labels=ids, fused_lm_head=True, use_cache=False)
            loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)
            del out
        else:
            from swiftune.sft import sft_loss

            with torch.autocast(ids.device.type, dtype=torch.bfloat16) if swiftune_bf16 else contextlib.nullcontext():
                loss, hidden = sft_loss(model, dict(batch), ids)
            del hidden
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _plan_kwargs(mode: str, args) -> dict:
    """The planner's options for a benchmark mode; offload mode with the host memory the run
    started with (``args.host_bytes``, when known), so inputs the host cannot hold are derived."""
    kw: dict = dict(kv_expanded=args.kv_expanded, tiled_projections=args.tile_projections, mlp_tile_tokens=args.mlp_tile)
    kernel = getattr(args, "attention_kernel", None)  # what swiftune's runtime is told (see main)
    if kernel is not None and mode not in TRL_MODES and mode != "baseline":
        from swiftune.attention.backends import planner_attention_terms

        kw.update(planner_attention_terms(kernel, args.doc_tokens or None))  # (0: one sequence, the whole row)
    if mode == "baseline":
        kw.update(chunked_loss=False, tiled_mlp=False, tiled_projections=False, gradient_checkpointing=True)
    elif mode in TRL_MODES:  # (approximate: the planner knows swiftune's kernels, not Liger's or sdpa's)
        kw.update(tiled_mlp=False, tiled_projections=False, gradient_checkpointing=True, autocast=True)
    elif mode == "ckpt":
        kw.update(gradient_checkpointing=True)
    else:
        kw.update(gradient_checkpointing="offload")
    if mode not in TRL_MODES and mode != "baseline" and args.autocast:  # swiftune's step (see step())
        kw.update(autocast=True, lora_input_casts=False)
    if mode == "offload" and getattr(args, "host_bytes", None) is not None:
        kw["host_bytes"] = args.host_bytes
    return kw


def predict(name: str, tokens: int, mode: str, gpu_bytes: int | None, args) -> dict:
    """The planner's figures for one row (:func:`_plan_kwargs`)."""
    from swiftune.memory import plan_memory

    from benchmarks.workload import shape_of

    gpu = None if mode == "offload_all" else gpu_bytes
    plan = plan_memory(shape_of(name), tokens, 16, gpu_bytes=gpu, **_plan_kwargs(mode, args))
    return {"pred_allocated": plan.allocated, "pred_total": plan.total, "pred_kept": plan.kept_layers,
            "pred_host": plan.host_bytes, "pred_derived": plan.derived_layers}


def measure(model, mode: str, tokens: int, args, device: torch.device, optimizer, profile: bool = True) -> dict:
    """One row: ``args.repeats`` steps of ``tokens`` tokens (median time, peak memory, offload
    stats, the planner's figures). With ``--memory-profile`` (CUDA, ``profile``) the last step also
    records what is alive at its peak (``row["peak_profile"]``; that step runs slower)."""
    from swiftune.training.checkpointing import CheckpointBudgetError, offload_stats

    pin0 = offload_stats(model).get("host_alloc_seconds", 0.0)
    vocab = model.config.vocab_size
    batch = make_batch(tokens, vocab, args.doc_tokens, device)
    row: dict = {"mode": mode, "tokens": tokens}
    cuda = device.type == "cuda"
    times, times_excl_pin = [], []
    record_peak = profile and cuda and getattr(args, "memory_profile", False)
    try:
        for i in range(args.repeats):
            reset_cuda_memory(cuda, empty_cache=False, synchronize=True, reset_peak=True)
            pinned_before = offload_stats(model).get("host_alloc_seconds", 0.0)
            t0 = time.perf_counter()
            profiling = record_peak and i == args.repeats - 1
            if profiling:
                from benchmarks.memory_profile import peak_profile
            with peak_profile(row) if profiling else contextlib.nullcontext():
                row["loss"] = step(model, mode, batch, optimizer, autocast=args.autocast)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            # first-time pinning of host pages (the pool keeps them for later steps), per step
            times_excl_pin.append(times[-1] - (offload_stats(model).get("host_alloc_seconds", 0.0) - pinned_before))
        row["status"] = "ok"
        row["step_s"] = statistics.median(times)
        row["step_s_excl_pin"] = statistics.median(times_excl_pin)
        row["tokens_per_s"] = tokens / row["step_s"]
        if cuda:
            row["peak_allocated"] = torch.cuda.max_memory_allocated()
            row["peak_reserved"] = torch.cuda.max_memory_reserved()
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0][:200])
    except CheckpointBudgetError as e:
        row.update(status="oom_host", error=str(e)[:300])
    finally:
        optimizer.zero_grad(set_to_none=True)
        del batch
        reset_cuda_memory(cuda)
    stats = offload_stats(model)
    if stats:
        row.update(kept=len(stats["keep"]), offloaded=len(stats["offload"]), host_pinned=stats["host_pinned_bytes"])
        # pinning new host pages happens once (the pool is reused); report it apart from the step
        row["pin_s"] = stats["host_alloc_seconds"] - pin0
    row["host_rss"] = host_rss()
    gpu_total = torch.cuda.get_device_properties(device).total_memory if cuda else None
    row.update(predict(args.model, tokens, mode, gpu_total, args))
    if row.get("peak_allocated"):
        row["alloc_over_pred"] = row["peak_allocated"] / row["pred_allocated"]
        row["reserved_over_pred"] = row["peak_reserved"] / row["pred_total"]
    return row


def replan(path: str, args) -> None:
    """Rewrite the planner's columns of a saved result with the current planner (no GPU needed)."""
    with open(path) as f:
        data = json.load(f)
    saved = data.get("args", {})
    for key in ("model", "tile_projections", "mlp_tile", "doc_tokens"):
        setattr(args, key, saved.get(key, getattr(args, key)))
    args.autocast = saved.get("autocast", False)  # results from before swiftune's step ran under autocast
    # results saved before the field existed came from torch 2.11, whose varlen attention expands K/V
    args.kv_expanded = saved.get("kv_expanded", True)
    # results from before the runtime was told the kernel planned every row as varlen
    args.attention_kernel = saved.get("attention_kernel")
    args.host_bytes = saved.get("host_bytes")  # results from before it was recorded: unlimited host
    gpu = int(data.get("gpu_bytes") or args.gpu_bytes)
    data["gpu_bytes"] = gpu
    for row in data["rows"]:
        if row.get("status") not in ("ok", "oom", "oom_host"):
            continue
        row.update(predict(args.model, row["tokens"], row["mode"], gpu, args))
        if row.get("peak_allocated"):
            row["alloc_over_pred"] = row["peak_allocated"] / row["pred_allocated"]
            row["reserved_over_pred"] = row["peak_reserved"] / row["pred_total"]
        print_row(row)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def print_profile(row: dict) -> None:
    if "peak_profile" in row:
        from benchmarks.memory_profile import format_breakdown

        print(f"# memory at the peak: {row['mode']} {row['tokens']:,} tokens\n{format_breakdown(row['peak_profile'])}",
              flush=True)


def print_row(row: dict, header: bool = False) -> None:
    cols = (f"{'mode':>11} {'tokens':>8} {'status':>8} {'s/step':>8} {'tok/s':>8} {'alloc GB':>9} {'resv GB':>8} "
            f"{'pred GB':>8} {'alloc/pred':>10} {'kept':>5} {'host GB':>8} {'pin s':>6} {'rss GB':>7} {'x ckpt':>7}")
    if header:
        print(cols, flush=True)
    g = lambda k, s=1e9, f="%.2f": (f % (row[k] / s)) if row.get(k) is not None else "-"  # noqa: E731
    print(f"{row['mode']:>11} {row['tokens']:>8} {row['status']:>8} {g('step_s', 1, '%.2f'):>8} "
          f"{g('tokens_per_s', 1, '%.0f'):>8} {g('peak_allocated'):>9} {g('peak_reserved'):>8} {g('pred_allocated'):>8} "
          f"{g('alloc_over_pred', 1, '%.3f'):>10} {str(row.get('kept', '-')):>5} {g('host_pinned'):>8} "
          f"{g('pin_s', 1, '%.1f'):>6} "
          f"{g('host_rss'):>7} {g('time_vs_ckpt', 1, '%.3f'):>7}", flush=True)


def bisect_done(lo: int, hi: int, args) -> bool:
    """The bracket is narrow enough: ``hi - lo`` within the granularity, or within ``--bisect-tol``
    of ``lo`` ("within 5%")."""
    return hi - lo <= max(args.bisect_granularity, (args.bisect_tol or 0.0) * lo)


def sizes_around(best: int) -> list[int]:
    """Two trial sizes around an expected largest fit: 2.5% under and 2% over, multiples of 1,024
    (when the expectation is within that, two trials bracket the answer within 5%)."""
    return [int(best * f) // 1024 * 1024 for f in (0.975, 1.02)]


def planner_bracket(name: str, mode: str, gpu_bytes: int, args) -> tuple[list[int], int]:
    """The planner's largest fitting row for ``mode`` (:func:`_plan_kwargs`) and :func:`sizes_around` it."""
    from swiftune.memory import max_tokens

    from benchmarks.workload import shape_of

    best = max_tokens(shape_of(name), gpu_bytes, 16, **_plan_kwargs(mode, args))
    return sizes_around(best), best


def fit_bracket(rows: list[dict], mode: str, gpu_bytes: int, margin_bytes: int = 2**30) -> tuple[list[int], int] | None:
    """Where a line through ``mode``'s two largest fitting rows (reserved memory against tokens)
    reaches ``gpu_bytes - margin_bytes``, and :func:`sizes_around` it (at least 1,024), as
    :func:`planner_bracket` gives for swiftune: for a mode the planner does not
    model (TRL + Liger), whose memory is linear in the tokens (flash-style attention, chunked
    loss). ``None`` without two fitting sizes or with a flat line."""
    pts = sorted({r["tokens"]: r["peak_reserved"] for r in rows
                  if r["mode"] == mode and r["status"] == "ok" and r.get("peak_reserved")}.items())[-2:]
    if len(pts) < 2:
        return None
    (t0, p0), (t1, p1) = pts
    slope = (p1 - p0) / (t1 - t0)
    if slope <= 0:
        return None
    best = int(t1 + (gpu_bytes - margin_bytes - p1) / slope)
    return [max(1024, n) for n in sizes_around(best)], best


def within_budget(start: float, budget_s: float) -> bool:
    return time.perf_counter() - start < budget_s


def measure_row(rows: list[dict], model, mode: str, args, device, optimizer, tokens: int) -> dict:
    """:func:`measure` one row, append it to ``rows`` and print it (with its peak profile, if any)."""
    rows.append(measure(model, mode, tokens, args, device, optimizer))
    print_row(rows[-1])
    print_profile(rows[-1])
    return rows[-1]


def bracket_search(first: list[int], mode: str, trial: Callable[[int], dict], time_left: Callable[[], bool],
                   known: list[dict] | None = None) -> list[dict]:
    """Trials at ``first`` (stopping at the first size that does not fit), then 5% steps out
    (:func:`next_size_to_bracket` over ``known`` + these trials) until one size fits and one does
    not, while ``time_left()``. ``trial(n)`` runs one row and returns it. Returns the trials."""
    search = list(known or [])
    done: list[dict] = []
    for n in first:
        if not time_left():
            return done
        done.append(trial(n))
        search.append(done[-1])
        if done[-1]["status"].startswith("oom"):
            break
    while time_left():
        n = next_size_to_bracket(search, mode)  # the first sizes were off by more than their bracket
        if n is None:
            break
        done.append(trial(n))
        search.append(done[-1])
    return done


def fitted_and_failed(rows: list[dict], mode: str) -> tuple[list[int], list[int]]:
    """The token counts of ``mode``'s rows that fitted, and of those that ran out of memory."""
    ok = [r["tokens"] for r in rows if r["mode"] == mode and r["status"] == "ok"]
    bad = [r["tokens"] for r in rows if r["mode"] == mode and r["status"].startswith("oom")]
    return ok, bad


def next_size_to_bracket(rows: list[dict], mode: str, step: float = 0.05) -> int | None:
    """Until ``mode`` has a size that fitted and one that did not: 5% above the largest fit when
    nothing failed, 5% below the smallest failure when nothing fitted (multiples of 1,024);
    ``None`` once bracketed (or before any trial)."""
    ok, bad = fitted_and_failed(rows, mode)
    if (ok and bad) or not (ok or bad):
        return None
    n = max(ok) * (1 + step) if ok else min(bad) * (1 - step)
    return max(1024, int(n) // 1024 * 1024)


def bisect(model, mode: str, lo: int, hi: int, args, device, optimizer, rows: list) -> int:
    """Largest token count in ``[lo, hi)`` that fits (``lo`` fits, ``hi`` does not)."""
    while not bisect_done(lo, hi, args):
        mid = (lo + hi) // 2
        mid -= mid % 64
        row = measure(model, mode, mid, args, device, optimizer)
        row["bisect"] = True
        rows.append(row)
        print_row(row)
        print_profile(row)
        if row["status"] == "ok":
            lo = mid
        else:
            hi = mid
    return lo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", help="a shape of benchmarks/workload.py (tiny: CPU smoke test)")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=ALL_MODES,
                   help=f"default {' '.join(DEFAULT_MODES)}; trl and trl_liger need trl (and liger-kernel)")
    p.add_argument("--ckpt-max-tokens", type=int, default=65536,
                   help="largest size for the ckpt / offload_all comparison rows (they exist to time the offload)")
    p.add_argument("--doc-tokens", type=int, default=32768, help="document length inside the row (0: one sequence)")
    p.add_argument("--mlp-tile", type=int, default=None, help="tokens per MLP tile (default: ~1 GiB tiles)")
    p.add_argument("--no-tile-projections", dest="tile_projections", action="store_false",
                   help="keep the LoRA attention projections untiled (their float32 input copies stay)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--bisect", nargs="*", default=None, choices=ALL_MODES,
                   help="modes whose largest fitting token count to search (after the grid)")
    p.add_argument("--bisect-granularity", type=int, default=16384)
    p.add_argument("--bisect-tol", type=float, default=None,
                   help="stop bisecting once the bracket is within this fraction of the largest fit (0.05: 5%%)")
    p.add_argument("--tokens-from-planner", action="store_true",
                   help="offload mode: the sizes are the planner's largest fitting row -2.5%% / +2%%; the mode "
                        "then grows by 5%% while it fits, and bisects (with --bisect)")
    p.add_argument("--bracket-from-fit", action="store_true",
                   help="after the --tokens rows of a mode (two at least, all fitting): two trials around where "
                        "a line through the two largest reaches the GPU's memory, 5%% steps out if both fit or "
                        "fail, then --bisect (for TRL + Liger, which the planner does not model)")
    p.add_argument("--no-autocast", dest="autocast", action="store_false",
                   help="run swiftune's step without bf16 autocast (the float32 LoRA matmuls of PEFT's default)")
    p.add_argument("--memory-profile", action="store_true",
                   help="CUDA: record what is alive at the peak of each row's last step (by allocation site; "
                        "that step runs slower, its time is not a figure)")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds; later rows are skipped")
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the --out path with .rows.jsonl)")
    p.add_argument("--replan", nargs="+", default=None, metavar="JSON",
                   help="no run: recompute the planner columns of saved results with the current planner "
                        "(rewritten in place; see --gpu-bytes)")
    p.add_argument("--gpu-bytes", type=float, default=149.3e9,
                   help="--replan: GPU memory when the JSON does not record it (default: an H200)")
    args = p.parse_args(argv)
    from swiftune.attention.backends import varlen_expands_kv

    args.kv_expanded = varlen_expands_kv()
    args.autocast = args.autocast and torch.cuda.is_available()  # the bf16 step is the GPU's
    if args.replan:
        for path in args.replan:
            replan(path, args)
        return 0

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model != "tiny" and device.type != "cuda":
        print("benchmarks/longctx.py: real shapes need a CUDA device (use --model tiny on CPU)", file=sys.stderr)
        return 2
    # Host memory the offloaded checkpoints may pin, measured once before anything is pinned: the
    # pool keeps its pages between steps, so a later reading would count this run's own checkpoints
    # as taken (the planner's answer printed at the end then shrank with every trial).
    from swiftune.training.checkpointing import host_available_bytes

    args.host_bytes = host_available_bytes() if device.type == "cuda" else None
    # The kernel swiftune's offloaded checkpointing is told by the packed layout, as the planner
    # must plan it: per-document sdpa under `auto` on CUDA when the documents are long
    # (`PackedBatch.attention_kernel`; one sequence counts as one long document).
    from swiftune.attention.backends import SDPA_MIN_MEAN_DOC_TOKENS

    long_docs = args.doc_tokens == 0 or args.doc_tokens >= SDPA_MIN_MEAN_DOC_TOKENS
    args.attention_kernel = "sdpa" if device.type == "cuda" and long_docs else None
    if args.tokens_from_planner:
        if device.type != "cuda" or args.modes != ["offload"]:
            p.error("--tokens-from-planner needs a CUDA device and --modes offload")
        args.tokens, args.planner_best = planner_bracket(
            args.model, "offload", torch.cuda.get_device_properties(device).total_memory, args)
        print(f"# planner: largest fitting row {args.planner_best:,} tokens; trials {args.tokens}", flush=True)
    if args.tokens is None:
        args.tokens = TINY_TOKENS if args.model == "tiny" else DEFAULT_TOKENS
    if args.model == "tiny":  # smoke test: small documents, tiles small enough to run the tiled path
        args.doc_tokens = min(args.doc_tokens, 512)
        args.mlp_tile = args.mlp_tile or 256
    start = time.perf_counter()
    print(f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'} torch {torch.__version__} "
          f"model {args.model} LoRA r=16 doc_tokens {args.doc_tokens}", flush=True)
    rows: list[dict] = []
    first = True
    groups = [["baseline"], ["trl"], ["trl_liger"], ["ckpt", "offload", "offload_all"]]
    for group in groups:
        modes = [m for m in group if m in args.modes]
        if not modes:
            continue
        model = build_model(args.model, modes[0], device, args.mlp_tile, args.tile_projections)
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5)
        warmed = False
        for mode in modes:
            if mode in ("ckpt", "offload", "offload_all"):
                set_checkpointing(model, mode)
            if not warmed:  # compile kernels, allocate optimizer states, once per model
                measure(model, mode, min(min(args.tokens), 8192), args, device, optimizer, profile=False)
                warmed = True
            limit = args.ckpt_max_tokens if mode in ("ckpt", "offload_all") and args.model != "tiny" else None
            for n in args.tokens:
                if limit is not None and n > limit:
                    continue
                if time.perf_counter() - start > args.time_budget:
                    row = {"mode": mode, "tokens": n, "status": "skipped"}
                else:
                    row = measure(model, mode, n, args, device, optimizer)
                    ref = next((r for r in rows if r["mode"] == "ckpt" and r["tokens"] == n and r["status"] == "ok"), None)
                    if ref is not None and row["status"] == "ok" and mode != "ckpt":
                        row["time_vs_ckpt"] = row.get("step_s_excl_pin", row["step_s"]) / ref["step_s"]
                rows.append(row)
                print_row(row, header=first)
                print_profile(row)
                first = False
                if row["status"].startswith("oom"):
                    break
            fit = None
            if args.bracket_from_fit and device.type == "cuda" and not fitted_and_failed(rows, mode)[1]:
                fit = fit_bracket(rows, mode, torch.cuda.get_device_properties(device).total_memory)
            trial = functools.partial(measure_row, rows, model, mode, args, device, optimizer)
            time_left = functools.partial(within_budget, start, args.time_budget)
            if fit is not None:
                print(f"# {mode}: a line through its two largest rows reaches the GPU at {fit[1]:,} tokens; "
                      f"trials {fit[0]}", flush=True)
                bracket_search(fit[0], mode, trial, time_left)
            elif args.tokens_from_planner:  # the planner's two sizes were the grid
                bracket_search([], mode, trial, time_left, known=[r for r in rows if r["mode"] == mode])
            del trial  # (it holds the model, freed below)
            if args.bisect is not None and mode in (args.bisect or args.modes):
                ok, bad = fitted_and_failed(rows, mode)
                if ok and bad and time.perf_counter() - start < args.time_budget:
                    best = bisect(model, mode, max(ok), min(bad), args, device, optimizer, rows)
                    rows.append({"mode": mode, "tokens": best, "status": "max_fit"})
        del model, optimizer
        reset_cuda_memory(device.type == "cuda")

    print("\n# long-context step (LoRA r=16); GB = 1e9 bytes; alloc/pred = measured / planner", flush=True)
    header = True
    for row in rows:
        if row["status"] in ("ok", "oom", "oom_host", "skipped", "max_fit"):
            print_row(row, header=header)
            header = False
    predicted: dict = {}
    if device.type == "cuda":
        from swiftune.memory import max_tokens

        from benchmarks.workload import shape_of

        gpu = torch.cuda.get_device_properties(device).total_memory
        for mode in args.modes:
            if mode != "offload_all":  # (offload: with the host memory as the run started, see above)
                predicted[mode] = max_tokens(shape_of(args.model), gpu, 16, **_plan_kwargs(mode, args))
        print("# planner's largest fitting token count: "
              + ", ".join(f"{m} {n:,}" for m, n in predicted.items()), flush=True)
    data = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "gpu_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
            "torch": torch.__version__, "args": vars(args), "rows": rows, "predicted_max_tokens": predicted}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, default=str)
    results.save("longctx", argv, json.loads(json.dumps(data, default=str)), args.out, args.rows)
    print(f"# wall {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
