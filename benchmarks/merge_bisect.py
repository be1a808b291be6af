"""One figure from several ``benchmarks/grpo.py --bisect-completion`` or ``benchmarks/longctx.py`` runs.

A long search does not fit one device call, so the modes of figure 3 come from separate runs (the
baselines' search in one, swiftune's trials in others). This writes one JSON with every chosen mode,
each under the name given to it, and records for each where it came from (file, library versions,
checkpointing, planner line), so ``benchmarks/plots.py`` draws them side by side without hiding that
they were measured in different processes.

    python -m benchmarks.merge_bisect --out docs/results/grpo_figure3_qwen3-8b_h200.json \\
        docs/results/grpo_bisect_qwen3-8b_h200.json:hf_full_logits,trl_grpo,trl_liger \\
        docs/results/grpo_3x_qwen3-8b_h200.json:swiftune \\
        docs/results/grpo_65k_swiftune_h200.json:swiftune=swiftune_offload_all

Each argument is ``FILE:MODE[=NAME][,MODE[=NAME]...]``. Runs of different models, prompt lengths or
row counts are refused: their lengths do not compare. ``MODE=+NAME`` adds the run's trials of ``MODE``
to ``NAME``, a mode taken from an earlier file, when one bracket was measured in two runs (the fit in
one, the first failure in the other): the joined mode's largest fit and first failure come from all
its trials, and its source lists both files. ``benchmarks/longctx.py`` files (``{"rows": ...}``)
merge the same way: the chosen modes' rows, each source with its document length (``doc_tokens``: 0 =
one sequence), which the plot's legend shows:

    python -m benchmarks.merge_bisect --out docs/results/longctx_figure3_llama3-8b_h200.json \
        docs/results/longctx_trl_llama3-8b_h200.json:trl_liger \
        docs/results/longctx_bisect_llama3-8b_h200.json:offload
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import results

#: what must agree between the merged runs for their trials to be comparable
SAME = ("benchmark", "model", "prompt_tokens", "rows")
#: what each mode keeps of the run it came from
PROVENANCE = ("torch", "transformers", "peft", "trl", "device", "swiftune_checkpointing", "attention_output_layers",
              "attention_outputs_on_host", "share_prompt",
              "trial_repeats", "planner", "mem_get_info")


def parse_spec(spec: str) -> tuple[str, list[tuple[str, str]]]:
    """``"a.json:x,y=z"`` -> ``("a.json", [("x", "x"), ("y", "z")])``."""
    path, sep, modes = spec.rpartition(":")
    if not sep or not path or not modes:
        raise ValueError(f"expected FILE:MODE[=NAME][,...], got {spec!r}")
    pairs = []
    for item in modes.split(","):
        mode, _, new = item.partition("=")
        pairs.append((mode, new or mode))
    return path, pairs


def require_mode(path: str, have, mode: str) -> None:
    if mode not in have:
        raise ValueError(f"{path} has no mode {mode!r} (it has {sorted(have)})")


def checked_pairs(path: str, have, pairs: list[tuple[str, str]], taken) -> list[tuple[str, str]]:
    """``pairs`` once every chosen mode is in the run (``have``) and every new name is unique: not
    ``taken`` by an earlier run, nor twice among ``pairs``."""
    names = set(taken)
    for mode, new in pairs:
        require_mode(path, have, mode)
        if new in names:
            raise ValueError(f"two modes named {new!r}: rename one (MODE=NAME)")
        names.add(new)
    return pairs


def merged_device(runs: list[tuple[str, dict, list[tuple[str, str]]]]) -> str:
    """The runs' device, or all of them joined by " / " when they differ (runs that name none are left out:
    ``benchmarks/unsloth_grpo.py``'s JSON does not); None when no run names one."""
    devices = {data["device"] for _, data, _ in runs if data.get("device")}
    return devices.pop() if len(devices) == 1 else " / ".join(sorted(devices)) or None


def merge(runs: list[tuple[str, dict, list[tuple[str, str]]]]) -> dict:
    """The first run's header, then every chosen mode under its new name with its provenance."""
    if not runs:
        raise ValueError("nothing to merge")
    first = runs[0][1]
    out = {k: first.get(k) for k in (*SAME, "tolerance")}
    out["modes"], out["sources"] = {}, {}
    for path, data, pairs in runs:
        for k in SAME:
            if data.get(k) != first.get(k):
                raise ValueError(f"{path}: {k} = {data.get(k)!r}, the first run has {first.get(k)!r}")
        joins = [(mode, new[1:]) for mode, new in pairs if new.startswith("+")]
        for mode, new in checked_pairs(path, data.get("modes", {}), [p for p in pairs if not p[1].startswith("+")],
                                       out["modes"]):
            out["modes"][new] = dict(data["modes"][mode], mode=new)
            out["sources"][new] = provenance(path, data, mode)
        for mode, into in joins:
            require_mode(path, data.get("modes", {}), mode)
            if into not in out["modes"]:
                raise ValueError(f"{path}: {mode}=+{into} joins a mode of an earlier file, and none is named {into!r}")
            out["modes"][into] = joined_mode(out["modes"][into], data["modes"][mode])
            src = out["sources"][into]
            src["joined"] = [*src.get("joined", []), provenance(path, data, mode)]
    out["device"] = merged_device(runs)
    return out


def provenance(path: str, data: dict, mode: str) -> dict:
    """Where a merged mode came from: the file, its name there, and the run's :data:`PROVENANCE`. A mode of
    a file that is itself a merge keeps the provenance recorded there (its runs' files, settings and joins),
    with the merged file it was read from as ``via``."""
    earlier = (data.get("sources") or {}).get(mode)
    if earlier is not None:
        return {**earlier, "via": path}
    return {"file": path, "mode": mode, **{k: data.get(k) for k in PROVENANCE if k in data}}


def joined_mode(first: dict, more: dict) -> dict:
    """``first`` with ``more``'s trials added: the largest length that fitted in either, the smallest
    larger one that ran out of memory (GPU or host) in either; status ``joined`` when that brackets
    the largest fit, else ``first``'s."""
    trials = [*first.get("trials", []), *more.get("trials", [])]
    fits = [t["completion"] for t in trials if t.get("status") == "ok"]
    max_fit = max(fits) if fits else None
    fails = [t["completion"] for t in trials if str(t.get("status", "")).startswith("oom")
             and (max_fit is None or t["completion"] > max_fit)]
    first_fail = min(fails) if fails else None
    status = "joined" if max_fit is not None and first_fail is not None else first.get("status")
    return dict(first, trials=trials, max_fit=max_fit, first_fail=first_fail, status=status)


#: what a long-context run's mode keeps of its run (from the file's ``args``, then the file itself)
ROWS_PROVENANCE = ("doc_tokens", "host_bytes", "autocast", "device", "torch", "gpu_bytes")


def merge_rows(runs: list[tuple[str, dict, list[tuple[str, str]]]]) -> dict:
    """:func:`merge` for ``benchmarks/longctx.py`` files: every chosen mode's rows (renamed), and per
    mode where they came from. Runs of another model are refused."""
    if not runs:
        raise ValueError("nothing to merge")
    model = (runs[0][1].get("args") or {}).get("model")
    out: dict = {"args": {"model": model}, "rows": [], "sources": {}}
    for path, data, pairs in runs:
        args = data.get("args") or {}
        if args.get("model") != model:
            raise ValueError(f"{path}: model = {args.get('model')!r}, the first run has {model!r}")
        have = {r["mode"] for r in data.get("rows", [])}
        for mode, new in checked_pairs(path, have, pairs, out["sources"]):
            out["rows"] += [dict(r, mode=new) for r in data["rows"] if r["mode"] == mode]
            out["sources"][new] = {"file": path, "mode": mode,
                                   **{k: args.get(k, data.get(k)) for k in ROWS_PROVENANCE
                                      if k in args or k in data}}
    out["device"] = merged_device(runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="FILE:MODES")
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default=None, help="write the figures as result rows (JSON Lines) here "
                   "(default: the --out path with .rows.jsonl)")
    args = p.parse_args(argv)
    runs = []
    for spec in args.runs:
        path, pairs = parse_spec(spec)
        with open(path) as f:
            runs.append((path, json.load(f), pairs))
    try:
        rows_files = all(isinstance(data.get("rows"), list) for _, data, _ in runs)  # (GRPO's "rows" is a count)
        merged = merge_rows(runs) if rows_files else merge(runs)
    except ValueError as e:
        print(f"merge_bisect: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    results.save("merge_bisect", argv, merged, args.out, args.rows)
    for new, src in merged["sources"].items():
        print(f"{new:<24} <- {src['file']} ({src['mode']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
