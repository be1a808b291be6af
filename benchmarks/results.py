"""One schema for every benchmark figure: a row per measured value, JSON Lines.

A row says who was measured (``tool``, ``mode``, ``model``), under which settings (a dict: batch,
tokens, document length...), what (``metric``, ``value``, ``unit``), where (``gpu``, ``versions`` of
the libraries the tool used), when (``date``) and how (``command``: the argv that produced it, as
``python -m benchmarks.NAME ...``). Every script writes its figures as rows next to its JSON
(``--rows``, default ``<out>.rows.jsonl``); ``docs/results/results.jsonl`` holds the published ones,
from which ``python -m benchmarks.report`` regenerates the tables of ``docs/benchmarks.md``.

The same ``rows_from_*`` converters turn a script's JSON into rows at the end of its run and turn
the raw JSON committed under ``docs/results/`` into the published rows (``python -m
benchmarks.results import``, with the figure list in ``benchmarks/published.py``).

    python -m benchmarks.results validate docs/results/results.jsonl
    python -m benchmarks.results import --out docs/results/results.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import sys
from collections.abc import Iterable

# metric -> unit: a row's unit must be its metric's
UNITS: dict[str, str] = {
    "tokens_per_s": "tok/s", "peak_gb": "GB", "reserved_gb": "GB", "host_rss_gb": "GB", "host_pinned_gb": "GB",
    "planned_gb": "GB", "kv_cache_gb": "GB", "device_idle_ms": "ms", "device_idle_after_sync_ms": "ms",
    "step_s": "s", "first_step_s": "s", "step_s_excl_pin": "s", "phase_s": "s",
    "padding_fraction": "fraction", "fits": "bool", "max_fit_tokens": "tokens", "first_fail_tokens": "tokens",
    "planner_max_tokens": "tokens", "max_fit_completion": "tokens", "first_fail_completion": "tokens",
    "planner_max_completion": "tokens", "layers_on_gpu": "layers", "ms": "ms", "step_ms": "ms",
    "hbm_floor_ms": "ms", "tb_per_s": "TB/s", "copy_fraction": "fraction", "gb_moved": "GB", "tflop_per_s": "TFLOP/s",
    "saved_bytes_per_token": "B/token", "backward_bytes_per_token": "B/token", "extra_gb": "GB",
    "max_abs_diff": "loss", "mean_abs_diff": "loss", "max_rel_diff": "fraction", "final_loss": "loss",
    "train_s": "s", "device_ms": "ms", "host_ms": "ms", "host_ms_per_step": "ms", "steady_tokens_per_s": "tok/s",
    "steps_capturing": "steps", "window_captures": "graphs",
    "reward_first_fifth": "reward", "reward_last_fifth": "reward",
    "profiled_step_wall_ms": "ms", "profiled_step_token_slots": "tokens",
    "profiled_step_captures": "steps", "graph_capacity_tokens": "tokens", "host_input_gb": "GB",
}
# the libraries a row may name; torch always, the rest where the tool used them
VERSION_KEYS = ("torch", "transformers", "triton", "peft", "trl", "liger", "unsloth")
_DISTRIBUTIONS = {"liger": "liger-kernel"}
TOOLS = ("swiftune", "transformers+peft", "transformers", "trl", "trl+liger", "unsloth", "torch", "torch.compile")


@dataclasses.dataclass
class Row:
    tool: str
    mode: str
    model: str
    settings: dict
    metric: str
    value: float
    unit: str
    gpu: str
    versions: dict
    date: str
    command: str

    def key(self) -> tuple:
        return (self.tool, self.mode, self.model, json.dumps(self.settings, sort_keys=True), self.metric)


def validate(row: Row) -> None:
    """Raise ``ValueError`` naming the first field of ``row`` that breaks the schema."""
    for name in ("tool", "mode", "model", "gpu", "date", "command", "metric", "unit"):
        if not isinstance(getattr(row, name), str) or not getattr(row, name):
            raise ValueError(f"{name} must be a non-empty string: {row!r}")
    if row.tool not in TOOLS:
        raise ValueError(f"tool {row.tool!r} is none of {TOOLS}")
    if UNITS.get(row.metric) != row.unit:
        raise ValueError(f"metric {row.metric!r} has unit {UNITS.get(row.metric)!r}, not {row.unit!r}")
    if isinstance(row.value, bool) or not isinstance(row.value, (int, float)) or row.value != row.value:
        raise ValueError(f"value must be a number (not NaN): {row!r}")
    if not isinstance(row.settings, dict) or not isinstance(row.versions, dict):
        raise ValueError(f"settings and versions must be dicts: {row!r}")
    if "torch" not in row.versions or set(row.versions) - set(VERSION_KEYS):
        raise ValueError(f"versions must name torch and only {VERSION_KEYS}: {row.versions}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", row.date):
        raise ValueError(f"date must be YYYY-MM-DD: {row.date!r}")
    # (an environment the run was given, e.g. PYTORCH_CUDA_ALLOC_CONF=..., is part of its command)
    if not re.match(r"(?:[A-Z][A-Z0-9_]*=\S+ )*(?:python -m benchmarks\.|scripts/)", row.command):
        raise ValueError(f"command must be how the figure is made (python -m benchmarks.NAME ...): {row.command!r}")


def write_rows(path: str, rows: Iterable[Row]) -> int:
    """Validate ``rows`` and write them to ``path``, one JSON object a line; returns how many."""
    rows = list(rows)
    for r in rows:
        validate(r)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(dataclasses.asdict(r), sort_keys=False) + "\n")
    return len(rows)


def read_rows(path: str) -> list[Row]:
    """The rows of a JSON Lines file, each validated."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            fields = {f.name for f in dataclasses.fields(Row)}
            if set(d) != fields:
                raise ValueError(f"{path}:{n}: fields {sorted(d)} are not {sorted(fields)}")
            row = Row(**d)
            validate(row)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------- the run's context


@dataclasses.dataclass
class Context:
    """What every row of one run shares: its command, date, GPU, the versions installed, and the
    settings that hold for every row (a script's arguments, a figure's name)."""
    command: str
    date: str
    gpu: str
    versions: dict
    settings: dict = dataclasses.field(default_factory=dict)

    def row(self, tool: str, mode: str, model: str, settings: dict, metric: str, value) -> Row:
        return Row(tool=tool, mode=mode, model=model, settings={**self.settings, **settings}, metric=metric,
                   value=value, unit=UNITS[metric], gpu=self.gpu, versions=versions_for(tool, self.versions),
                   date=self.date, command=self.command)


def command_line(module: str, argv: list[str] | None) -> str:
    """``python -m benchmarks.<module> ARGS``: the recorded command (argv defaults to this process's)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", "-m", f"benchmarks.{module}", *args])


def installed_versions() -> dict:
    """The versions of the libraries of ``VERSION_KEYS`` installed here (absent ones left out)."""
    from importlib import metadata

    out = {}
    for key in VERSION_KEYS:
        try:
            out[key] = metadata.version(_DISTRIBUTIONS.get(key, key))
        except metadata.PackageNotFoundError:
            pass
    try:  # torch's own string carries the CUDA build (2.11.0+cu130)
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out


def versions_for(tool: str, versions: dict) -> dict:
    """The versions a row of ``tool`` depends on: trl, liger and unsloth only where the tool used them."""
    used = {"trl": "trl" in tool, "liger": "liger" in tool, "unsloth": "unsloth" in tool}
    return {k: v for k, v in versions.items() if used.get(k, True)}


def run_context(module: str, argv: list[str] | None, **settings) -> Context:
    """The context of this process's run of ``benchmarks.<module>``."""
    gpu = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except ImportError:
        pass
    return Context(command=command_line(module, argv), date=datetime.date.today().isoformat(), gpu=gpu,
                   versions=installed_versions(), settings={k: v for k, v in settings.items() if v is not None})


def rows_path(rows: str | None, out: str | None) -> str | None:
    """Where a script writes its rows: ``--rows``, else ``<out without .json>.rows.jsonl``, else nowhere."""
    if rows:
        return rows
    return os.path.splitext(out)[0] + ".rows.jsonl" if out else None


def save(module: str, argv, data, out: str | None, rows: str | None, **settings) -> str | None:
    """A script's last step: the rows of ``data`` (its JSON) written where ``rows_path`` says."""
    path = rows_path(rows, out)
    if path:
        n = write_rows(path, rows_from(data, run_context(module, argv, **settings)))
        print(f"# {n} result rows: {path}", file=sys.stderr, flush=True)  # stdout ends with the table
    return path


# ------------------------------------------------------------------------------------ converters


def tool_of(mode: str) -> str:
    """The tool a benchmark mode measures."""
    if mode in ("hf_padded", "hf_full_logits", "baseline", "plain"):
        return "transformers+peft"
    if "liger" in mode:
        return "trl+liger"
    if mode.startswith("trl"):
        return "trl"
    if mode.startswith("unsloth"):
        return "unsloth"
    if mode == "eager":
        return "torch"
    if mode == "compile":
        return "torch.compile"
    return "swiftune"


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def kind_of(data) -> str | None:
    """Which script's JSON ``data`` is."""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data) and {"mode", "batch"} <= set(data[0]):
        return "sft"
    if isinstance(data, dict):
        if data.get("benchmark") in ("grpo_step", "grpo_bisect", "grpo_e2e", "loss_curve", "rollout", "attention",
                                     "losses", "tune_kernels", "reward_curve"):
            return data["benchmark"]
        if {"meta", "rows"} <= set(data):
            return "kernels"
        rows = data.get("rows")
        if isinstance(rows, list) and rows and {"mode", "tokens", "status"} <= set(rows[0]):
            return "longctx"
        if isinstance(rows, list) and rows and {"method", "loss", "tokens"} <= set(rows[0]):
            return "losses"
    return None


def rows_from(data, ctx: Context) -> list[Row]:
    kind = kind_of(data)
    if kind is None:
        raise ValueError("not the JSON of a benchmark script")
    return CONVERTERS[kind](data, ctx)


def rows_from_sft(data: list, ctx: Context) -> list[Row]:
    out = []
    for r in data:
        if "error" in r or not _num(r.get("tokens_per_s")):
            continue
        s = {"batch": r["batch"], "finetune": r.get("finetune", "lora r=16"), "timed_steps": r.get("steps")}
        if r.get("logit_chunk_tokens"):
            s["logit_chunk_tokens"] = r["logit_chunk_tokens"]
        if r.get("gpu_budget_gb") is not None:
            s["gpu_budget_gb"] = r["gpu_budget_gb"]
        if r.get("deferred_nonfinite_check"):
            s["deferred_nonfinite_check"] = True
        if r.get("step_sync"):  # timed as one window, synchronised at its ends only
            s["step_sync"] = r["step_sync"]
        if r.get("lora_target_parameters"):  # adapters on parameters too (MoE experts), beside all-linear
            s["lora_target_parameters"] = ",".join(r["lora_target_parameters"])
        s = {k: v for k, v in s.items() if v is not None}
        one = lambda metric, value: out.append(ctx.row(tool_of(r["mode"]), r["mode"], r["model"], s, metric, value))  # noqa: E731
        one("tokens_per_s", r["tokens_per_s"])
        if _num(r.get("tokens_per_s_excl_collate")):  # benchmarks.vl: the time inside the collator left out
            out.append(ctx.row(tool_of(r["mode"]), r["mode"], r["model"], {**s, "excl_collate": True}, "tokens_per_s",
                               r["tokens_per_s_excl_collate"]))
        one("peak_gb", r["peak_gb"])
        one("step_s", r["sec_per_step"])
        one("padding_fraction", r["padding_fraction"])
        if _num((r.get("time_profile") or {}).get("device_ms")):
            one("device_ms", r["time_profile"]["device_ms"])
            if _num(r["time_profile"].get("step_wall_ms")):  # the profiled step's own wall time: its busy share
                one("profiled_step_wall_ms", r["time_profile"]["step_wall_ms"])
            if _num(r["time_profile"].get("step_token_slots")):  # its tokens: device ms per token
                one("profiled_step_token_slots", r["time_profile"]["step_token_slots"])
            if _num(r["time_profile"].get("step_captures")):  # graphs captured in it: not a steady step
                one("profiled_step_captures", r["time_profile"]["step_captures"])
            idle = r["time_profile"].get("idle") or {}
            if _num(idle.get("idle_ms")):  # the profiled step's device gaps, and those a host wait opened
                one("device_idle_ms", idle["idle_ms"])
                one("device_idle_after_sync_ms", idle["idle_after_sync_ms"])
        if _num((r.get("host_profile") or {}).get("host_ms")):
            one("host_ms", r["host_profile"]["host_ms"])
        if _num(r.get("steady_tokens_per_s")):  # graphed layers: the timed steps that captured no graph
            one("steady_tokens_per_s", r["steady_tokens_per_s"])
            if _num(r.get("steps_capturing")):
                one("steps_capturing", r["steps_capturing"])
        graphs = r.get("graphs") or {}
        if _num(graphs.get("capacity_tokens")):  # graphed layers: the static buffers' token capacity
            one("graph_capacity_tokens", graphs["capacity_tokens"])
        if graphs.get("host_input_bytes"):  # graphed layers with their inputs in pinned host buffers
            one("host_input_gb", graphs["host_input_bytes"] / 1e9)
        if _num(r.get("window_captures")):  # graphed layers timed as one window: the captures inside it
            one("window_captures", r["window_captures"])
    return out


_FAIL = ("oom", "oom_host", "oom_killed", "error", "out_of_time")


def rows_from_longctx(data: dict, ctx: Context) -> list[Row]:
    args, sources = data.get("args", {}), data.get("sources", {})
    model = args.get("model", "?")
    out = []
    for mode in dict.fromkeys(r["mode"] for r in data["rows"]):
        src = sources.get(mode, {})
        doc = src.get("doc_tokens", args.get("doc_tokens"))
        base = {"doc_tokens": doc} if doc is not None else {}
        if src:
            base["run_mode"] = src.get("mode", mode)
        tool = tool_of(src.get("mode", mode))
        rows = [r for r in data["rows"] if r["mode"] == mode]
        for r in rows:
            s = {**base, "tokens": r["tokens"]}
            if r["status"] == "max_fit":
                out.append(ctx.row(tool, mode, model, base, "max_fit_tokens", r["tokens"]))
                fails = [x["tokens"] for x in rows if x["status"] in _FAIL and x["tokens"] > r["tokens"]]
                if fails:
                    out.append(ctx.row(tool, mode, model, base, "first_fail_tokens", min(fails)))
                continue
            ok = r["status"] == "ok"
            out.append(ctx.row(tool, mode, model, {**s, "status": r["status"]}, "fits", int(ok)))
            if not ok:
                continue
            for metric, key, scale in (("step_s", "step_s", 1), ("step_s_excl_pin", "step_s_excl_pin", 1),
                                       ("tokens_per_s", "tokens_per_s", 1), ("peak_gb", "peak_allocated", 1e-9),
                                       ("reserved_gb", "peak_reserved", 1e-9), ("host_pinned_gb", "host_pinned", 1e-9),
                                       ("planned_gb", "pred_allocated", 1e-9), ("layers_on_gpu", "kept", 1)):
                if _num(r.get(key)):
                    out.append(ctx.row(tool, mode, model, s, metric, r[key] * scale))
    for mode, n in (data.get("predicted_max_tokens") or {}).items():
        if _num(n):
            out.append(ctx.row(tool_of(mode), mode, model, {"doc_tokens": args.get("doc_tokens")}, "planner_max_tokens", n))
    return out


def rows_from_grpo_bisect(data: dict, ctx: Context) -> list[Row]:
    model, out = data.get("model", "?"), []
    base = {"rows": data.get("rows"), "prompt_tokens": data.get("prompt_tokens")}
    for name, m in data.get("modes", {}).items():
        src = (data.get("sources") or {}).get(name, {})
        run_mode = src.get("mode", m.get("mode", name))
        tool = tool_of(run_mode)
        s0 = dict(base)
        if tool == "swiftune":
            s0.update(share_prompt=src.get("share_prompt", data.get("share_prompt")),
                      checkpointing=src.get("swiftune_checkpointing", data.get("swiftune_checkpointing")),
                      attention_output_layers=src.get("attention_output_layers",
                                                      data.get("attention_output_layers")) or None,
                      attention_outputs_on_host=src.get("attention_outputs_on_host",
                                                        data.get("attention_outputs_on_host")) or None)
        s0 = {k: v for k, v in s0.items() if v is not None}
        for metric, key in (("max_fit_completion", "max_fit"), ("first_fail_completion", "first_fail")):
            if _num(m.get(key)):
                out.append(ctx.row(tool, name, model, {**s0, "search": m.get("status")}, metric, m[key]))
        for t in m.get("trials", []):
            s = {**s0, "completion": t["completion"], "tokens": t.get("tokens")}
            ok = t.get("status") == "ok"
            out.append(ctx.row(tool, name, model, {**s, "status": t.get("status")}, "fits", int(ok)))
            if not ok:
                continue
            for metric, key in (("step_s", "s"), ("first_step_s", "first_s"), ("peak_gb", "peak_gb"),
                                ("reserved_gb", "reserved_gb"), ("host_rss_gb", "host_rss_gb"),
                                ("tokens_per_s", "tokens_per_s")):
                if _num(t.get(key)):
                    out.append(ctx.row(tool, name, model, s, metric, t[key]))
    plan = data.get("planner") or {}
    if _num(plan.get("completion")):
        out.append(ctx.row("swiftune", "planner", model, base, "planner_max_completion", plan["completion"]))
    return out


def rows_from_grpo_step(data: dict, ctx: Context) -> list[Row]:
    model = data.get("model", "?")
    s = {k: data.get(k) for k in ("generations", "prompt_tokens", "max_completion_length", "fused_layers", "engine")}
    s = {k: v for k, v in s.items() if v is not None}
    out = [ctx.row("swiftune", "grpo_step", model, s, "step_s", data["step_s"]),
           ctx.row("swiftune", "grpo_step", model, s, "peak_gb", data["peak_gb"])]
    if _num(data.get("generation_tokens_per_s")):
        out.append(ctx.row("swiftune", "grpo_step", model, {**s, "phase": "generation"}, "tokens_per_s",
                           data["generation_tokens_per_s"]))
    for phase, p in (data.get("phases") or {}).items():
        out.append(ctx.row("swiftune", "grpo_step", model, {**s, "phase": phase}, "phase_s", p["s"]))
        if _num(p.get("peak_gb")):
            out.append(ctx.row("swiftune", "grpo_step", model, {**s, "phase": phase}, "peak_gb", p["peak_gb"]))
    return out


def rows_from_loss_curve(data: dict, ctx: Context) -> list[Row]:
    model = data.get("model", "?")
    s = {k: data.get(k) for k in ("batch", "steps", "lr", "dtype", "max_length")}
    measured, reference = data.get("measured", "swiftune_packed"), data.get("reference", "hf_padded")
    out = [ctx.row("swiftune", measured, model, {**s, "against": reference}, metric, data[key])
           for metric, key in (("max_abs_diff", "max_abs_diff"), ("mean_abs_diff", "mean_abs_diff"),
                               ("max_rel_diff", "max_rel_diff")) if _num(data.get(key))]
    for mode, m in (data.get("modes") or {}).items():
        if m.get("losses"):
            out.append(ctx.row(tool_of(mode), mode, model, s, "final_loss", m["losses"][-1]))
        if _num(m.get("train_s")):
            out.append(ctx.row(tool_of(mode), mode, model, s, "train_s", m["train_s"]))
    return out


def rows_from_reward_curve(data: dict, ctx: Context) -> list[Row]:
    """The built-in GRPO task's reward, first and last fifth, per base-weight format."""
    out = []
    for name, r in (data.get("runs") or {}).items():
        s = {"weights": name, "steps": data.get("steps"), "seed": data.get("seed")}
        for metric, key in (("reward_first_fifth", "first_fifth"), ("reward_last_fifth", "last_fifth")):
            if _num(r.get(key)):
                out.append(ctx.row("swiftune", "grpo_builtin_lora", "tiny-qwen3", s, metric, r[key]))
    return out


def rows_from_rollout(data: dict, ctx: Context) -> list[Row]:
    out = []
    base = {"prompt_tokens": data.get("prompt_tokens")}
    if data.get("weights") in ("nf4", "fp8"):  # bf16 runs (and files written before the field) keep their settings
        base["weights"] = data["weights"]
    for r in data.get("runs", []):
        fast = r.get("fast") or {}
        s = {**base, "rows": r["rows"], "new_tokens": r["new_tokens"], "fused_layers": fast.get("fused_layers")}
        if fast.get("kv_cache_dtype") == "fp8":  # the default cache (and files written before the field) add nothing
            s["kv_cache"] = "fp8"
        mode = "fast_engine"
        for metric, value in (("tokens_per_s", fast.get("tokens_per_s")), ("step_ms", fast.get("step_ms")),
                              ("hbm_floor_ms", r.get("hbm_floor_ms"))):
            if _num(value):
                out.append(ctx.row("swiftune", mode, r["model"], s, metric, value))
        for cache in ("static", "dynamic"):
            g = r.get(f"generate_{cache}") or {}
            gs = {**base, "rows": r["rows"], "new_tokens": r["new_tokens"], "timed_tokens": g.get("new_tokens")}
            for metric in ("tokens_per_s", "step_ms"):
                if _num(g.get(metric)):
                    out.append(ctx.row("transformers", f"generate_{cache}", r["model"], gs, metric, g[metric]))
    for r in data.get("fused_ab", []):
        s = {**base, "rows": r["rows"], "new_tokens": r["new_tokens"], "fused_layers": r["fused_layers"], "ab": True}
        for metric in ("tokens_per_s", "step_ms"):
            out.append(ctx.row("swiftune", "fast_engine", r["model"], s, metric, r["fast"][metric]))
    for r in data.get("lora", []):
        s = {**base, "rows": r["rows"], "new_tokens": r["new_tokens"], "lora": r["lora"]}
        for metric in ("tokens_per_s", "step_ms"):
            out.append(ctx.row("swiftune", "fast_engine_lora", r.get("model", "qwen3-1.7b"), s, metric,
                               r["fast"][metric]))
    return out


_KERNEL_COLUMNS = (("swiftune", "ours_ms"), ("eager", "eager_ms"), ("compile", "compile_ms"))


def rows_from_kernels(data: dict, ctx: Context) -> list[Row]:
    out = []
    for r in data["rows"]:
        s = {"shape": r["shape"]}
        for mode, key in _KERNEL_COLUMNS:
            if _num(r.get(key)):
                out.append(ctx.row(tool_of(mode), r["kernel"], "-", s, "ms", r[key]))
        for metric, key in (("gb_moved", "gbytes"), ("tb_per_s", "tb_s"), ("copy_fraction", "of_copy")):
            if _num(r.get(key)):
                out.append(ctx.row("swiftune", r["kernel"], "-", s, metric, r[key]))
    return out


def rows_from_attention(data: dict, ctx: Context) -> list[Row]:
    out = []
    for r in data["rows"]:
        s = {"backend": r["backend"], "docs": r["docs"], "doc_tokens": r["doc_tokens"], "heads": data.get("heads")}
        for metric, key in (("ms", "ms"), ("tflop_per_s", "tflops"), ("saved_bytes_per_token", "saved_bytes_per_token"),
                            ("backward_bytes_per_token", "backward_extra_bytes_per_token")):
            if _num(r.get(key)):
                out.append(ctx.row("swiftune", f"attention_{r['backend']}", "-", s, metric, r[key]))
    return out


def rows_from_losses(data: dict, ctx: Context) -> list[Row]:
    out = []
    for r in data["rows"]:
        s = {"tokens": r["tokens"], "loss": r["loss"], "status": r.get("status")}
        tool = tool_of(r["method"])
        if r.get("status") != "ok":
            out.append(ctx.row(tool, r["method"], "lm_head", s, "fits", 0))
            continue
        out.append(ctx.row(tool, r["method"], "lm_head", s, "fits", 1))
        out.append(ctx.row(tool, r["method"], "lm_head", s, "ms", r["ms"]))
        if _num(r.get("peak_bytes")):
            out.append(ctx.row(tool, r["method"], "lm_head", s, "extra_gb", r["peak_bytes"] / 1e9))
    return out


def rows_from_tune_kernels(data: dict, ctx: Context) -> list[Row]:
    return [ctx.row("swiftune", r["kernel"], "-", r["settings"], "tb_per_s", r["tb_per_s"]) for r in data["rows"]]


def rows_from_grpo_e2e(data: dict, ctx: Context) -> list[Row]:
    """One whole GRPO step per tool (``benchmarks.grpo_e2e``): its time, peak memory and each phase's
    time; the versions are those the tool's own process had (Unsloth brings its own TRL)."""
    out = []
    for r in data["rows"]:
        if "error" in r or not _num(r.get("step_s")):
            continue
        tool = tool_of(r["mode"])
        here = dataclasses.replace(ctx, versions={**ctx.versions, **r.get("versions", {})})
        s = {k: r.get(k) for k in ("prompts", "generations", "prompt_tokens", "max_completion_length", "micro_batch")}
        s["all_full_length"] = r.get("all_full_length")
        out.append(here.row(tool, r["mode"], r["model"], s, "step_s", r["step_s"]))
        out.append(here.row(tool, r["mode"], r["model"], s, "peak_gb", r["peak_gb"]))
        if _num(r.get("kv_cache_gb")):  # swiftune's engine: its KV cache, part of peak_gb
            out.append(here.row(tool, r["mode"], r["model"], s, "kv_cache_gb", r["kv_cache_gb"]))
        for phase, seconds in r["phases"].items():
            out.append(here.row(tool, r["mode"], r["model"], {**s, "phase": phase}, "phase_s", seconds))
    return out


CONVERTERS = {"sft": rows_from_sft, "grpo_e2e": rows_from_grpo_e2e, "longctx": rows_from_longctx, "grpo_bisect": rows_from_grpo_bisect,
              "grpo_step": rows_from_grpo_step, "loss_curve": rows_from_loss_curve, "rollout": rows_from_rollout,
              "kernels": rows_from_kernels, "attention": rows_from_attention, "losses": rows_from_losses,
              "tune_kernels": rows_from_tune_kernels, "reward_curve": rows_from_reward_curve}


# -------------------------------------------------------------------- the published figures' rows


def import_published(root: str) -> list[Row]:
    """The rows of every published figure, from the raw JSON under ``docs/results/`` (the list and
    each file's command, date and versions: ``benchmarks/published.py``)."""
    from benchmarks.published import FIGURES

    rows: list[Row] = []
    for fig in FIGURES:
        with open(os.path.join(root, "docs", "results", fig["file"])) as f:
            data = json.load(f)
        ctx = Context(command=fig["command"], date=fig["date"], gpu=fig.get("gpu", "NVIDIA H200"),
                      versions=dict(fig["versions"]),
                      settings={"figure": fig["figure"], **fig.get("settings", {})})
        got = rows_from(data, ctx)
        keep = fig.get("keep")
        if keep:
            got = [r for r in got if keep(r)]
        if fig.get("before_qk_fix"):  # the fix is in swiftune's code: the baselines' rows stand
            for r in got:
                if r.tool == "swiftune":
                    r.settings["before_qk_fix"] = True
        rows += got
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check files of rows against the schema")
    v.add_argument("paths", nargs="+")
    i = sub.add_parser("import", help="the published figures' rows from the raw JSON under docs/results/")
    i.add_argument("--root", default=".", help="the repository root")
    i.add_argument("--out", default="docs/results/results.jsonl")
    args = p.parse_args(argv)
    if args.cmd == "validate":
        for path in args.paths:
            print(f"{path}: {len(read_rows(path))} rows, valid")
        return 0
    n = write_rows(args.out, import_published(args.root))
    print(f"{args.out}: {n} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
