"""Unsloth's SFT figures beside swiftune's, as rows of the same schema (``benchmarks.sft``'s JSON).

Unsloth patches transformers, PEFT and TRL when it is imported, so it never shares a process with
the other tools: this script runs the workplace's Unsloth anchor (``anchors/unsloth_anchor.py`` of
a copy of the shared folder, the same model shapes, LoRA r16 on all seven projections, rows of
``data/lengths.py``, the same timed window) in child processes with Unsloth's wheels on their
``PYTHONPATH``, and writes what they measured as ``benchmarks.sft`` rows (``mode`` ``unsloth``:
padding-free as Unsloth decides it; ``unsloth_packed``: its BFD packing of ``--max-length`` rows).

    python -m benchmarks.unsloth_sft --shared .shared --model qwen3-8b --batch 16 --out unsloth_sft.json

Without ``--site`` the wheels of ``<shared>/wheels/unsloth`` are installed (``pip --target``, no
index) into a temporary folder first; ``--site DIR`` reuses a folder where they are installed.

The anchor's checkpoint of the random-init model is written once (``--model-dir``, a plain
transformers child that never imports Unsloth) and reused by each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks import results
from benchmarks.child_output import failure_summary

GIB = 2**30
MODES = {"unsloth": [], "unsloth_packed": ["--packing"]}


def anchor_env(site: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1",
               PYTHONUNBUFFERED="1")
    return env


def install_wheels(folder: str) -> str:
    """Install every wheel of ``folder`` (no index, no dependencies resolved) into a new temporary
    folder; return it."""
    import glob
    import tempfile

    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        raise SystemExit(f"no wheels in {folder}: pass --site, or --shared with wheels/unsloth/")
    site = tempfile.mkdtemp(prefix="unsloth-site-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", site, *wheels], check=True)
    return site


def run_anchor(shared: str, site: str, args: list[str], timeout: float, gpu_fraction: float = 0.0) -> list[dict]:
    """The ``RESULT`` records of one anchor run (its stderr tail in an ``error`` record if none). With
    ``gpu_fraction``, the anchor runs through :mod:`benchmarks.capped_card`: a card of that share of the GPU's
    memory for the allocator and for what ``torch.cuda.mem_get_info`` reports, which Unsloth sizes its work by."""
    script = os.path.join("anchors", "unsloth_anchor.py")
    capped = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "capped_card.py"),
              "--fraction", f"{gpu_fraction:.6f}"] if gpu_fraction else []
    cmd = [sys.executable, *capped, script, *args]
    try:
        proc = subprocess.run(cmd, cwd=shared, env=anchor_env(site), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"status": "error", "error": f"timed out after {timeout:.0f} s"}]
    found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        tail = failure_summary(proc.stderr or proc.stdout, 300)
        found = [{"status": "error", "error": f"exit {proc.returncode}: {tail}"}]
    return found


def sft_row(mode: str, model: str, batch: int, record: dict, finetune: str = "lora r=16") -> dict:
    """An anchor SFT record as a ``benchmarks.sft`` row (GiB -> GB)."""
    metrics = record.get("metrics") or {}
    if record.get("status") != "ok" or not metrics.get("tokens_per_s"):
        return dict(mode=mode, model=model, batch=batch, error=str(record.get("error", record.get("status")))[:300])
    versions = (record.get("versions") or record.get("env", {}).get("versions") or {})
    return dict(mode=mode, model=model, batch=batch, finetune=finetune, steps=metrics.get("timed_steps"),
                tokens_per_s=metrics["tokens_per_s"], peak_gb=metrics["peak_mem_gib"] * GIB / 1e9,
                sec_per_step=metrics["step_time_ms"] / 1000, padding_fraction=metrics.get("padding_fraction") or 0.0,
                unsloth_version=versions.get("unsloth"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", required=True, help="a copy of the workplace's shared folder (anchors/, data/)")
    p.add_argument("--site", default=None, help="folder with Unsloth's wheels installed (pip --target); "
                   "default: install <shared>/wheels/unsloth into a temporary folder")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--num-examples", type=int, default=2000)
    p.add_argument("--4bit", dest="load_in_4bit", action="store_true",
                   help="QLoRA: Unsloth's load_in_4bit (bitsandbytes NF4); rows say finetune 'qlora r=16'")
    p.add_argument("--model-dir", default="/tmp/unsloth_anchor_ckpt")
    p.add_argument("--timeout", type=float, default=300, help="seconds per anchor run")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--rows", default=None, help="result rows (JSON Lines); default: the --out path with .rows.jsonl")
    args = p.parse_args(argv)
    shared = os.path.abspath(args.shared)
    site = args.site or install_wheels(os.path.join(shared, "wheels", "unsloth"))
    saved = run_anchor(shared, site, ["--save-model-only", "--model", args.model, "--model-dir", args.model_dir],
                       args.timeout)
    if not os.path.exists(os.path.join(args.model_dir, "unsloth_anchor_model.json")):
        print(f"no checkpoint in {args.model_dir}: {saved[-1].get('error', saved[-1])}", file=sys.stderr)
        return 1
    rows = []
    for mode in args.modes:
        records = run_anchor(shared, site, ["--mode", "sft", "--model", args.model, "--model-dir", args.model_dir,
                                                 "--batch-size", str(args.batch), "--steps", str(args.steps),
                                                 "--warmup", str(args.warmup), "--num-examples", str(args.num_examples),
                                                 *MODES[mode], *(["--4bit"] if args.load_in_4bit else [])],
                             args.timeout)
        rows.append(sft_row(mode, args.model, args.batch, records[-1], "qlora r=16" if args.load_in_4bit else "lora r=16"))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'mode':<16} {'model':<11} {'batch':>5} {'tok/s':>8} {'peak GB':>8} {'s/step':>7} {'padding':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<16} {r['model']:<11} {r['batch']:>5}  FAILED: {r['error'][:150]}")
        else:
            print(f"{r['mode']:<16} {r['model']:<11} {r['batch']:>5} {r['tokens_per_s']:8.0f} {r['peak_gb']:8.1f} "
                  f"{r['sec_per_step']:7.2f} {r['padding_fraction']:8.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    path = results.rows_path(args.rows, args.out)
    measured = [r for r in rows if "error" not in r]
    if path and measured:
        ctx = results.run_context("unsloth_sft", argv, warmup=args.warmup)
        ctx.versions["unsloth"] = measured[0].get("unsloth_version") or "unknown"  # installed for the children only
        n = results.write_rows(path, results.rows_from(rows, ctx))
        print(f"# {n} result rows: {path}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
