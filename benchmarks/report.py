"""The tables of docs/benchmarks.md, rendered from the published rows (docs/results/results.jsonl).

Each table sits between ``<!-- table:FIGURE -->`` and ``<!-- /table:FIGURE -->`` in the page;
this script rewrites what lies between, and leaves the prose around them alone.

    python -m benchmarks.report            # rewrite the tables of docs/benchmarks.md
    python -m benchmarks.report --check    # exit 1 if the page's tables differ from the rows
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

from benchmarks.results import read_rows

MARK = "†"  # a swiftune figure measured before the q/k gradient fix
LABELS = {"hf_padded": "transformers + PEFT, padded", "trl_padding_free": "TRL, padding_free",
          "trl_liger": "TRL + Liger", "swiftune": "**swiftune**", "swiftune_budget": "swiftune, 16K-token budget",
          "swiftune_budget_offload": "swiftune, 16K-token budget, checkpoints on host",
          "swiftune_peft_lora": "swiftune, PEFT's LoRA forwards",
          "swiftune_offload": "swiftune, checkpoints on host",
          "swiftune_offload_untiled": "swiftune, checkpoints on host, MLP untiled",
          "swiftune_budget_offload_untiled": "swiftune, 16K-token budget, checkpoints on host, MLP untiled",
          "swiftune_budget_fit_untiled": "swiftune, 16K-token budget, checkpoints offloaded as needed, MLP untiled",
          "swiftune_graphs": "swiftune, graphed layers",
          "swiftune_host_graphs": "swiftune, graphed layers, inputs on the host",
          "swiftune_budget_graphs": "swiftune, 16K-token budget, graphed layers",
          "swiftune_budget_fit": "swiftune, 16K-token budget, checkpoints offloaded as needed", "unsloth": "Unsloth", "unsloth_packed": "Unsloth, packed",
          "hf_full_logits": "transformers + PEFT, full logits", "trl_grpo": "TRL GRPOTrainer loss path",
          "baseline": "transformers + PEFT", "ckpt": "swiftune, checkpoints on the GPU",
          "offload": "swiftune, offloaded checkpoints", "swiftune_offload_all": "swiftune, every layer input on the host"}
MODELS = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "gpt-oss-20b": "gpt-oss-20b", "mixtral-8x7b": "Mixtral-8x7B", "qwen3-8b": "Qwen3-8B", "qwen3-1.7b": "Qwen3-1.7B", "qwen3-0.6b": "Qwen3-0.6B", "llama3-8b": "Llama-3-8B"}
MODE_ORDER = ["hf_padded", "trl_padding_free", "trl_liger", "unsloth", "unsloth_packed", "swiftune_peft_lora", "swiftune",
              "swiftune_offload", "swiftune_offload_untiled", "swiftune_budget", "swiftune_budget_offload_untiled",
              "swiftune_budget_offload"]


class Figure:
    """The rows of one figure, indexed by (mode, model, settings without the figure) -> metric -> value."""

    def __init__(self, rows):
        self.rows = rows
        self.by = defaultdict(dict)
        self.status = {}
        for r in rows:
            # a trial's status sits on its "fits" row only: not part of the key
            s = {k: v for k, v in r.settings.items() if k not in ("figure", "before_qk_fix", "status")}
            key = (r.mode, r.model, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in s.items())))
            self.by[key][r.metric] = r
            if "status" in r.settings:
                self.status[key] = r.settings["status"]
        self.before = {(r.mode, r.model) for r in rows if r.settings.get("before_qk_fix")}

    def groups(self):
        for (mode, model, s), metrics in self.by.items():
            yield mode, model, dict(s), metrics

    def label(self, mode: str, model: str | None = None) -> str:
        text = LABELS.get(mode, mode)
        return text + (f" {MARK}" if (mode, model) in self.before or any(m == mode for m, _ in self.before)
                       and model is None else "")


def fmt(v, digits=2, thousands=False) -> str:
    if v is None:
        return ""
    if thousands:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def val(metrics: dict, metric: str):
    r = metrics.get(metric)
    return r.value if r is not None else None


def table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    out = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---:" if i in right else "---" for i in range(len(header))) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def marked(metrics: dict, text: str) -> str:
    """``text``, marked where the figure's rows were measured before the q/k gradient fix."""
    return text + (f" {MARK}" if any(r.settings.get("before_qk_fix") for r in metrics.values()) else "")


# ---------------------------------------------------------------------------------- renderers


def sft(fig: Figure) -> str:
    """One row per (batch, mode); ratios against the padded Trainer, TRL + Liger and, where the figure has
    Unsloth's rows, Unsloth (a 16K-token budget row against Unsloth's packed row, the rest against its
    padding-free one). Rows on an emulated smaller GPU say so in the batch column."""
    cells = {}
    for mode, model, s, m in fig.groups():
        order = MODE_ORDER.index(mode) if mode in MODE_ORDER else 99
        cells[(s["batch"], s.get("gpu_budget_gb", 0), order, mode, model)] = m
    by_batch = defaultdict(dict)
    for (batch, budget_gb, _, mode, _), m in cells.items():
        if not budget_gb:
            by_batch[batch][mode] = val(m, "tokens_per_s")
    with_unsloth = any(mode.startswith("unsloth") for _, _, _, mode, _ in cells)
    out = []
    for (batch, budget_gb, _, mode, model), m in sorted(cells.items()):
        tps = val(m, "tokens_per_s")
        ref = by_batch[batch]
        budget = mode.startswith("swiftune_budget")
        size = "(~16K tok)" if budget else str(batch)
        if budget_gb:
            size += f", {budget_gb:g} GB GPU"
        row = [marked(m, LABELS.get(mode, mode)), size, fmt(tps, thousands=True),
               fmt(tps / ref["hf_padded"]) if ref.get("hf_padded") else "",
               fmt(tps / ref["trl_liger"]) if ref.get("trl_liger") else ""]
        if with_unsloth:
            unsloth = ref.get("unsloth_packed" if budget else "unsloth")
            row.append(fmt(tps / unsloth) if unsloth and not mode.startswith("unsloth") else "")
        out.append(row + [fmt(val(m, "peak_gb"), 1), fmt(val(m, "step_s")),
                          f"{100 * val(m, 'padding_fraction'):.1f}%"])
    header = ["mode", "batch", "tok/s", "x padded", "x TRL + Liger"] + (["x Unsloth"] if with_unsloth else [])
    header += ["peak GB", "s / step", "padding"]
    return table(header, out, set(range(1, len(header))))


def sft_beside_trl(fig: Figure) -> str:
    """One row per (shape, LoRA targets, mode) at one batch size: tok/s as a multiple of TRL's padding-free trainer
    and of TRL + Liger on the same shape and targets (where Liger ran there), peak memory, step time. Rows whose
    adapters also sit on parameters (``lora_target_parameters``: MoE experts) are their own shape, and so are the
    rows of a later call of the same shape (setting ``call``), each compared with its own call's TRL rows."""
    cells = {((model, s.get("lora_target_parameters", ""), s.get("call", "")),
              MODE_ORDER.index(mode) if mode in MODE_ORDER else 99, mode): (s, m) for mode, model, s, m in fig.groups()}
    tps = {(key, mode): val(m, "tokens_per_s") for (key, _, mode), (_, m) in cells.items()}
    out = []
    for (key, _, mode), (s, m) in sorted(cells.items()):
        model, targets, call = key
        own = tps[(key, mode)]
        trl, liger = tps.get((key, "trl_padding_free")), tps.get((key, "trl_liger"))
        shape = (MODELS.get(model, model) + (f", LoRA also on {targets.replace(',', ', ')}" if targets else "")
                 + (f" ({call})" if call else ""))
        out.append([shape, marked(m, LABELS.get(mode, mode)), str(s["batch"]),
                    fmt(own, thousands=True), fmt(own / trl) if trl else "", fmt(own / liger) if liger else "",
                    fmt(val(m, "peak_gb"), 1), fmt(val(m, "step_s"))])
    return table(["shape", "mode", "batch", "tok/s", "x TRL", "x TRL + Liger", "peak GB", "s / step"], out,
                 set(range(2, 8)))


def sft_fp8(fig: Figure) -> str:
    """swiftune on FP8 base weights against its own bf16 base, same call: one row per (mode, weights)."""
    cells = {(mode, s["weights"]): m for mode, _, s, m in fig.groups()}
    out = []
    for mode in sorted({mode for mode, _ in cells}, key=lambda x: MODE_ORDER.index(x) if x in MODE_ORDER else 99):
        bf16 = cells.get((mode, "bf16"))
        for weights in ("bf16", "fp8"):
            m = cells.get((mode, weights))
            if m is None:
                continue
            size = "(~16K tok)" if mode.startswith("swiftune_budget") else "16"
            out.append([LABELS.get(mode, mode), size, weights, fmt(val(m, "tokens_per_s"), thousands=True),
                        fmt(val(m, "tokens_per_s") / val(bf16, "tokens_per_s")) if bf16 else "",
                        fmt(val(m, "peak_gb"), 1), fmt(val(m, "step_s"))])
    return table(["mode", "batch", "base weights", "tok/s", "x bf16", "peak GB", "s / step"], out, {1, 3, 4, 5, 6})


def sft_busy(fig: Figure) -> str:
    """The graphed step with the NaN/inf guards' per-step host waits and with them deferred, same call: from the
    long unprofiled run of each, tok/s of the steps that captured no graph and of every timed step; from a short
    run of each, one profiled step's device time, its busy share of that step's wall time, and the device's idle
    time inside its span (all of it, and the part that opened as the host returned from a wait). Where the
    profiled step's token slots were recorded, the batch has no padding and the step captured no graph: the
    device's busy share of the unprofiled steps, the profiled step's device ms per token times their tokens
    per second (the profiler's own host cost left out)."""
    timed, profiled = {}, {}
    for _, _, s, m in fig.groups():
        (profiled if "device_ms" in m else timed)[bool(s.get("deferred_nonfinite_check"))] = m
    out = []
    for deferred in (False, True):
        t, p = timed.get(deferred, {}), profiled.get(deferred, {})
        if not t and not p:
            continue
        wall = val(p, "profiled_step_wall_ms")
        busy = f"{val(p, 'device_ms') / wall:.0%}" if wall else ""
        slots, steady = val(p, "profiled_step_token_slots"), val(t, "steady_tokens_per_s")
        steady_busy = (f"{val(p, 'device_ms') / 1e3 / slots * steady:.0%}"
                       if slots and steady and val(t, "padding_fraction") == 0 and not val(p, "profiled_step_captures")
                       else "")
        out.append(["deferred (on the device)" if deferred else "every step (host waits)",
                    fmt(steady, thousands=True), fmt(val(t, "tokens_per_s"), thousands=True),
                    fmt(val(p, "device_ms"), 1), fmt(wall, 1), busy, steady_busy, fmt(val(p, "device_idle_ms"), 1),
                    fmt(val(p, "device_idle_after_sync_ms"), 1)])
    return table(["NaN/inf guards", "tok/s, steps without a capture", "tok/s, timed steps", "profiled step: device ms",
                  "its wall ms", "device busy", "device busy, steps without a capture", "idle in its span, ms",
                  "of which after a host wait"], out, set(range(1, 9)))


def timed_steps_label(s: dict, m: dict) -> str:
    """A row's timed steps, with how many of them captured graphs where the run counted that."""
    capturing = val(m, "steps_capturing")
    return f"{s.get('timed_steps', s.get('steps', ''))}" + (f" ({capturing:.0f} capturing)" if capturing is not None
                                                            else "")


def sft_graphs(fig: Figure) -> str:
    """Graphed layers against swiftune's eager step, same call: tok/s over every timed step, and over the
    timed steps that captured no graph (a long run's steps once its token buckets are captured). Where the
    call also measured TRL + Liger or Unsloth (padding-free), their rows follow and each swiftune row gets its
    ratio against them (the steady figure where there is one)."""
    eager, others = {}, {}
    for mode, _, s, m in fig.groups():
        if mode.startswith("swiftune") and not mode.endswith("_graphs"):
            eager[mode.startswith("swiftune_budget")] = val(m, "tokens_per_s")
        elif not mode.startswith("swiftune"):
            others[mode] = val(m, "tokens_per_s")
    side = [mode for mode in ("trl_liger", "unsloth") if mode in others]
    out = []
    for mode, model, s, m in sorted(fig.groups(), key=lambda g: (not g[0].startswith("swiftune"),
                                                                  g[0].startswith("swiftune_budget"), g[0])):
        ours = mode.startswith("swiftune")
        budget = mode.startswith("swiftune_budget")
        tps, steady = val(m, "tokens_per_s"), val(m, "steady_tokens_per_s")
        best = steady if steady is not None else tps
        ref = eager.get(budget)
        steps = timed_steps_label(s, m)
        row = [LABELS.get(mode, mode), "(~16K tok)" if budget else str(s["batch"]), fmt(tps, thousands=True),
               fmt(steady, thousands=True), fmt(best / ref) if ref and mode.endswith("_graphs") else ""]
        row += [fmt(best / others[o]) if ours and not budget and others[o] else "" for o in side]
        out.append(row + [fmt(val(m, "peak_gb"), 1), steps])
    header = ["mode", "batch", "tok/s, timed steps", "tok/s, steps without a capture", "x eager"]
    header += [{"trl_liger": "x TRL + Liger", "unsloth": "x Unsloth"}[o] for o in side] + ["peak GB", "timed steps"]
    return table(header, out, set(range(1, len(header))))


def sft_graphs_host(fig: Figure) -> str:
    """Graphed layers with their inputs in pinned host buffers against the graphed layers with them on the GPU,
    one call per number of timed steps (a row alone is a call of its own): tok/s over every timed step and over
    the steps that captured no graph, the steady figure and the peak over the graphed row's of the same call."""
    cells = {(s["timed_steps"], mode): (s, m) for mode, _, s, m in fig.groups()}
    out = []
    for (steps, mode), (s, m) in sorted(cells.items(), key=lambda c: (c[0][0], c[0][1] != "swiftune_graphs")):
        ref = cells.get((steps, "swiftune_graphs"), (None, None))[1] if mode != "swiftune_graphs" else None
        steady, peak = val(m, "steady_tokens_per_s"), val(m, "peak_gb")
        out.append([LABELS.get(mode, mode), timed_steps_label(s, m),
                    fmt(val(m, "graph_capacity_tokens"), thousands=True), fmt(val(m, "tokens_per_s"), thousands=True),
                    fmt(steady, thousands=True),
                    fmt(steady / val(ref, "steady_tokens_per_s")) if ref and steady else "", fmt(peak, 1),
                    fmt(peak / val(ref, "peak_gb")) if ref and peak else "", fmt(val(m, "host_input_gb"), 2)])
    header = ["mode", "timed steps", "token capacity", "tok/s, timed steps", "tok/s, steps without a capture",
              "x graphed speed", "peak GB", "x graphed memory", "layer inputs on the host GB"]
    return table(header, out, set(range(1, len(header))))


def sft_graphs_host_unsloth(fig: Figure) -> str:
    """The graphed row with its layer inputs on the host beside Unsloth, over calls on one warm machine (settings
    ``call`` and ``run_steps``, the steps each run took, warm-up included): every row's own figures, and each
    swiftune row's speed (the steady figure where there is one, then over every timed step) and peak against
    Unsloth's padding-free row of its own call, and against Unsloth's padding-free row of the most steps (its
    best speed and its highest peak)."""
    groups = sorted(fig.groups(), key=lambda g: (g[2].get("call", ""), g[0].startswith("swiftune"), g[0]))
    unsloth = [(s, m) for mode, _, s, m in groups if mode == "unsloth"]
    ref_s, ref = max(unsloth, key=lambda sm: sm[0].get("run_steps", 0)) if unsloth else ({}, None)
    same_call = {s.get("call", ""): m for s, m in unsloth}
    out = []
    for mode, _, s, m in groups:
        tps, steady, peak = val(m, "tokens_per_s"), val(m, "steady_tokens_per_s"), val(m, "peak_gb")
        best = steady if steady is not None else tps
        ours = mode.startswith("swiftune")
        own = same_call.get(s.get("call", "")) if ours else None
        out.append([s.get("call", ""), LABELS.get(mode, mode), str(s.get("run_steps", "")), timed_steps_label(s, m),
                    fmt(tps, thousands=True), fmt(steady, thousands=True), fmt(peak, 2),
                    fmt(best / val(own, "tokens_per_s")) if own else "",
                    fmt(peak / val(own, "peak_gb")) if own else "",
                    fmt(steady / val(ref, "tokens_per_s")) if ours and ref and steady else "",
                    fmt(tps / val(ref, "tokens_per_s")) if ours and ref else "",
                    fmt(peak / val(ref, "peak_gb")) if ours and ref else ""])
    against = f"Unsloth's {ref_s.get('run_steps', '')} steps"
    header = ["call", "mode", "steps run", "timed steps", "tok/s, timed steps", "tok/s, steps without a capture",
              "peak GB", "x Unsloth of the same call", "x its peak", f"x {against}, steady", f"x {against}, timed",
              f"x {against} peak"]
    return table(header, out, set(range(2, len(header))))


def sft_fp8_graphs(fig: Figure) -> str:
    """Graphed layers on FP8 base weights against FP8 eager and bf16 graphed, one call: tok/s over every timed
    step and over the timed steps that captured no graph; "x eager" is the graphed row's steady figure over the
    eager row of the same weights; "x bf16 graphed" and "x bf16 graphed memory" a graphed row's steady figure
    and its peak memory over the bf16 graphed row's."""
    cells = {(mode, s["weights"]): (s, m) for mode, _, s, m in fig.groups()}

    def best(m):
        steady = val(m, "steady_tokens_per_s")
        return steady if steady is not None else val(m, "tokens_per_s")

    eager = {w: best(m) for (mode, w), (_, m) in cells.items() if not mode.endswith("_graphs")}
    ref = cells.get(("swiftune_graphs", "bf16"), (None, None))[1]
    out = []
    for (mode, weights), (s, m) in sorted(cells.items(), key=lambda kv: (kv[0][0].endswith("_graphs"),
                                                                        kv[0][1] != "fp8", kv[0][0])):
        graphed = mode.endswith("_graphs")
        steps = timed_steps_label(s, m)
        out.append([LABELS.get(mode, mode), str(s["batch"]), weights, fmt(val(m, "tokens_per_s"), thousands=True),
                    fmt(val(m, "steady_tokens_per_s"), thousands=True),
                    fmt(best(m) / eager[weights]) if graphed and eager.get(weights) else "",
                    fmt(best(m) / best(ref)) if graphed and ref else "", fmt(val(m, "peak_gb"), 1),
                    fmt(val(m, "peak_gb") / val(ref, "peak_gb")) if graphed and ref else "", steps])
    return table(["mode", "batch", "base weights", "tok/s, timed steps", "tok/s, steps without a capture", "x eager",
                  "x bf16 graphed", "peak GB", "x bf16 graphed memory", "timed steps"], out, set(range(1, 10)) - {2})


def reward_curve(fig: Figure) -> str:
    """The built-in GRPO task's mean reward over the first and the last fifth of each run, per base-weight
    format, and each run's last fifth against the bf16 run's."""
    runs = {s["weights"]: (s, m) for _, _, s, m in fig.groups()}
    bf16 = val(runs["bf16"][1], "reward_last_fifth") if "bf16" in runs else None
    out = []
    for weights, (s, m) in sorted(runs.items(), key=lambda kv: kv[0] != "bf16"):
        first, last = val(m, "reward_first_fifth"), val(m, "reward_last_fifth")
        out.append([weights, str(s.get("steps", "")), fmt(first, 3), fmt(last, 3), f"{last - first:+.3f}",
                    f"{last - bf16:+.3f}" if bf16 is not None and weights != "bf16" else ""])
    return table(["base weights", "GRPO steps", "reward, first fifth", "reward, last fifth", "rise",
                  "last fifth - bf16's"], out, {1, 2, 3, 4, 5})


def kernels(fig: Figure) -> str:
    per = defaultdict(dict)
    for r in fig.rows:  # three tools per kernel: by tool, not by mode
        per[(r.mode, r.settings["shape"])][(r.tool, r.metric)] = r.value
    out = []
    for (kernel, shape), v in per.items():
        ours, eager, comp = v.get(("swiftune", "ms")), v.get(("torch", "ms")), v.get(("torch.compile", "ms"))
        big = v.get(("swiftune", "gb_moved"), 0) >= 0.01
        out.append([kernel, shape, fmt(v.get(("swiftune", "gb_moved"))), fmt(ours, 3), fmt(eager, 3), fmt(comp, 3),
                    fmt(eager / ours), fmt(comp / ours), fmt(v.get(("swiftune", "tb_per_s"))) if big else "-",
                    f"{100 * v[('swiftune', 'copy_fraction')]:.0f}%" if big else "-"])
    return table(["kernel", "shape", "GB moved", "swiftune ms", "eager ms", "compile ms", "x eager", "x compile",
                  "TB/s", "% of copy"], out, set(range(2, 10)))


def _largest(fig: Figure, fit: str, fail: str) -> dict:
    best = {}
    for mode, model, s, m in fig.groups():
        if fit in m:
            best[(model, mode)] = (s, val(m, fit), val(m, fail), m)
    return best


def longctx_largest(fig: Figure) -> str:
    best = _largest(fig, "max_fit_tokens", "first_fail_tokens")
    trl = {model: n for (model, mode), (_, n, _, _) in best.items() if mode == "trl_liger"}
    out = []
    singles = [(mode, model, s, m) for mode, model, s, m in fig.groups()
               if s.get("doc_tokens") == 0 and mode == "offload" and "step_s" in m]
    order = sorted({model for model, _ in best} | {model for _, model, _, _ in singles})
    for model in order:
        for mode in ("trl_liger", "offload"):
            if (model, mode) not in best:
                continue
            s, n, first, fit_rows = best[(model, mode)]
            at = next((m for md, mo, ss, m in fig.groups() if md == mode and mo == model
                       and ss.get("tokens") == n and "step_s" in m), {})
            fail = next((fig.status.get((md, mo, k)) for (md, mo, k) in fig.by if md == mode and mo == model
                         and dict(k).get("tokens") == first), None)
            doc = "one sequence" if not s.get("doc_tokens") else f"{s['doc_tokens'] // 1024}K-token documents"
            name = "TRL + Liger" if mode == "trl_liger" else "**swiftune**"
            out.append([MODELS.get(model, model), marked(fit_rows, f"{name}, {doc}"), f"{n:,}",
                        f"{first:,} ({'host' if fail == 'oom_host' else 'GPU'})" if first else "",
                        f"{100 * (first / n - 1):.1f}%" if first else "", fmt(val(at, "step_s")),
                        fmt(val(at, "peak_gb")), fmt(val(at, "host_pinned_gb") or 0),
                        fmt(n / trl[model]) if model in trl else ""])
        for mode, mo, s, m in singles:
            if mo == model:
                n = s["tokens"]
                out.append([MODELS.get(model, model), marked(m, "swiftune, one sequence"),
                            f">= {n:,} (one trial)", "", "", fmt(val(m, "step_s")), fmt(val(m, "peak_gb")),
                            fmt(val(m, "host_pinned_gb") or 0), f">= {n / trl[model]:.2f}" if model in trl else ""])
    return table(["shape", "tool, rows", "largest that fits", "first that fails", "bracket", "s / step",
                  "GPU GB (allocated)", "pinned host GB", "x TRL + Liger"], out, set(range(2, 9)))


def longctx_sweep(fig: Figure) -> str:
    out = []
    trials = [g for g in fig.groups() if "tokens" in g[2]]
    for mode, model, s, m in sorted(trials, key=lambda g: (["baseline", "ckpt", "offload"].index(g[0]),
                                                                 g[2].get("doc_tokens") == 0, g[2]["tokens"])):
        if "fits" not in m and "step_s" not in m:
            continue
        rows = f"{s['tokens']:,}" + (", one sequence" if s.get("doc_tokens") == 0 else "")
        if "step_s" not in m:
            out.append([marked(m, LABELS.get(mode, mode)), rows, "out of memory", "", "", "", "", ""])
            continue
        pk, plan = val(m, "peak_gb"), val(m, "planned_gb")
        kept = val(m, "layers_on_gpu")
        out.append([marked(m, LABELS.get(mode, mode)), rows, fmt(val(m, "step_s")), fmt(pk),
                    fmt(plan), fmt(pk / plan) if plan else "", "all" if kept is None else str(int(kept)),
                    fmt(val(m, "host_pinned_gb") or 0)])
    return table(["mode", "tokens", "s / step", "peak allocated GB", "planner GB", "measured / planner",
                  "layers on GPU", "pinned host GB"], out, set(range(1, 8)))


def grpo_65k(fig: Figure) -> str:
    at = {mode: m for mode, model, s, m in fig.groups() if s.get("completion") == 65536 and "step_s" in m}
    trl = at.get("trl_grpo")
    out = []
    for mode, m in at.items():
        out.append([marked(m, LABELS.get(mode, mode)), fmt(val(m, "step_s")),
                    fmt(val(m, "first_step_s")), fmt(val(m, "peak_gb"), 1), fmt(val(m, "host_rss_gb"), 1),
                    fmt(val(m, "step_s") / val(trl, "step_s")) if trl else "",
                    fmt(val(m, "peak_gb") / val(trl, "peak_gb")) if trl else ""])
    return table(["mode", "s / step (2nd)", "first step s", "peak GPU GB", "host RSS GB", "x TRL time",
                  "x TRL memory"], out, set(range(1, 7)))


def grpo_65k_attn(fig: Figure) -> str:
    """swiftune's 2 x 65,536 step by how many layers keep their attention outputs through the recompute."""
    at = sorted(((s.get("attention_output_layers") or 0, m) for mode, model, s, m in fig.groups()
                 if s.get("completion") == 65536 and "step_s" in m), key=lambda r: r[0])
    none = next((m for layers, m in at if layers == 0), None)
    out = [[str(layers), fmt(val(m, "step_s")), fmt(val(m, "first_step_s")), fmt(val(m, "peak_gb"), 1),
            fmt(val(m, "host_rss_gb"), 1), fmt(val(none, "step_s") / val(m, "step_s")) if none else ""]
           for layers, m in at]
    return table(["layers keeping their outputs", "s / step (2nd)", "first step s", "peak GPU GB", "host RSS GB",
                  "speed x 0 layers"], out, set(range(0, 6)))


def grpo_65k_beside_unsloth(fig: Figure) -> str:
    """The 2 x 65,536 step beside Unsloth's anchor step measured in the same call: swiftune by where its layers'
    kept attention outputs live (pinned host memory or the GPU), a trial that ran out of memory as such."""
    trials = [(mode, s, m) for mode, model, s, m in fig.groups() if s.get("completion") == 65536 and "fits" in m]
    unsloth = next((m for mode, s, m in trials if mode == "unsloth" and "step_s" in m), None)

    def label(mode: str, s: dict) -> str:
        if mode == "unsloth":
            return "Unsloth GRPOTrainer policy step (its patched TRL)"
        if mode != "swiftune":
            return LABELS.get(mode, mode)
        layers = s.get("attention_output_layers") or 0
        where = "in pinned host memory" if s.get("attention_outputs_on_host") else "on the GPU"
        return f"**swiftune**, {layers} layers' attention outputs kept {where}" if layers else "**swiftune**"

    out = []
    for mode, s, m in sorted(trials, key=lambda t: (t[0] != "unsloth", not t[1].get("attention_outputs_on_host"))):
        if "step_s" not in m:
            out.append([marked(m, label(mode, s)), "out of memory", "", "", "", "", ""])
            continue
        ratio = unsloth is not None and mode != "unsloth"
        out.append([marked(m, label(mode, s)), fmt(val(m, "step_s")), fmt(val(m, "first_step_s")),
                    fmt(val(m, "peak_gb"), 1), fmt(val(m, "host_rss_gb"), 1),
                    fmt(val(unsloth, "step_s") / val(m, "step_s")) if ratio else "",
                    fmt(val(m, "peak_gb") / val(unsloth, "peak_gb")) if ratio else ""])
    return table(["mode", "s / step (2nd)", "first step s", "peak GPU GB", "host RSS GB", "speed x Unsloth",
                  "GPU memory x Unsloth"], out, set(range(1, 7)))


def grpo_largest(fig: Figure) -> str:
    best = _largest(fig, "max_fit_completion", "first_fail_completion")
    out = []
    for (model, mode), (s, n, first, fit_rows) in best.items():
        search = s.get("search")
        fits = (">= " if search == "out_of_time" and not first else "") + f"{n:,}"
        fits += " (search out of time)" if search == "out_of_time" and not first else ""
        tokens = next((dict(k)["tokens"] for (md, mo, k) in fig.by if md == mode and mo == model
                       and dict(k).get("completion") == n and dict(k).get("tokens")), None)
        out.append([marked(fit_rows, LABELS.get(mode, mode)), fits, f"{first:,}" if first else "",
                    f"{tokens:,}" if tokens else ""])
    return table(["mode", "largest completion / row that fitted", "first that failed", "tokens / step"], out,
                 {1, 2, 3})


def grpo_largest_beside(fig: Figure) -> str:
    """The largest completion per row of each tool on one budget, the bracket to its first failure, the step at
    the fit, and each fit as a multiple of the baseline's (the row that is not swiftune's).

    A baseline with no failure (every length tried fitted) has only a lower bound, so a multiple of it is only an
    upper bound: a tool's row then reads "< F/B", its first failure F over the baseline's fit B (its own largest
    is below F, the baseline's at least B), or nothing where the tool has no failure either."""
    best = _largest(fig, "max_fit_completion", "first_fail_completion")
    steps = {(mode, s["completion"]): (s.get("tokens"), m) for mode, _, s, m in fig.groups() if "step_s" in m}
    base_mode, base, base_first = next(((mode, n, first) for (_, mode), (_, n, first, _) in best.items()
                                        if not mode.startswith("swiftune")), (None, None, None))

    def multiple(mode: str, n: int, first: int | None) -> str:
        if not base:
            return ""
        if base_first or mode == base_mode:
            return fmt(n / base)
        return f"< {fmt(first / base)}" if first else ""

    out = []
    for (model, mode), (s, n, first, fit_rows) in sorted(best.items(), key=lambda kv: kv[1][1]):
        tokens, m = steps.get((mode, n), (None, {}))
        rows = "one prompt shared by the rows" if s.get("share_prompt") else "each row after its own prompt"
        out.append([MODELS.get(model, model), marked(fit_rows, LABELS.get(mode, mode)), rows, f"{n:,}",
                    f"{first:,}" if first else ("none tried failed" if mode == base_mode else ""),
                    f"{100 * (first / n - 1):.1f}%" if first else "",
                    f"{tokens:,}" if tokens else "", fmt(val(m, "step_s")), fmt(val(m, "peak_gb"), 1),
                    fmt(val(m, "host_rss_gb"), 1) if val(m, "host_rss_gb") else "",
                    multiple(mode, n, first)])
    return table(["shape", "tool", "rows", "largest completion / row that fitted", "first that failed", "bracket",
                  "tokens / step", "s / step there", "peak GPU GB", "host RSS GB",
                  f"x {LABELS.get(base_mode, base_mode)}" if base_mode else "x baseline"], out,
                 set(range(3, 11)))


def grpo_step(fig: Figure) -> str:
    phases, total = [], None
    for mode, model, s, m in fig.groups():
        if "phase" in s and "phase_s" in m:
            phases.append((s["phase"], val(m, "phase_s"), val(m, "peak_gb")))
        elif "phase" not in s:
            total = (val(m, "step_s"), val(m, "peak_gb"), model)
    step = total[0]
    out = [[p, fmt(t), f"{100 * t / step:.1f}%", fmt(pk, 1) if pk else "-"] for p, t, pk in phases]
    out.append(["**step**", f"**{fmt(step)}**", "100%", f"**{fmt(total[1], 1)}**"])
    return table(["phase", "s", "share", "peak GB"], out, {1, 2, 3})


def grpo_e2e(fig: Figure) -> str:
    """One whole GRPOTrainer step per tool, split into its phases, and swiftune's speed-up over each."""
    tools = {}
    for mode, model, s, m in fig.groups():
        entry = tools.setdefault(mode, {"phases": {}})
        if "phase" in s:
            entry["phases"][s["phase"]] = val(m, "phase_s")
        else:
            entry["step"], entry["peak"], entry["kv"] = val(m, "step_s"), val(m, "peak_gb"), val(m, "kv_cache_gb")
    ours = tools.get("swiftune", {}).get("step")
    with_kv = any(t.get("kv") is not None for t in tools.values())  # swiftune's engine reports its KV cache
    names = {"swiftune": "**swiftune** GRPOTrainer (its rollout engine)",
             "trl": "TRL 1.16 GRPOTrainer (transformers generate)",
             "unsloth": "Unsloth GRPOTrainer (no vLLM)"}
    out = []
    for mode in ("swiftune", "trl", "unsloth"):
        t = tools.get(mode)
        if t is None or t.get("step") is None:
            continue
        ph = t["phases"]
        kv = [fmt(t["kv"], 1) if t.get("kv") is not None else ""] if with_kv else []
        out.append([names[mode], fmt(t["step"]), *(fmt(ph.get(p)) for p in ("generation", "scoring", "policy", "other")),
                    fmt(t["peak"], 1), *kv, fmt(t["step"] / ours) if ours and mode != "swiftune" else ""])
    header = ["tool", "s / step (2nd)", "generation s", "scoring s", "policy s", "other s", "peak GB",
              *(["of which KV cache GB"] if with_kv else []), "swiftune x faster"]
    return table(header, out, set(range(1, len(header))))


def loss_curve(fig: Figure) -> str:
    out = []
    for mode, model, s, m in fig.groups():
        for metric, r in m.items():
            against = s.get("against")
            vs = "" if not against else " vs padded" if against == "hf_padded" else f" vs {against}"
            out.append([LABELS.get(mode, mode) + vs, metric, f"{r.value:.6g}"])
    return table(["mode", "metric", "value"], out, {2})


def rollout(fig: Figure) -> str:
    gen = {}
    for mode, model, s, m in fig.groups():
        if mode.startswith("generate_"):
            # keyed by the run too (its "experts" / "nf4_matmul" label): a ratio takes the baseline of its own call only
            key = (model, s["rows"], s["new_tokens"], s.get("experts"), s.get("nf4_matmul"), mode)
            gen[key] = val(m, "tokens_per_s")
    out = []
    for mode, model, s, m in fig.groups():
        if mode != "fast_engine" or "hbm_floor_ms" not in m:
            continue
        key = (model, s["rows"], s["new_tokens"], s.get("experts"), s.get("nf4_matmul"))
        tps, ms, floor = val(m, "tokens_per_s"), val(m, "step_ms"), val(m, "hbm_floor_ms")
        st, dy = gen.get((*key, "generate_static")), gen.get((*key, "generate_dynamic"))
        out.append([MODELS.get(model, model), str(s["rows"]), f"{s['new_tokens']:,}",
                    ("fused layers" if s.get("fused_layers") else "layers' own forward")
                    + (f", experts: {s['experts']}" if s.get("experts") else "")
                    + (f", decode attention: {s['decode_attention']}" if s.get("decode_attention") else "")
                    + (f", NF4 matmul: {s['nf4_matmul']}" if s.get("nf4_matmul") else ""), fmt(tps, thousands=True),
                    fmt(ms), fmt(floor), fmt(ms / floor), fmt(st, thousands=True) if st else "-",
                    fmt(tps / st) if st else "-", fmt(dy, thousands=True) if dy else "-",
                    fmt(tps / dy, 1) if dy else "-"])
    for mode, model, s, m in fig.groups():
        if s.get("ab") and s.get("fused_layers"):
            out.insert(0, [MODELS.get(model, model), str(s["rows"]), f"{s['new_tokens']:,}", "fused layers (A/B)",
                           fmt(val(m, "tokens_per_s"), thousands=True), fmt(val(m, "step_ms")), "", "", "", "", "", ""])
    return table(["shape", "G", "N", "engine", "engine tok/s", "step ms", "HBM floor ms", "x floor",
                  "generate static tok/s", "x static", "generate dynamic tok/s", "x dynamic"], out, set(range(1, 12)) - {3})


# the settings that tell one FP8 run of a call from another (a bf16 run has none of them)
FP8_VARIANT_SETTINGS = ("qkv", "gate_up", "codes", "split_k_reduce")


def rollout_fp8(fig: Figure) -> str:
    """FP8 (e4m3 weights, per-row scales) against bf16 weights, same engine, shape, G and N; "x bf16" pairs the
    rows of one call only (a ``call`` setting names later calls; ``qkv`` / ``gate_up``: q/k/v, gate/up as one FP8
    product or one each; ``codes``: what makes their input's FP8 codes; ``split_k_reduce``: where a split K's
    partial sums are added)."""
    runs = {}
    for mode, model, s, m in fig.groups():
        # the row's own LoRA mode (a bf16 call times the adapters at run time and merged; FP8 bases only at run time)
        lora = (f"LoRA r=16 {'merged' if s.get('lora') == 'merge' else 'at runtime'}"
                + (f", its product from {s['lora_product']}" if s.get("lora_product") else "")
                if mode == "fast_engine_lora" else "")
        key = (model, s["rows"], s["new_tokens"], lora, s.get("call", ""))
        weights = s.get("weights", "bf16") + (", KV cache fp8" if s.get("kv_cache") == "fp8" else "")
        runs[(key, weights, tuple(s.get(name, "") for name in FP8_VARIANT_SETTINGS))] = m
    out = []
    for (key, weights, variant), m in runs.items():
        model, rows, new_tokens, lora, call = key
        qkv, gate_up, codes, reduce = variant
        bf16 = runs.get((key, "bf16", ("",) * len(FP8_VARIANT_SETTINGS)))
        tps, ms, floor = val(m, "tokens_per_s"), val(m, "step_ms"), val(m, "hbm_floor_ms")
        base = val(bf16, "tokens_per_s") if bf16 and weights != "bf16" else None
        label = ", ".join(x for x in (weights, f"q/k/v: {qkv}" if qkv else "", f"gate/up: {gate_up}" if gate_up
                                      else "", f"their input codes: {codes}" if codes else "",
                                      f"split K added {reduce}" if reduce else "", lora) if x)
        label += f" ({call})" if call else ""
        out.append([MODELS.get(model, model), str(rows), f"{new_tokens:,}", label, fmt(tps, thousands=True), fmt(ms),
                    fmt(floor) if floor else "", fmt(ms / floor) if floor else "", fmt(tps / base) if base else ""])
    return table(["shape", "G", "N", "weights", "engine tok/s", "step ms", "HBM floor ms", "x floor", "x bf16"], out,
                 set(range(1, 9)) - {3})


def vl_sft(fig: Figure) -> str:
    """Image-text SFT: swiftune against TRL's VLM SFTTrainer (the ``trl`` mode), same rows, one call."""
    runs = {mode: m for mode, model, s, m in fig.groups() if not s.get("excl_collate")}
    excl = {mode: val(m, "tokens_per_s") for mode, model, s, m in fig.groups() if s.get("excl_collate")}
    trl = runs.get("trl")
    out = []
    for mode, m in sorted(runs.items(), key=lambda kv: kv[0] != "trl"):
        tps, gb = val(m, "tokens_per_s"), val(m, "peak_gb")
        out.append([LABELS.get(mode, mode) if mode != "trl" else "TRL 1.16 SFTTrainer (VLM collator)",
                    fmt(tps, thousands=True), fmt(tps / val(trl, "tokens_per_s")) if trl else "",
                    fmt(excl[mode], thousands=True) if excl.get(mode) else "", fmt(gb, 1),
                    fmt(gb / val(trl, "peak_gb")) if trl else "", fmt(val(m, "step_s")),
                    f"{100 * val(m, 'padding_fraction'):.1f}%"])
    return table(["mode", "tok/s", "x TRL", "tok/s without the collator", "peak GB", "x TRL memory", "s / step",
                  "padding"], out, set(range(1, 8)))


def grpo_budget_largest(fig: Figure, key: str = "allocator", header: str = "CUDA allocator") -> str:
    """The largest completion per row on an emulated GPU budget, one row per value of the setting ``key``
    (the CUDA allocator, the base weights' format: each a search of its own), with the step at the largest
    fitting length."""
    best, steps = {}, {}
    for mode, model, s, m in fig.groups():
        if "max_fit_completion" in m:
            best[s.get(key, "")] = (val(m, "max_fit_completion"), val(m, "first_fail_completion"))
        elif "step_s" in m:
            steps[(s.get(key, ""), s["completion"])] = (s.get("tokens"), m)
    out = []
    for label, (fit, fail) in best.items():
        tokens, m = steps.get((label, fit), (None, {}))
        out.append([label, f"{fit:,}", f"{fail:,}" if fail else "", f"{tokens:,}" if tokens else "",
                    fmt(val(m, "step_s")) if m else "", fmt(val(m, "peak_gb"), 1) if m else "",
                    fmt(val(m, "host_rss_gb"), 1) if m else ""])
    return table([header, "largest completion / row that fitted", "first that failed", "tokens / step",
                  "s / step there", "peak GPU GB", "host RSS GB"], out, set(range(1, 7)))


def attention(fig: Figure) -> str:
    out, ref = [], {}
    groups = list(fig.groups())
    for mode, model, s, m in groups:
        if s["backend"] == "varlen":
            ref[(s["docs"], s["doc_tokens"])] = val(m, "ms")
    for mode, model, s, m in groups:
        v = ref.get((s["docs"], s["doc_tokens"]))
        out.append([s["backend"], f"{s['docs']} x {s['doc_tokens']:,}", fmt(val(m, "ms"), 1),
                    fmt(v / val(m, "ms")) if v else "", fmt(val(m, "tflop_per_s"), 0),
                    fmt(val(m, "saved_bytes_per_token"), 0), fmt(val(m, "backward_bytes_per_token"), 0)])
    return table(["backend", "docs x tokens", "ms", "x varlen", "TFLOP/s", "saved B / token", "bwd B / token"], out,
                 set(range(1, 7)))


RENDER = {"kernels": kernels, "sft_qwen3-8b_b16": sft, "sft_graphs_qwen3-8b": sft_graphs, "sft_graphs_side_by_side_qwen3-8b": sft_graphs,
          "sft_graphs_shared_buffers_qwen3-8b": sft_graphs, "sft_graphs_memory_qwen3-8b": sft_graphs,
          "sft_graphs_host_qwen3-8b": sft_graphs_host, "sft_graphs_host_unsloth_qwen3-8b": sft_graphs_host_unsloth,
          "sft_16k_fit_qwen3-8b": sft, "sft_16k_fit_second_call_qwen3-8b": sft, "sft_sweep_qwen3-8b": sft, "sft_sweep_llama3-8b": sft,
          "sft_sweep_qwen3-1.7b": sft, "qlora_sft_qwen3-8b": sft, "qlora_sft_offload_qwen3-8b": sft,
          "qlora_sft_untiled_qwen3-8b": sft, "qlora_sft_16k_untiled_qwen3-8b": sft,
          "qlora_sft_16k_unsloth_qwen3-8b": sft, "sft_sweep_qwen3-0.6b": sft,
          "sft_full_qwen3-0.6b": sft, "sft_moe_b16": sft_beside_trl, "grpo_gptoss_80gb": grpo_largest_beside,
          "loss_curve": loss_curve, "grpo_65k": grpo_65k, "grpo_65k_attn": grpo_65k_attn,
          "grpo_65k_beside_unsloth": grpo_65k_beside_unsloth, "grpo_largest": grpo_largest,
          "grpo_step": grpo_step, "grpo_e2e_qwen3-1.7b": grpo_e2e,
          "longctx_sweep_qwen3-8b": longctx_sweep, "longctx_largest": longctx_largest, "rollout": rollout,
          "rollout_moe": rollout, "rollout_decode_attention": rollout, "rollout_fp8": rollout_fp8,
          "attention_backends": attention,
          "rollout_nf4": rollout, "vl_sft_qwen3-vl-8b": vl_sft, "vl_grpo_qwen3-vl-8b_24gb": grpo_budget_largest,
          "fp8_sft_qwen3-8b": sft_fp8, "fp8_sft_16k_shared_qwen3-8b": sft_fp8, "fp8_sft_16k_h100_qwen3-8b": sft_fp8, "loss_curve_fp8": loss_curve,
          "sft_deferred_check_qwen3-8b": sft_busy, "qlora_grpo_80gb_qwen3-8b": grpo_largest_beside,
          "fp8_graphs_qwen3-8b": sft_fp8_graphs, "reward_curve_fp8": reward_curve,
          "grpo_fp8_24gb_qwen3-8b": lambda fig: grpo_budget_largest(fig, "weights", "base weights")}


def commands(rows) -> str:
    seen = list(dict.fromkeys(r.command for r in rows))
    dates = sorted({r.date for r in rows})
    named = {r.gpu for r in rows}
    # a figure joined from two cards names the one in full ("H100 ... and, for X, H200"): its plain name goes
    gpus = sorted(g for g in named if not any(other != g and other.startswith(g) for other in named))
    versions = sorted({", ".join(f"{k} {v}" for k, v in r.versions.items()) for r in rows}, key=len)[-1]
    head = f"Measured {' and '.join(dates)} on {', '.join(gpus)} ({versions})."
    return head + "\n\n```bash\n" + "\n".join(seen) + "\n```"


def render_tables(rows) -> dict[str, str]:
    """figure -> the Markdown between its markers: the table, the marks' note, the commands."""
    by = defaultdict(list)
    for r in rows:
        by[r.settings.get("figure")].append(r)
    out = {}
    for name, fig_rows in by.items():
        fig = Figure(fig_rows)
        text = RENDER[name](fig)
        if fig.before:
            text += (f"\n\n{MARK} measured before the q/k gradient fix and not measured again: an upper bound on "
                     "speed (see CHANGELOG.md).")
        out[name] = text + "\n\n" + commands(fig_rows)
    return out


BLOCK = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(\n<!-- /table:(?P=name) -->)", re.S)


def rewrite(page: str, tables: dict[str, str]) -> str:
    missing = set(tables) - set(m.group("name") for m in BLOCK.finditer(page))
    if missing:
        raise ValueError(f"no markers in the page for {sorted(missing)}")
    return BLOCK.sub(lambda m: m.group(1) + tables[m.group("name")] + m.group(4), page)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="docs/results/results.jsonl")
    p.add_argument("--page", default="docs/benchmarks.md")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when the page is out of date")
    args = p.parse_args(argv)
    with open(args.page) as f:
        page = f.read()
    new = rewrite(page, render_tables(read_rows(args.rows)))
    if args.check:
        if new != page:
            print(f"{args.page}: tables differ from {args.rows}: run python -m benchmarks.report", file=sys.stderr)
            return 1
        print(f"{args.page}: tables match {args.rows}")
        return 0
    with open(args.page, "w") as f:
        f.write(new)
    print(f"{args.page}: tables rewritten from {args.rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
