"""GRPO reward curves of the built-in task: FP8 base weights against bf16.

Both runs are ``swiftune grpo`` on its built-in reversal task (a random tiny Qwen3-shaped model, an SFT
warm-up of the whole model, then GRPO), each in its own process with the same seed, so the same
warm-up and the same prompts in the same order; they differ only in the weights GRPO trains over:

  bf16  LoRA r=16 on the warmed-up bf16 model (``--use_lora true``)
  fp8   the same adapters on the same model with every decoder linear weight quantised to FP8 after
        the warm-up (``--load_in_fp8 true``: e4m3, a float32 scale per row; ``torch._scaled_mm``
        where the GPU has FP8 tensor cores, the dequantising reference elsewhere)

Sampling makes the two runs' completions differ from the first step on (the FP8 logits are not the
bf16 logits), so the comparison is of the curves, not of the steps: the mean reward of the first
and the last fifth of each run, and the rise between them. Each step's reward is in the JSON.

    python -m benchmarks.reward_curve --out reward_curve_fp8.json   # ~1-2 min on a GPU, ~1 min on CPU
    python -m benchmarks.reward_curve --max-steps 3 --sft-warmup-steps 4  # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import child_env, results
from benchmarks.child_output import failure_summary

RUNS = {"bf16": ["--use_lora", "true"], "fp8": ["--load_in_fp8", "true"]}


def read_rewards(metrics_path: str) -> list[float]:
    """The ``reward`` of each logged step of a ``metrics.jsonl``."""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [float(r["reward"]) for r in rows if "reward" in r]


def fifths(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last fifth of the run."""
    k = max(1, len(rewards) // 5)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def run_one(name: str, args, workdir: str) -> dict:
    out_dir = os.path.join(workdir, name)
    cmd = [sys.executable, "-m", "swiftune", "grpo", *RUNS[name], "--output_dir", out_dir, "--seed", str(args.seed),
           "--disable_tqdm", "true", *(["--max_steps", str(args.max_steps)] if args.max_steps else []),
           *(["--sft_warmup_steps", str(args.sft_warmup_steps)] if args.sft_warmup_steps is not None else [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: swiftune grpo exited {proc.returncode}: "
                           f"{failure_summary(proc.stderr or proc.stdout, 600)}")
    rewards = read_rewards(os.path.join(out_dir, "metrics.jsonl"))
    first, last = fifths(rewards)
    return dict(run=name, command=" ".join(cmd[2:]), rewards=rewards, first_fifth=first, last_fifth=last,
                rise=last - first, wall_s=time.perf_counter() - t0)


def plot(result: dict, path: str) -> bool:
    """Both reward curves (per step and a 10-step running mean); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("bf16", "#999999"), ("fp8", "#d62728")):
        r = result["runs"][name]["rewards"]
        mean = [sum(r[max(0, i - 9): i + 1]) / len(r[max(0, i - 9): i + 1]) for i in range(len(r))]
        ax.plot(range(1, len(r) + 1), r, color=color, alpha=0.3, lw=0.8)
        ax.plot(range(1, len(r) + 1), mean, color=color, lw=2, label=f"{name} base weights (10-step mean)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"swiftune grpo, built-in task, LoRA r=16 ({result['device']})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=None, help="GRPO steps (default: the built-in run's, 100)")
    p.add_argument("--sft-warmup-steps", type=int, default=None, help="default: the built-in run's (60)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--workdir", default="/tmp/bench_reward_curve")
    p.add_argument("--out", default=None, help="write the JSON here (and the PNG next to it)")
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here")
    args = p.parse_args(argv)
    import torch

    runs = {}
    for name in RUNS:
        runs[name] = run_one(name, args, args.workdir)
        r = runs[name]
        print(f"# {name}: {len(r['rewards'])} steps in {r['wall_s']:.0f} s, reward {r['first_fifth']:.3f} -> "
              f"{r['last_fifth']:.3f}", flush=True)
        if args.out:  # each finished run on disk at once: a time limit after it loses only the comparison
            with open(args.out, "w") as f:
                json.dump(dict(benchmark="reward_curve_partial", seed=args.seed, runs=runs), f, indent=1)
    result = dict(benchmark="reward_curve", seed=args.seed, steps=len(runs["bf16"]["rewards"]), runs=runs,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  last_fifth_diff=runs["fp8"]["last_fifth"] - runs["bf16"]["last_fifth"])
    png = os.path.splitext(args.out)[0] + ".png" if args.out else None
    if png and plot(result, png):
        result["png"] = png
    print(f"\n# GRPO reward, built-in task, LoRA r=16, {result['steps']} steps ({result['device']})")
    print(f"{'base':>5} {'first fifth':>12} {'last fifth':>11} {'rise':>7}")
    for name, r in runs.items():
        print(f"{name:>5} {r['first_fifth']:12.3f} {r['last_fifth']:11.3f} {r['rise']:+7.3f}")
    print(f"last fifth, fp8 - bf16: {result['last_fifth_diff']:+.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    results.save("reward_curve", argv, result, args.out, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
