"""PNG figures for docs/ from the JSON files the benchmark scripts write.

Recognised files (by their content, not their names):

  benchmarks/sft.py         list of rows (mode, model, batch, tokens_per_s, peak_gb, padding_fraction):
                            tokens/s and peak memory vs batch size per mode, one figure per model
                            (bars when the file holds a single batch size)
  benchmarks/longctx.py     {"rows": [...]}: peak GPU memory and step time vs tokens per mode, OOM
                            rows and the largest fitting size marked
  benchmarks/grpo.py        step: time and peak memory of each phase; --bisect-completion: peak
                            memory vs completion length per mode, the largest fitting one marked
  benchmarks/loss_curve.py  both loss curves and their difference

Each input ``NAME.json`` gives ``OUTDIR/NAME.png`` (``NAME_<model>.png`` when an SFT file holds
several models). Files of another shape are skipped with a message.

    python -m benchmarks.plots docs/results/*.json --outdir docs/plots
"""

from __future__ import annotations

import argparse
import json
import os
import sys


MODE_NAMES = {
    "hf_padded": "transformers + PEFT, padded",
    "trl_padding_free": "TRL, padding-free",
    "trl_liger": "TRL + Liger",
    "swiftune": "swiftune",
    "swiftune_budget": "swiftune, 16K-token budget",
    "swiftune_budget_offload": "swiftune, 16K-token budget, checkpoints on host",
    "swiftune_peft_lora": "swiftune, PEFT's LoRA forwards",
    "swiftune_offload": "swiftune, checkpoints on host",
    "unsloth": "Unsloth",
    "unsloth_packed": "Unsloth, packed",
    "baseline": "transformers + PEFT (full logits)",
    "ckpt": "swiftune, checkpoints on GPU",
    "offload": "swiftune, offload within budget",
    "offload_all": "swiftune, offload all",
    "offload_one_sequence": "swiftune, offload within budget",
    "offload_before_reserve_change": "swiftune, offload, the earlier varlen-sized reserve",
    "hf_full_logits": "transformers + PEFT, full logits",
    "trl_grpo": "TRL GRPOTrainer loss",
    "swiftune_offload_all": "swiftune, every checkpoint on the host",
    "trl_selective": "TRL selective_log_softmax",
}
SWIFTUNE_COLOR = "#d62728"
OTHER_COLORS = ["#7f7f7f", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    """Lay out, write at the docs' resolution, free the figure; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def colors_for(modes: list[str]) -> dict[str, str]:
    out, i = {}, 0
    for m in modes:
        if m.startswith(("swiftune", "offload")) or m == "ckpt":
            shade = {"swiftune": SWIFTUNE_COLOR, "swiftune_budget": "#ff7f0e",
                     "swiftune_budget_offload": "#bcbd22", "ckpt": "#ff7f0e",
                     "offload": SWIFTUNE_COLOR, "offload_all": "#bcbd22", "swiftune_offload_all": "#bcbd22",
                     "offload_one_sequence": "#ff7f0e", "offload_before_reserve_change": "#ff9896"}
            out[m] = shade.get(m, SWIFTUNE_COLOR)
        else:
            out[m] = OTHER_COLORS[i % len(OTHER_COLORS)]
            i += 1
    return out


def name(mode: str) -> str:
    return MODE_NAMES.get(mode, mode)


def tokens_label(n: int) -> str:
    """8192 -> 8K, 409600 -> 400K, 1048576 -> 1M."""
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return f"{n:,}"


def kind_of(data) -> str | None:
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data) \
            and {"mode", "batch"} <= set(data[0]):
        return "sft"
    if isinstance(data, dict):
        if data.get("benchmark") in ("grpo_step", "grpo_bisect", "loss_curve", "rollout"):
            return data["benchmark"]
        rows = data.get("rows")
        if isinstance(rows, list) and rows and {"mode", "tokens", "status"} <= set(rows[0]):
            return "longctx"
    return None


# ------------------------------------------------------------------------------------------ sft


def plot_sft(rows: list[dict], out: str) -> list[str]:
    plt = _plt()
    rows = [r for r in rows if "error" not in r]
    written = []
    models = sorted({r["model"] for r in rows})
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        batches = sorted({r["batch"] for r in mine})
        color = colors_for(modes)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        panels = ((axes[0], "tokens_per_s", "tokens / s (non-padding)"), (axes[1], "peak_gb", "peak GPU memory (GB)"))
        for ax, key, label in panels:
            if len(batches) == 1:
                vals = [next(r[key] for r in mine if r["mode"] == m) for m in modes]
                pads = [next(r.get("padding_fraction", 0.0) for r in mine if r["mode"] == m) for m in modes]
                y = range(len(modes))
                ax.barh(list(y), vals, color=[color[m] for m in modes])
                ax.set_yticks(list(y))
                ax.set_yticklabels([f"{name(m)}\n({p:.0%} padding)" for m, p in zip(modes, pads)], fontsize=8)
                ax.invert_yaxis()
                for yi, v in zip(y, vals):
                    ax.text(v, yi, f" {v:,.0f}" if key == "tokens_per_s" else f" {v:.1f}", va="center", fontsize=8)
                ax.set_xlabel(label)
                ax.set_xlim(0, max(vals) * 1.18)
                ax.grid(axis="x", alpha=0.3)
            else:
                for m in modes:
                    pts = sorted((r["batch"], r[key]) for r in mine if r["mode"] == m)
                    ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=name(m), color=color[m],
                            lw=2.2 if m.startswith("swiftune") else 1.4)
                ax.set_xscale("log", base=2)
                ax.set_xticks(batches)
                ax.set_xticklabels([str(b) for b in batches])
                ax.set_xlabel("batch size (examples)")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        batch_txt = f"batch {batches[0]}" if len(batches) == 1 else "by batch size"
        how = "full fine-tuning" if all(r.get("finetune") == "full" for r in mine) else "LoRA r=16"
        fig.suptitle(f"SFT throughput and memory, {model} shape, {how}, {batch_txt}")
        written.append(_save(fig, out if len(models) == 1 else f"{os.path.splitext(out)[0]}_{model}.png"))
    return written


# -------------------------------------------------------------------------------------- longctx


def doc_note(data: dict, mode: str) -> str:
    """How ``mode``'s rows were cut, where a merged file (``benchmarks/merge_bisect.py``) mixes runs:
    " (one sequence)" or " (8K-token documents)"; "" for a single run."""
    doc = ((data.get("sources") or {}).get(mode) or {}).get("doc_tokens")
    if doc is None:
        return ""
    return " (one sequence)" if not doc else f" ({tokens_label(doc)}-token documents)"


def plot_longctx(data: dict, out: str) -> list[str]:
    plt = _plt()
    rows = data["rows"]
    model = (data.get("args") or {}).get("model", "")
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    color = colors_for(modes)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    peaks = [r["peak_allocated"] / 1e9 for r in rows if r.get("peak_allocated")]
    top = max(peaks) * 1.1 if peaks else 1.0
    for m in modes:
        ok = sorted((r["tokens"], r) for r in rows if r["mode"] == m and r["status"] == "ok" and not r.get("bisect"))
        ok_all = sorted((r["tokens"], r) for r in rows if r["mode"] == m and r["status"] == "ok")
        xs = [t for t, _ in ok_all]
        kw = dict(marker="o", label=name(m) + doc_note(data, m), color=color[m],
                  lw=2.2 if m in ("offload", "swiftune") else 1.4, ls="-" if len(ok_all) > 1 else "none")
        axes[0].plot(xs, [r.get("peak_allocated", 0) / 1e9 for _, r in ok_all], **kw)
        axes[1].plot([t for t, _ in ok], [r["step_s"] for _, r in ok], **kw)
        pred = [(t, r["pred_allocated"] / 1e9) for t, r in ok_all if r.get("pred_allocated")]
        if pred:
            axes[0].plot([t for t, _ in pred], [v for _, v in pred], ls=":", marker="x", color=color[m], alpha=0.6,
                         label=f"{name(m)} (planner)")
        ooms = [r["tokens"] for r in rows if r["mode"] == m and str(r["status"]).startswith("oom")]
        if ooms:
            axes[0].scatter(ooms, [top] * len(ooms), marker="X", s=80, color=color[m], zorder=5)
        fit = [r["tokens"] for r in rows if r["mode"] == m and r["status"] == "max_fit"]
        for t in fit:
            axes[0].axvline(t, color=color[m], ls="--", alpha=0.6)
            axes[0].annotate(f"max {t:,}", (t, top * 0.95), color=color[m], fontsize=8, rotation=90, va="top")
    axes[0].set_ylabel("peak GPU memory allocated (GB)")
    axes[1].set_ylabel("step time (s)")
    sizes = sorted({r["tokens"] for r in rows})
    if len(sizes) > 8 or any(b < 1.1 * a for a, b in zip(sizes, sizes[1:])):  # a search's trials crowd
        # each other's labels: powers of two instead
        sizes = [2**k for k in range(sizes[0].bit_length() - 1, sizes[-1].bit_length() + 1)]
    for ax in axes:
        ax.set_xlabel("tokens in the row")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([tokens_label(t) for t in sizes], fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(top=top * 1.05)
    if any(str(r["status"]).startswith("oom") for r in rows):
        axes[0].text(0.01, 0.98, "X: out of memory", transform=axes[0].transAxes, va="top", fontsize=8)
    fig.suptitle(f"Long-context training step, {model} shape, LoRA r=16 ({data.get('device', '')})")
    return [_save(fig, out)]


# ----------------------------------------------------------------------------------------- grpo


def plot_grpo_step(data: dict, out: str) -> list[str]:
    plt = _plt()
    if "phases" not in data:
        print(f"# {out}: the GRPO step failed ({data.get('error', '?')}); nothing to draw")
        return []
    phases = data["phases"]
    names = list(phases)
    secs = [phases[n]["s"] for n in names]
    peaks = [phases[n].get("peak_gb") for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    y = list(range(len(names)))
    axes[0].barh(y, secs, color=SWIFTUNE_COLOR)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(names)
    axes[0].invert_yaxis()
    for yi, s in zip(y, secs):
        axes[0].text(s, yi, f" {s:.{1 if s >= 10 else 2}f} s ({s / data['step_s']:.0%})", va="center", fontsize=8)
    axes[0].set_xlim(0, max(secs) * 1.3)
    axes[0].set_xlabel(f"seconds (step {data['step_s']:.1f} s)")
    axes[0].grid(axis="x", alpha=0.3)
    pk = [p or 0.0 for p in peaks]
    axes[1].barh(y, pk, color="#1f77b4")
    axes[1].set_yticks(y)
    axes[1].set_yticklabels(names)
    axes[1].invert_yaxis()
    for yi, p in zip(y, peaks):
        axes[1].text(p or 0.0, yi, f" {p:.1f}" if p else " -", va="center", fontsize=8)
    axes[1].set_xlim(0, max(pk + [1.0]) * 1.2)
    axes[1].set_xlabel(f"peak GPU memory (GB; weights {data.get('weights_gb', 0):.1f})")
    axes[1].grid(axis="x", alpha=0.3)
    fig.suptitle(f"One GRPO step, {data['model']} shape, LoRA r=16, G={data['generations']}, prompt "
                 f"{data['prompt_tokens']} + completions {data['max_completion_length']} ({data.get('device', '')})")
    return [_save(fig, out)]


def plot_rollout(data: dict, out: str) -> list[str]:
    """Tokens/s against G per model shape and new-token count: the engine vs transformers generate."""
    plt = _plt()
    runs = data.get("runs", [])
    if not runs:
        print(f"# {out}: no engine rows; nothing to draw")
        return []
    models = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in runs if r["model"] == model]
        for new in sorted({r["new_tokens"] for r in mine}):
            pts = sorted((r["rows"], r) for r in mine if r["new_tokens"] == new)
            g = [p[0] for p in pts]
            fused = {p[1]["fast"].get("fused_layers") for p in pts}
            how = {frozenset({True}): ", fused layers", frozenset({False}): ", layers' own forward"}.get(
                frozenset(fused), "")
            ax.plot(g, [p[1]["fast"]["tokens_per_s"] for p in pts], "o-", color=SWIFTUNE_COLOR if new == min(
                r["new_tokens"] for r in mine) else "#ff7f0e", label=f"swiftune engine, N={new}{how}")
            for gi, (_, r) in zip(g, pts):
                ax.annotate(f"{r['fast']['step_ms'] / r['hbm_floor_ms']:.1f}x floor", (gi, r["fast"]["tokens_per_s"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=7)
        ab = [r for r in data.get("fused_ab", []) if r["model"] == model and r["fused_layers"]]
        if ab:
            ax.plot([r["rows"] for r in ab], [r["fast"]["tokens_per_s"] for r in ab], "*", markersize=11,
                    color=SWIFTUNE_COLOR, label=f"swiftune engine, fused layers (A/B), N={ab[0]['new_tokens']}")
        for kind, style in (("generate_static", "s--"), ("generate_dynamic", "^:")):
            pts = sorted({r["rows"]: r[kind]["tokens_per_s"] for r in mine if kind in r}.items())
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color="#7f7f7f",
                        label=f"transformers generate, {kind.split('_')[1]} cache")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows decoded together (G)")
        ax.set_ylabel("sampled tokens / s")
        ax.set_title(f"{model} shape, bf16, prompt {data.get('prompt_tokens', 256)}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"Rollout generation ({data.get('device', '')}); 'x floor' = decode step / HBM read time")
    return [_save(fig, out)]


def plot_grpo_bisect(data: dict, out: str) -> list[str]:
    plt = _plt()
    modes = list(data["modes"])
    color = colors_for(modes)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    peaks = [t["peak_gb"] for m in modes for t in data["modes"][m]["trials"] if t.get("peak_gb")]
    top = max(peaks) * 1.08 if peaks else 1.0
    for m in modes:
        res = data["modes"][m]
        ok = sorted((t["completion"], t.get("peak_gb") or 0.0) for t in res["trials"] if t.get("status") == "ok")
        fit = ""
        if res.get("max_fit"):  # a search's largest fit, or the lengths tried when there was no search
            fit = {"fixed_only": f" (fits {res['max_fit']:,} / row; larger not tried)",
                   "out_of_time": f" (fits {res['max_fit']:,} / row; search ran out of time)"}.get(
                res.get("status"), f" (largest fit {res['max_fit']:,} / row)")
        ax.plot([c for c, _ in ok], [p for _, p in ok], marker="o", color=color[m], label=name(m) + fit,
                lw=2.2 if m == "swiftune" else 1.4)
        ooms = [t["completion"] for t in res["trials"] if str(t.get("status", "")).startswith("oom")]
        if ooms:
            ax.scatter(ooms, [top] * len(ooms), marker="X", s=70, color=color[m], zorder=5)
        if res.get("max_fit"):
            ax.axvline(res["max_fit"], color=color[m], ls="--", alpha=0.6)
    ax.set_xscale("log", base=2)
    sizes = sorted({t["completion"] for m in modes for t in data["modes"][m]["trials"]})
    if len(sizes) <= 8:
        ax.set_xticks(sizes)
        ax.set_xticklabels([tokens_label(t) for t in sizes], fontsize=8, rotation=45)
    ax.set_ylim(0, top * 1.05)
    ax.set_xlabel(f"completion tokens per row ({data['rows']} rows, prompt {data['prompt_tokens']})")
    ax.set_ylabel("peak GPU memory allocated (GB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.93))
    ax.text(0.01, 0.98, "X: out of memory; dashed: largest fitting length", transform=ax.transAxes, va="top",
            fontsize=8)
    ax.set_title(f"GRPO policy loss + backward, {data['model']} shape, LoRA r=16 ({data.get('device', '')})")
    return [_save(fig, out)]


def plot_loss_curve(data: dict, out: str) -> list[str]:
    from benchmarks.loss_curve import plot

    return [out] if plot(data, out) else []


PLOTTERS = {"sft": plot_sft, "longctx": plot_longctx, "grpo_step": plot_grpo_step, "grpo_bisect": plot_grpo_bisect,
            "loss_curve": plot_loss_curve, "rollout": plot_rollout}


def render(path: str, outdir: str) -> list[str]:
    """The figure(s) of one JSON file; [] when its shape is unknown."""
    with open(path) as f:
        data = json.load(f)
    kind = kind_of(data)
    if kind is None:
        print(f"# {path}: not a benchmark JSON this script knows; skipped")
        return []
    out = os.path.join(outdir, os.path.splitext(os.path.basename(path))[0] + ".png")
    return PLOTTERS[kind](data, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="JSON files written by the benchmark scripts")
    p.add_argument("--outdir", default="docs/plots")
    args = p.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    written = []
    for path in args.files:
        for png in render(path, args.outdir):
            print(f"{path} -> {png}")
            written.append(png)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
