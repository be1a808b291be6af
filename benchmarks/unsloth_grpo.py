"""Unsloth's GRPO policy step beside swiftune's, as a ``benchmarks.grpo`` bisection JSON (mode ``unsloth``).

Unsloth patches transformers, PEFT and TRL when it is imported, so it never shares a process with the
other tools: this script runs the workplace's Unsloth anchor (``anchors/unsloth_anchor.py`` of a copy of
the shared folder: one GRPO policy-loss forward + backward through Unsloth's patched ``GRPOTrainer``,
generation bypassed, the same random-init shapes, LoRA r16 on all seven projections, G rows of the same
``--prompt-tokens`` prompt + their own completion) in a child process with Unsloth's wheels on its
``PYTHONPATH`` (:mod:`benchmarks.unsloth_sft`'s helpers), and writes what it measured in the JSON schema
of ``python -m benchmarks.grpo --bisect-completion`` (``docs/benchmarks.md`` renders both alike):

* fixed lengths (``--completion-lengths``): one trial each, time of the calls after the first (the
  anchor's median; the first call's time as ``first_s``), peak GPU memory allocated;
* ``--scan``: the anchor doubles from ``--scan-start`` until a length runs out of memory, then bisects
  to ``--tolerance``: ``max_fit`` / ``first_fail`` of the ``unsloth`` mode.

``--records FILE`` converts the RESULT records an earlier anchor run appended to ``FILE`` (its
``--out-jsonl``) instead of running it. ``--gpu-budget-gb`` emulates a smaller GPU as ``benchmarks.grpo``
does (the anchor's ``--gpu-mem-fraction``: that many GB of this GPU's memory), and through
:mod:`benchmarks.capped_card` also in what ``torch.cuda.mem_get_info`` reports, from which Unsloth sizes its
loss chunks and buffers (without it, an emulated 80 GB on an H200 failed at a length Unsloth fits on an H100
80GB); ``--4bit`` is Unsloth's QLoRA (NF4).

    python -m benchmarks.unsloth_grpo --shared .shared --model qwen3-8b --completion-lengths 65536 \\
        --out unsloth_grpo_65k.json
    python -m benchmarks.unsloth_grpo --shared .shared --model qwen3-8b --4bit --gpu-budget-gb 80 --scan \\
        --scan-start 65536 --time-budget 900 --out unsloth_qlora_grpo_80gb.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks import results
from benchmarks.unsloth_sft import GIB, install_wheels, run_anchor

LABEL = "Unsloth GRPOTrainer policy step (FastLanguageModel, its patched TRL)"


def gpu_fraction(budget_gb: float | None) -> float:
    """The anchor's ``--gpu-mem-fraction`` for a budget of ``budget_gb`` GB of this GPU (0: the whole GPU)."""
    if budget_gb is None:
        return 0.0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpu-budget-gb needs a CUDA device (a fraction of its memory)")
    total = torch.cuda.get_device_properties(0).total_memory
    if budget_gb * 1e9 > total:
        raise SystemExit(f"--gpu-budget-gb {budget_gb} is more than this GPU's {total / 1e9:.1f} GB")
    return budget_gb * 1e9 / total


def trial_of(record: dict, rows: int, prompt: int) -> dict:
    """An anchor probe record as a ``benchmarks.grpo`` trial (``ok``, ``oom`` or ``error``; GiB -> GB)."""
    c = int(record.get("completion_length") or 0)
    status = record.get("status")
    trial = {"mode": "unsloth", "completion": c, "tokens": rows * (prompt + c),
             "status": status if status in ("ok", "oom") else "error"}
    if trial["status"] != "ok":
        trial["error"] = str(record.get("oom_kind") or record.get("error") or status)[:300]
        return trial
    step = record.get("fwd_bwd_s_median")
    peak = record.get("peak_mem_gib_incl_ref", record.get("peak_mem_gib"))
    first = (record.get("first_call") or {}).get("fwd_bwd_s")
    if step:
        trial.update(s=step, tokens_per_s=trial["tokens"] / step)
    if first:
        trial["first_s"] = first
    if peak is not None:
        trial["peak_gb"] = peak * GIB / 1e9
    return trial


def unsloth_mode(records: list[dict], rows: int, prompt: int, scanned: bool) -> dict:
    """The ``unsloth`` entry of the JSON's ``modes``: every probe as a trial, the scan's bracket when it ran."""
    probes = [r for r in records if r.get("completion_length") is not None and r.get("mode") != "grpo-scan"
              and "probes" not in r]
    trials = [trial_of(r, rows, prompt) for r in probes]
    summary = next((r for r in reversed(records) if "max_ok_completion_length" in r), None)
    mode = {"mode": "unsloth", "label": LABEL, "trials": trials}
    if scanned and summary is not None:
        mode.update(max_fit=summary.get("max_ok_completion_length"),
                    first_fail=summary.get("min_failed_completion_length"),
                    status="converged" if summary.get("stop_reason") == "oom" else str(summary.get("stop_reason")))
    else:
        fits = [t["completion"] for t in trials if t["status"] == "ok"]
        fails = [t["completion"] for t in trials if t["status"] == "oom"]
        mode.update(max_fit=max(fits) if fits else None, first_fail=min(fails) if fails else None, status="fixed_only")
    errors = [r for r in records if r.get("status") not in ("ok", "oom") and r.get("error")]
    if not trials and errors:
        mode["error"] = str(errors[-1]["error"])[:300]
    return mode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", default=None, help="a copy of the workplace's shared folder (anchors/, data/); "
                   "needed unless --records")
    p.add_argument("--site", default=None, help="folder with Unsloth's wheels installed (pip --target); "
                   "default: install <shared>/wheels/unsloth into a temporary folder")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--generations", type=int, default=2, help="G: rows of one prompt")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-lengths", type=int, nargs="*", default=[], help="fixed lengths, one trial each")
    p.add_argument("--scan", action="store_true", help="the largest completion per row that fits (doubling, bisection)")
    p.add_argument("--scan-start", type=int, default=16384)
    p.add_argument("--tolerance", type=float, default=0.05, help="--scan: bisect until the bracket is this close")
    p.add_argument("--repeats", type=int, default=2, help="calls per length; the first is reported apart")
    p.add_argument("--4bit", dest="load_in_4bit", action="store_true", help="QLoRA: Unsloth's load_in_4bit (NF4)")
    p.add_argument("--gpu-budget-gb", type=float, default=None, help="emulate a GPU of this many GB")
    p.add_argument("--time-budget", type=float, default=900, help="seconds for the anchor's run (its scan stops "
                   "before a probe predicted to end past it)")
    p.add_argument("--model-dir", default="/tmp/unsloth_anchor_ckpt")
    p.add_argument("--records", default=None, help="the anchor's --out-jsonl of an earlier run: convert its "
                   "records, run nothing")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--rows", default=None, help="result rows (JSON Lines); default: the --out path with .rows.jsonl")
    args = p.parse_args(argv)
    if not args.completion_lengths and not args.scan:
        p.error("give --completion-lengths, --scan, or both")
    if any(c < 1 for c in args.completion_lengths):
        p.error("--completion-lengths must be >= 1")
    if not args.shared and not args.records:
        p.error("give --shared (a copy of the shared folder with anchors/ and wheels/unsloth/) or --records")
    start = time.perf_counter()
    if args.records:
        with open(args.records) as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        records = run_unsloth(args)
    return report(args, argv, records, time.perf_counter() - start)


def run_unsloth(args) -> list[dict]:
    """The anchor's RESULT records for ``args``' lengths / scan (its checkpoint written first)."""
    fraction = gpu_fraction(args.gpu_budget_gb)
    shared = os.path.abspath(args.shared)
    site = args.site or install_wheels(os.path.join(shared, "wheels", "unsloth"))
    start = time.perf_counter()
    saved = run_anchor(shared, site, ["--save-model-only", "--model", args.model, "--model-dir", args.model_dir], 600)
    if not os.path.exists(os.path.join(args.model_dir, "unsloth_anchor_model.json")):
        return [{"status": "error", "error": f"no checkpoint in {args.model_dir}: {saved[-1].get('error', saved[-1])}"}]
    anchor = ["--mode", "grpo", "--model", args.model, "--model-dir", args.model_dir,
              "--num-generations", str(args.generations), "--prompt-length", str(args.prompt_tokens),
              "--repeats", str(args.repeats)]
    if args.completion_lengths:
        anchor += ["--completion-length", ",".join(str(c) for c in args.completion_lengths)]
    if args.scan:
        left = args.time_budget - (time.perf_counter() - start)
        anchor += ["--scan", "--scan-start", str(args.scan_start), "--scan-tol", str(args.tolerance),
                   "--scan-time-budget", str(max(60.0, left - 60))]
    if args.load_in_4bit:
        anchor.append("--4bit")
    if fraction:  # the anchor's own cap records the limit in its environment record; capped_card sets the same
        anchor += ["--gpu-mem-fraction", f"{fraction:.6f}"]
    return run_anchor(shared, site, anchor, args.time_budget + 120, gpu_fraction=fraction)


def report(args, argv: list[str] | None, records: list[dict], wall_s: float) -> int:
    """Print the trials, write the JSON and its rows; 0 when at least one trial was measured."""
    mode = unsloth_mode(records, args.generations, args.prompt_tokens, args.scan)
    # the anchor's environment (its child's libraries and GPU), as benchmarks.grpo's JSON names its own
    env = next((r for r in records if r.get("versions")), {})
    versions = env.get("versions", {})
    version = versions.get("unsloth")
    data = {"benchmark": "grpo_bisect", "model": args.model, "prompt_tokens": args.prompt_tokens,
            "rows": args.generations, "tolerance": args.tolerance, "share_prompt": False,
            "load_in_4bit": args.load_in_4bit, "gpu_budget_gb": args.gpu_budget_gb, "unsloth": version,
            **{k: versions[k] for k in ("torch", "transformers", "peft", "trl") if versions.get(k)},
            **({"device": env["gpu"]} if env.get("gpu") else {}),
            # what Unsloth's torch.cuda.mem_get_info reported, from which it sizes its loss chunks and buffers:
            # a card of the budget's size (benchmarks.capped_card) or the card's own; unknown for --records
            **({} if args.records else {"mem_get_info": "budget" if args.gpu_budget_gb else "card"}),
            "modes": {"unsloth": mode}, "wall_s": wall_s}
    print(f"\n# Unsloth GRPO policy step, {args.model}, G={args.generations}, prompt {args.prompt_tokens}"
          + (", QLoRA" if args.load_in_4bit else "") + (f", {args.gpu_budget_gb} GB" if args.gpu_budget_gb else ""))
    print(f"{'completion':>10} {'status':>7} {'s':>8} {'first s':>8} {'peak GB':>8}")
    for t in mode["trials"]:
        print(f"{t['completion']:>10} {t['status']:>7} {t.get('s', float('nan')):8.2f} "
              f"{t.get('first_s', float('nan')):8.2f} {t.get('peak_gb', float('nan')):8.1f}")
    print(f"max fit {mode.get('max_fit')}, first fail {mode.get('first_fail')} ({mode['status']})"
          + (f"; error: {mode['error']}" if "error" in mode else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    path = results.rows_path(args.rows, args.out)
    if path and mode["trials"]:
        ctx = results.run_context("unsloth_grpo", argv)
        ctx.versions["unsloth"] = version or "unknown"  # installed for the child only
        n = results.write_rows(path, results.rows_from(data, ctx))
        print(f"# {n} result rows: {path}", file=sys.stderr, flush=True)
    return 0 if mode["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
