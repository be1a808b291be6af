"""Smoke tests of the benchmark scripts: each one's tiny mode runs end to end in a subprocess
(``python -m benchmarks.NAME``) and writes the JSON keys the docs and benchmarks.plots read, and its
figures as result rows that validate against benchmarks.results' schema; plots draws the committed
results; the committed rows reproduce the published rows and docs/benchmarks.md's tables.

The scripts run without ``TRITON_INTERPRET`` (removed from their environment), so on a machine
without CUDA the kernels use their plain-PyTorch references, as a user's CPU run would.
"""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = [os.path.join(ROOT, "docs", "results", f)
             for f in ("sft_qwen3-8b_b16.json", "sft_qwen3-8b_sweep_h200.json", "longctx_qwen3-8b_32k.json",
                       "longctx_qwen3-8b_sweep_h200.json", "rollout_h200.json", "grpo_step_qwen3-1.7b_h200.json",
                       "grpo_figure3_qwen3-8b_h200.json", "longctx_figure3_llama3-8b_h200.json",
                       "longctx_figure3_qwen3-8b_h200.json")]
LONGCTX_RESULTS = [os.path.join(ROOT, "docs", "results", f"longctx_qwen3-8b_{k}.json")
                   for k in ("sweep_h200", "400k_single_h200", "offload_overhead_h200", "32k")]


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<name> ARGS`` from the repository root (``name`` may end in .py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    module = "benchmarks." + name.removesuffix(".py")
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{name} {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def load_bench_module(name: str):
    """A benchmark module (``benchmarks.<name>``), for its functions."""
    return importlib.import_module(f"benchmarks.{name}")


def assert_rows(out, module: str, metrics: set[str] = frozenset()) -> list:
    """The rows a run wrote beside ``out`` (``<out>.rows.jsonl``): valid, recording the run's own
    ``python -m benchmarks.<module>`` command, carrying at least ``metrics``."""
    from benchmarks.results import read_rows

    path = os.path.splitext(str(out))[0] + ".rows.jsonl"
    rows = read_rows(path)  # validates every row
    assert rows, path
    assert all(r.command.startswith(f"python -m benchmarks.{module} ") and str(out) in r.command for r in rows)
    assert metrics <= {r.metric for r in rows}, (metrics, {r.metric for r in rows})
    return rows


@pytest.fixture(scope="module")
def grpo_step_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "grpo_step.json"
    proc = run_script("grpo.py", "--model", "tiny", "--out", str(out))
    assert "GRPO step" in proc.stdout  # the table is printed last
    return out


@pytest.fixture(scope="module")
def grpo_bisect_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "grpo_bisect.json"
    modes = ["trl_grpo", "swiftune"] if importlib.util.find_spec("trl") else ["hf_full_logits", "swiftune"]
    run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", *modes,
               "--simulate-capacity", "1500", "--completion-lengths", "96", "--out", str(out))
    return out


@pytest.fixture(scope="module")
def loss_curve_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("loss") / "loss_curve.json"
    run_script("loss_curve.py", "--model", "tiny", "--steps", "10", "--batch", "4", "--max_length", "256",
               "--out", str(out))
    return out


def test_grpo_step_tiny(grpo_step_json):
    r = json.loads(grpo_step_json.read_text())
    for key in ("model", "generations", "prompt_tokens", "max_completion_length", "completion_lengths", "step_s",
                "peak_gb", "phases", "generation_tokens_per_s", "reward", "reward_std", "share_prompt", "device"):
        assert key in r, key
    assert r["benchmark"] == "grpo_step" and "error" not in r
    assert set(r["phases"]) >= {"generation", "logps_no_grad", "policy_forward", "policy_backward", "other"}
    # no stop token: every completion ran to max_completion_length
    assert r["all_full_length"] and r["completion_lengths"] == [r["max_completion_length"]] * r["generations"]
    assert r["reward_std"] > 0  # the reward gives non-zero advantages
    assert all(v["s"] >= 0 for k, v in r["phases"].items() if k != "other")
    assert_rows(grpo_step_json, "grpo", {"step_s", "peak_gb", "phase_s"})


def test_search_max_fit_brackets_within_tolerance():
    grpo = load_bench_module("grpo")
    for capacity in (100, 1000, 1234, 40_000, 300_000):
        tried = []

        def fits(n, capacity=capacity):
            tried.append(n)
            return n <= capacity

        lo, hi, status = grpo.search_max_fit(fits, 512, 2**20, tol=0.05, granularity=16)
        assert status == "converged", (capacity, lo, hi, status)
        if capacity < 16:
            continue
        assert lo <= capacity < hi and (hi <= lo * 1.05 or hi - lo <= 16), (capacity, lo, hi)
        assert len(tried) < 30
    # nothing above the largest size: reported, not invented
    assert grpo.search_max_fit(lambda n: True, 64, 1024, granularity=16) == (1024, None, "no_limit_found")
    # resuming from a bracket tries only sizes inside it
    seen = []
    lo, hi, status = grpo.search_max_fit(lambda n: seen.append(n) or n <= 5000, 64, 2**20, granularity=16,
                                         lo=4096, hi=8192)
    assert status == "converged" and all(4096 < n < 8192 for n in seen) and lo <= 5000 < hi

    # running out of time keeps the bracket found so far
    def timed(n):
        if n > 2048:
            raise grpo.OutOfTime
        return True

    assert grpo.search_max_fit(timed, 512, 2**20, granularity=16) == (2048, None, "out_of_time")


def test_grpo_bisect_tiny(grpo_bisect_json):
    r = json.loads(grpo_bisect_json.read_text())
    assert r["benchmark"] == "grpo_bisect" and r["rows"] == 2 and r["prompt_tokens"] == 256
    for mode, res in r["modes"].items():
        assert {"label", "max_fit", "first_fail", "status", "trials"} <= set(res), mode
        assert res["status"] == "converged", res
        # the simulated capacity is 1500 tokens = 2 x (256 + L): L <= 494
        assert res["max_fit"] <= 494 < res["first_fail"] and res["first_fail"] <= res["max_fit"] * 1.05 + 16
        lengths = [t["completion"] for t in res["trials"]]
        assert lengths[0] == 96  # the fixed length first, then the search
        assert all({"completion", "tokens", "status", "s"} <= set(t) for t in res["trials"])
    rows = assert_rows(grpo_bisect_json, "grpo", {"fits", "max_fit_completion", "first_fail_completion", "step_s"})
    assert {r.tool for r in rows} >= {"swiftune"} and all(r.settings["rows"] == 2 for r in rows)


def test_grpo_bisect_prints_the_planners_largest_completion(grpo_bisect_json):
    r = json.loads(grpo_bisect_json.read_text())
    plan = r["planner"]
    P, R = r["prompt_tokens"], r["rows"]
    per_row = (plan["tokens"] - P) // R if r["share_prompt"] else plan["tokens"] // R - P
    assert plan["completion"] == per_row > 0
    assert plan["attention"] in ("sdpa", "flex" if r["share_prompt"] else "varlen")


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("gpu", [int(12e9), int(3.5e9)])
def test_planner_max_completion_is_the_largest_that_fits(share, gpu):
    """At small budgets the answer is a real boundary: the planner fits its token count, not one more,
    with the memory of the kernel such rows run: sdpa when they are long (K/V unexpanded, a float32 dq
    for one prompt + completion), else flex (no K/V expansion, bf16 dq) for shared-prompt rows and
    varlen for unshared ones."""
    import argparse

    from swiftune.attention.backends import SDPA_MIN_MEAN_DOC_TOKENS, planner_attention_terms
    from swiftune.memory import plan_memory

    grpo = load_bench_module("grpo")
    from benchmarks.workload import MODEL_SHAPES

    args = argparse.Namespace(model="qwen3-0.6b", share_prompt=share, prompt_tokens=256, bisect_rows=2)
    host = int(8e9)
    plan = grpo.planner_max_completion(args, gpu_bytes=gpu, host_bytes=host)
    long_rows = 256 + plan["completion"] >= SDPA_MIN_MEAN_DOC_TOKENS
    assert plan["attention"] == ("sdpa" if long_rows else "flex" if share else "varlen")
    sdpa = plan["attention"] == "sdpa"
    assert plan["longest"] == (256 + plan["completion"] if sdpa else None)  # sdpa: the answer's own sequence
    kernel = None if plan["attention"] == "varlen" else plan["attention"]
    kw = dict(gradient_checkpointing="offload", tiled_projections=True, host_bytes=host, autocast=True,
              lora_input_casts=False)

    def fits(t):  # sdpa: the float32 dq of one prompt + completion of a row of t tokens
        longest = 256 + ((t - 256) // 2 if share else t // 2 - 256) if sdpa else None
        return plan_memory(dict(MODEL_SHAPES["qwen3-0.6b"]), t, 16, gpu_bytes=gpu, **kw,
                           **planner_attention_terms(kernel, longest)).fits

    assert fits(plan["tokens"]) and not fits(plan["tokens"] + 1)
    tokens_per_step = 256 + 2 * plan["completion"] if share else 2 * (256 + plan["completion"])
    assert tokens_per_step <= plan["tokens"] < tokens_per_step + 2  # the rest does not make a whole token per row


def test_grpo_bisect_repeats_fixed_trials_and_offloads_every_layer(tmp_path):
    """--trial-repeats reports the last of N steps (the first one's time kept), and
    --swiftune-checkpointing offload_all runs the swiftune step with every layer input offloaded."""
    out = tmp_path / "repeats.json"
    run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", "swiftune", "--share-prompt",
               "--swiftune-checkpointing", "offload_all", "--trial-repeats", "2", "--fixed-only",
               "--completion-lengths", "96", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["trial_repeats"] == 2 and r["swiftune_checkpointing"] == "offload_all"
    (t,) = r["modes"]["swiftune"]["trials"]
    assert t["status"] == "ok" and t["completion"] == 96 and t["first_s"] > 0 and t["s"] > 0


def test_grpo_bisect_host_budget_caps_the_offloaded_checkpoints(tmp_path):
    """--host-budget-gb reaches swiftune's offloaded checkpoints: with every layer input sent to the
    host, a cap below one input makes the trial fail as out of host memory, a cap above all of them
    lets it run; the cap and margin are recorded."""
    results = {}
    for cap in ("0.000001", "1"):
        out = tmp_path / f"cap_{cap}.json"
        run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", "swiftune", "--share-prompt",
                   "--swiftune-checkpointing", "offload_all", "--fixed-only", "--completion-lengths", "96",
                   "--host-budget-gb", cap, "--host-margin-gb", "0", "--out", str(out))
        results[cap] = json.loads(out.read_text())
    (starved,) = results["0.000001"]["modes"]["swiftune"]["trials"]
    (capped,) = results["1"]["modes"]["swiftune"]["trials"]
    assert starved["status"] == "oom_host", starved
    assert capped["status"] == "ok", capped
    assert results["1"]["host_budget_gb"] == 1.0 and results["1"]["host_margin_gb"] == 0.0


def test_grpo_completion_from_planner_tries_both_sides_of_its_answer(tmp_path):
    """--completion-from-planner measures 2% above and 2.5% below the planner's largest completion
    (largest first), multiples of the granularity, a bracket within 5% when both land on either side;
    the plan used is the one recorded (trials fail at once here: --simulate-capacity)."""
    planner_bracket = load_bench_module("grpo").planner_bracket

    hi, lo = planner_bracket(444_677, 256)
    assert hi % 256 == 0 and lo % 256 == 0 and lo < 444_677 < hi and hi / lo < 1.05
    assert abs(hi - 1.02 * 444_677) < 256 and abs(lo - 0.975 * 444_677) < 256
    assert planner_bracket(10, 16) == [16, 16]  # never below one granule
    out = tmp_path / "edge.json"
    proc = run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", "swiftune", "--share-prompt",
                      "--completion-from-planner", "--simulate-capacity", "1", "--out", str(out))
    r = json.loads(out.read_text())
    planned = r["planner"]["completion"]
    trials = r["modes"]["swiftune"]["trials"]
    assert [t["completion"] for t in trials] == planner_bracket(planned, 16)
    assert all(t["status"] == "oom" for t in trials) and r["modes"]["swiftune"]["status"] == "fixed_only"
    assert f"{planned:,} completion tokens per row fit" in proc.stdout


def test_grpo_bisect_resumes_after_the_process_is_killed(tmp_path):
    """A trial that kills the process (host memory) counts as not fitting; a new process resumes."""
    out = tmp_path / "killed.json"
    proc = run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", "hf_full_logits",
                      "--simulate-kill-above", "1400", "--bisect-lo", "256", "--bisect-hi", "512", "--out", str(out))
    assert "resuming" in proc.stdout
    res = json.loads(out.read_text())["modes"]["hf_full_logits"]
    killed = [t["completion"] for t in res["trials"] if t["status"] == "oom_killed"]
    assert killed and all(2 * (256 + n) > 1400 for n in killed)
    # 2 x (256 + L) <= 1400: L <= 444
    assert res["status"] == "converged" and res["max_fit"] <= 444 < res["first_fail"] <= res["max_fit"] * 1.05 + 16


def test_loss_curve_tiny_curves_coincide(loss_curve_json):
    r = json.loads(loss_curve_json.read_text())
    for key in ("max_abs_diff", "max_rel_diff", "abs_diff", "same_data", "same_init", "modes", "steps"):
        assert key in r, key
    assert r["same_data"] and r["same_init"]
    base, ours = r["modes"]["hf_padded"]["losses"], r["modes"]["swiftune_packed"]["losses"]
    assert len(base) == len(ours) == 10
    assert r["dtype"] == "float32"
    assert_rows(loss_curve_json, "loss_curve", {"max_abs_diff", "mean_abs_diff", "final_loss", "train_s"})
    assert r["max_rel_diff"] < (1e-3 if torch.cuda.is_available() else 1e-4), r["max_rel_diff"]
    if importlib.util.find_spec("matplotlib"):
        assert os.path.getsize(r["png"]) > 10_000


def test_plots_render_committed_and_smoke_results(tmp_path, grpo_step_json, grpo_bisect_json, loss_curve_json):
    pytest.importorskip("matplotlib")
    files = [*COMMITTED, str(grpo_step_json), str(grpo_bisect_json), str(loss_curve_json)]
    proc = run_script("plots.py", *files, "--outdir", str(tmp_path))
    for f in files:
        png = tmp_path / (os.path.splitext(os.path.basename(f))[0] + ".png")
        assert png.exists() and png.stat().st_size > 10_000, (png, proc.stdout)


def test_merge_bisect_renames_keeps_provenance_and_refuses_other_shapes(tmp_path, grpo_bisect_json):
    merge_bisect = load_bench_module("merge_bisect")
    data = json.loads(grpo_bisect_json.read_text())
    mode = next(iter(data["modes"]))
    other = dict(data, modes={mode: dict(data["modes"][mode], max_fit=12345)}, swiftune_checkpointing="offload_all")
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    out = tmp_path / "merged.json"
    run_script("merge_bisect.py", "--out", str(out), f"{grpo_bisect_json}:{mode}", f"{other_path}:{mode}=second")
    merged = json.loads(out.read_text())
    assert list(merged["modes"]) == [mode, "second"]
    assert merged["modes"][mode]["max_fit"] == data["modes"][mode]["max_fit"]
    assert merged["modes"]["second"]["max_fit"] == 12345 and merged["modes"]["second"]["mode"] == "second"
    assert merged["sources"]["second"]["swiftune_checkpointing"] == "offload_all"
    assert {k: merged[k] for k in merge_bisect.SAME} == {k: data[k] for k in merge_bisect.SAME}
    with pytest.raises(ValueError, match="rows"):
        merge_bisect.merge([("a", data, [(mode, mode)]), ("b", dict(other, rows=8), [(mode, "b")])])
    with pytest.raises(ValueError, match="two modes"):
        merge_bisect.merge([("a", data, [(mode, mode)]), ("b", other, [(mode, mode)])])
    with pytest.raises(ValueError, match="no mode"):
        merge_bisect.merge([("a", data, [("nonexistent", "x")])])
    assert merge_bisect.parse_spec("dir:with/colon.json:a,b=c") == ("dir:with/colon.json", [("a", "a"), ("b", "c")])


def test_merge_bisect_joins_one_modes_trials_from_two_runs(tmp_path, grpo_bisect_json):
    """``MODE=+NAME``: the fit of one run and the first failure of another make one bracket."""
    merge_bisect = load_bench_module("merge_bisect")
    data = json.loads(grpo_bisect_json.read_text())
    mode = next(iter(data["modes"]))

    def run(*trials):
        return dict(data, modes={mode: {"mode": mode, "status": "fixed_only", "max_fit": None, "first_fail": None,
                                        "trials": [{"completion": c, "status": st} for c, st in trials]}})

    fails = run((417, "oom_host"), (398, "oom_host"))
    fits = run((380, "ok"))
    paths = [tmp_path / "fails.json", tmp_path / "fits.json"]
    for path, d in zip(paths, (fails, fits)):
        path.write_text(json.dumps(d))
    out = tmp_path / "merged.json"
    run_script("merge_bisect.py", "--out", str(out), f"{paths[1]}:{mode}=swift", f"{paths[0]}:{mode}=+swift")
    merged = json.loads(out.read_text())
    assert list(merged["modes"]) == ["swift"]
    assert_rows(out, "merge_bisect", {"max_fit_completion", "first_fail_completion"})
    joined = merged["modes"]["swift"]
    assert (joined["max_fit"], joined["first_fail"], joined["status"]) == (380, 398, "joined")
    assert [t["completion"] for t in joined["trials"]] == [380, 417, 398]
    assert merged["sources"]["swift"]["file"] == str(paths[1])
    assert [j["file"] for j in merged["sources"]["swift"]["joined"]] == [str(paths[0])]
    # a failure below the fit does not bound it; without a failure above, the first run's status stays
    alone = merge_bisect.joined_mode(fits["modes"][mode], run((100, "oom"))["modes"][mode])
    assert (alone["max_fit"], alone["first_fail"], alone["status"]) == (380, None, "fixed_only")
    with pytest.raises(ValueError, match="earlier file"):
        merge_bisect.merge([("a", fits, [(mode, mode)]), ("b", fails, [(mode, "+other")])])
    with pytest.raises(ValueError, match="no mode"):
        merge_bisect.merge([("a", fits, [(mode, mode)]), ("b", fails, [("nonexistent", "+" + mode)])])


def test_merge_longctx_runs_keeps_each_modes_rows_and_document_length(tmp_path):
    merge_bisect = load_bench_module("merge_bisect")
    plots = load_bench_module("plots")
    one = {"device": "GPU", "args": {"model": "m", "doc_tokens": 0},
           "rows": [{"mode": "trl_liger", "tokens": t, "status": s} for t, s in ((1024, "ok"), (2048, "oom"))]}
    docs = {"device": "GPU", "args": {"model": "m", "doc_tokens": 8192, "host_bytes": 7},
            "rows": [{"mode": "offload", "tokens": 4096, "status": "ok"}, {"mode": "ckpt", "tokens": 1, "status": "ok"}]}
    paths = []
    for i, d in enumerate((one, docs)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(d))
    out = tmp_path / "merged.json"
    run_script("merge_bisect.py", "--out", str(out), f"{paths[0]}:trl_liger", f"{paths[1]}:offload=swiftune")
    merged = json.loads(out.read_text())
    assert [(r["mode"], r["tokens"], r["status"]) for r in merged["rows"]] == [
        ("trl_liger", 1024, "ok"), ("trl_liger", 2048, "oom"), ("swiftune", 4096, "ok")]  # not ckpt
    assert merged["args"]["model"] == "m" and merged["device"] == "GPU"
    assert merged["sources"]["swiftune"] == {"file": str(paths[1]), "mode": "offload", "doc_tokens": 8192,
                                             "host_bytes": 7, "device": "GPU"}
    assert plots.kind_of(merged) == "longctx"
    assert plots.doc_note(merged, "trl_liger") == " (one sequence)"
    assert plots.doc_note(merged, "swiftune") == " (8K-token documents)" and plots.doc_note(docs, "offload") == ""
    with pytest.raises(ValueError, match="model"):
        merge_bisect.merge_rows([("a", one, [("trl_liger", "a")]), ("b", dict(docs, args={"model": "n"}),
                                                                     [("offload", "b")])])
    with pytest.raises(ValueError, match="no mode"):
        merge_bisect.merge_rows([("a", one, [("offload", "a")])])


def test_sft_benchmark_tiny_every_swiftune_mode_and_the_padded_baseline(tmp_path):
    out = tmp_path / "sft.json"
    modes = ["hf_padded", "swiftune", "swiftune_budget", "swiftune_budget_offload"]
    proc = run_script("sft.py", "--model", "tiny", "--batch", "2", "--steps", "3", "--warmup", "1",
                      "--modes", *modes, "--budget", "256", "--max_length", "128", "--time-profile",
                      "--out", str(out))
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == set(modes) and not any("error" in r for r in rows.values()), proc.stdout[-2000:]
    assert rows["hf_padded"]["padding_fraction"] > 0
    assert all(rows[m]["padding_fraction"] == 0 and rows[m]["tokens_per_s"] > 0 for m in modes[1:])
    assert "x hf_padded" in proc.stdout.splitlines()[-5]  # the table is printed last
    assert all(0 < r["trainable_fraction"] < 0.2 and r["finetune"] == "lora r=16" for r in rows.values())
    assert not any("time_profile" in r for r in rows.values())  # --time-profile is CUDA's: a no-op here
    # every layer input of the offloaded mode went to the host (budget 0); the others carry no placement
    n_layers = rows["swiftune_budget_offload"]["offload"]["kept"] + rows["swiftune_budget_offload"]["offload"]["offloaded"]
    assert rows["swiftune_budget_offload"]["offload"]["kept"] == 0 and n_layers > 0
    assert not any("offload" in rows[m] for m in ("hf_padded", "swiftune", "swiftune_budget"))
    result_rows = assert_rows(out, "sft", {"tokens_per_s", "peak_gb", "step_s", "padding_fraction"})
    assert {r.mode for r in result_rows} == set(modes)
    assert {r.tool for r in result_rows} == {"transformers+peft", "swiftune"}
    tps = {r.mode: r.value for r in result_rows if r.metric == "tokens_per_s"}
    assert tps == pytest.approx({m: rows[m]["tokens_per_s"] for m in modes})  # the JSON's figures, unchanged


def test_sft_benchmark_host_profile_of_one_step(tmp_path):
    out = tmp_path / "sft_host.json"
    proc = run_script("sft.py", "--model", "tiny", "--batch", "2", "--steps", "3", "--warmup", "2",
                      "--modes", "swiftune", "--max_length", "128", "--host-profile", "--out", str(out))
    (row,) = json.loads(out.read_text())
    hp = row["host_profile"]
    assert hp["host_ms"] > 0 and {g["group"] for g in hp["groups"]} >= {"swiftune", "peft"}
    assert "# host time of swiftune batch 2" in proc.stdout


def test_sft_benchmark_full_fine_tuning_trains_every_weight(tmp_path):
    out = tmp_path / "sft_full.json"
    modes = ["hf_padded", "swiftune", "swiftune_budget_offload"]
    proc = run_script("sft.py", "--model", "tiny", "--batch", "2", "--steps", "2", "--warmup", "1", "--full",
                      "--modes", *modes, "--budget", "256", "--max_length", "128", "--logit-chunk-tokens", "64",
                      "--out", str(out))
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == set(modes) and not any("error" in r for r in rows.values()), proc.stdout[-2000:]
    assert all(r["trainable_fraction"] == 1.0 and r["finetune"] == "full" for r in rows.values())
    # the loss chunk is swiftune's setting: recorded on its rows, not on the baseline's
    assert [rows[m].get("logit_chunk_tokens") for m in modes] == [None, 64, 64]


def test_longctx_trl_mode_trains_the_same_loss_as_the_baseline(tmp_path):
    """The TRL baseline (TRL's fused LM head, -mean log-prob) computes the loss of plain transformers'
    full-logits cross entropy on the same model and tokens (one document: 256 tokens < 512)."""
    pytest.importorskip("trl")
    out = tmp_path / "longctx_trl.json"
    run_script("longctx.py", "--model", "tiny", "--tokens", "256", "--modes", "baseline", "trl", "--out", str(out))
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["trl"]["status"] == rows["baseline"]["status"] == "ok"
    assert rows["trl"]["loss"] == pytest.approx(rows["baseline"]["loss"], rel=1e-5)


def test_longctx_tiny_rows_and_replan(tmp_path):
    out = tmp_path / "longctx.json"
    run_script("longctx.py", "--model", "tiny", "--tokens", "256", "1024", "--modes", "baseline", "ckpt",
               "offload", "offload_all", "--repeats", "2", "--out", str(out))
    data = json.loads(out.read_text())
    rows = {(r["mode"], r["tokens"]): r for r in data["rows"]}
    assert all(rows[(m, t)]["status"] == "ok" for m in ("baseline", "ckpt", "offload", "offload_all")
               for t in (256, 1024))
    assert rows[("offload_all", 1024)]["kept"] == 0 and rows[("offload", 1024)]["offloaded"] == 0
    assert "time_vs_ckpt" in rows[("offload_all", 1024)] and "pred_allocated" in rows[("ckpt", 1024)]
    result_rows = assert_rows(out, "longctx", {"fits", "step_s", "planned_gb"})  # no peak_gb on CPU
    assert {(r.mode, r.settings["tokens"]) for r in result_rows if r.metric == "step_s"} == set(rows)
    # --replan rewrites only the planner's columns
    before = json.loads(out.read_text())
    for r in before["rows"]:
        r["pred_allocated"] = 1
    out.write_text(json.dumps(before))
    run_script("longctx.py", "--replan", str(out), "--gpu-bytes", "8e9")
    after = json.loads(out.read_text())
    for a, b in zip(before["rows"], after["rows"]):
        assert a.get("step_s") == b.get("step_s") and a.get("peak_allocated") == b.get("peak_allocated")
    assert after["rows"][0]["pred_allocated"] > 1 and after["gpu_bytes"] == (data["gpu_bytes"] or int(8e9))


def test_longctx_search_from_the_planner_brackets_within_five_percent():
    """The planner-guided search: two trials around the planner's answer, 5% steps out of the
    bracket when the planner was off, then bisection to 5% of the largest fit."""
    import argparse

    longctx = load_bench_module("longctx")
    from swiftune.memory import max_tokens

    from benchmarks.workload import MODEL_SHAPES

    args = argparse.Namespace(kv_expanded=True, tile_projections=True, mlp_tile=None, autocast=True,
                              bisect_granularity=1024, bisect_tol=0.05)
    args.host_bytes = int(120e9)  # what the run measured at its start
    (low, high), best = longctx.planner_bracket("qwen3-8b", "offload", int(150e9), args)
    assert best == max_tokens(dict(MODEL_SHAPES["qwen3-8b"]), int(150e9), 16,
                              **dict(longctx._plan_kwargs("offload", args), host_bytes=int(120e9)))
    assert low % 1024 == high % 1024 == 0 and low < best < high and longctx.bisect_done(low, high, args)
    assert not longctx.bisect_done(low, int(low * 1.06), args)
    rows = [{"mode": "offload", "tokens": low, "status": "ok"}, {"mode": "offload", "tokens": high, "status": "ok"}]
    grown = longctx.next_size_to_bracket(rows, "offload")
    assert grown == int(high * 1.05) // 1024 * 1024
    rows = [{"mode": "offload", "tokens": low, "status": "oom"}]
    assert longctx.next_size_to_bracket(rows, "offload") == int(low * 0.95) // 1024 * 1024
    rows.append({"mode": "offload", "tokens": int(low * 0.95), "status": "ok"})
    assert longctx.next_size_to_bracket(rows, "offload") is None and longctx.next_size_to_bracket([], "x") is None
    # the swiftune step is planned as it runs: bf16 autocast, LoRA input copies off
    assert longctx._plan_kwargs("offload", args)["lora_input_casts"] is False
    assert "autocast" not in longctx._plan_kwargs("baseline", args)
    # and with the kernel the runtime is told (per-document sdpa on CUDA): documents or one sequence
    args.attention_kernel, args.doc_tokens = "sdpa", 8192
    kw = longctx._plan_kwargs("offload", args)
    assert (kw["kv_expanded"], kw["float32_dq_tokens"], kw["attention_out_copy"]) == (False, 8192, True)
    assert longctx.planner_bracket("qwen3-8b", "offload", int(150e9), args)[1] > best
    args.doc_tokens = 0
    assert longctx._plan_kwargs("offload", args)["float32_dq_tokens"] is None  # the whole row
    assert longctx._plan_kwargs("trl_liger", args)["kv_expanded"] is True  # baselines: not swiftune's runtime


def test_longctx_bracket_from_a_line_through_the_two_largest_rows():
    """TRL + Liger's search: the line through the two largest fitting rows' reserved memory gives
    where the GPU fills; two trials around it, 5% steps out when both fit or both fail."""
    longctx = load_bench_module("longctx")
    gen = torch.Generator().manual_seed(3)
    fixed, per_token = 17e9 + float(torch.rand(1, generator=gen)) * 1e9, 3e5 + float(torch.rand(1, generator=gen)) * 2e5
    rows = [{"mode": "trl_liger", "tokens": t, "status": "ok", "peak_reserved": fixed + per_token * t}
            for t in (16384, 32768, 65536)]
    rows.insert(0, {"mode": "trl_liger", "tokens": 8192, "status": "ok", "peak_reserved": 1e12})  # not used: not among the two largest
    gpu, margin = int(150e9), 2**30
    (low, high), best = longctx.fit_bracket(rows, "trl_liger", gpu, margin)
    assert best == pytest.approx((gpu - margin - fixed) / per_token, abs=2)
    assert low == int(best * 0.975) // 1024 * 1024 and high == int(best * 1.02) // 1024 * 1024
    assert longctx.fit_bracket(rows[:2], "trl_liger", gpu) is None  # a falling line (8192's outlier): no answer
    assert longctx.fit_bracket(rows[2:3], "trl_liger", gpu) is None  # one row: no line
    flat = [dict(r, peak_reserved=20e9) for r in rows]
    assert longctx.fit_bracket(flat, "trl_liger", gpu) is None and longctx.fit_bracket(rows, "other", gpu) is None

    def searching(limit: int, first: list[int], budget: int = 99):
        tried = []

        def trial(n):
            tried.append(n)
            return {"mode": "m", "tokens": n, "status": "ok" if n <= limit else "oom"}
        return longctx.bracket_search(first, "m", trial, lambda: len(tried) < budget), tried

    done, tried = searching(150_000, [146_432, 152_576])  # the line was right: two trials
    assert tried == [146_432, 152_576] and [r["status"] for r in done] == ["ok", "oom"]
    done, tried = searching(200_000, [146_432, 152_576])  # too low: 5% steps up until one fails
    assert tried[:2] == [146_432, 152_576] and done[-1]["status"] == "oom" and done[-2]["status"] == "ok"
    assert all(b == int(a * 1.05) // 1024 * 1024 for a, b in zip(tried[1:], tried[2:]))
    done, tried = searching(120_000, [146_432, 152_576])  # too high: the second trial is skipped, 5% steps down
    assert tried[0] == 146_432 and 152_576 not in tried and done[-1]["status"] == "ok"
    assert all(r["status"] == "oom" for r in done[:-1])
    done, tried = searching(120_000, [146_432, 152_576], budget=1)  # out of time after one trial
    assert tried == [146_432]
    # the planner's path: its two sizes already measured (known), steps out from them
    known = [{"mode": "m", "tokens": 100_352, "status": "ok"}, {"mode": "m", "tokens": 104_448, "status": "ok"}]
    done, tried = searching(112_000, [], budget=99)
    assert tried == [] and done == []  # nothing known, nothing to step from
    done = longctx.bracket_search([], "m", lambda n: tried.append(n) or {"mode": "m", "tokens": n,
                                                                        "status": "ok" if n <= 112_000 else "oom"},
                                  lambda: True, known=known)
    assert tried == [int(104_448 * 1.05) // 1024 * 1024, int(int(104_448 * 1.05) // 1024 * 1024 * 1.05) // 1024 * 1024]
    assert [r["status"] for r in done] == ["ok", "oom"]


def test_longctx_plans_offload_rows_with_the_host_memory_the_run_started_with():
    """The offload rows' planner columns use the host memory measured once at the start (the
    pinned pool of the run's own trials must not shrink it): layer inputs the host cannot hold
    are planned as derived, as the runtime derives them; without a host figure, none are."""
    import argparse

    longctx = load_bench_module("longctx")
    from swiftune.memory import plan_memory

    from benchmarks.workload import MODEL_SHAPES

    args = argparse.Namespace(kv_expanded=True, tile_projections=True, mlp_tile=None, autocast=True,
                              host_bytes=int(118.1e9))
    row = longctx.predict("llama3-8b", 720896, "offload", int(150.1e9), args)
    ref = plan_memory(dict(MODEL_SHAPES["llama3-8b"]), 720896, 16, gpu_bytes=int(150.1e9),
                      **dict(longctx._plan_kwargs("offload", args), host_bytes=int(118.1e9)))
    assert (row["pred_kept"], row["pred_derived"], row["pred_host"]) == (ref.kept_layers, ref.derived_layers,
                                                                         ref.host_bytes)
    assert row["pred_derived"] > 0 and row["pred_host"] <= args.host_bytes  # the host holds what it can
    args.host_bytes = None
    unlimited = longctx.predict("llama3-8b", 720896, "offload", int(150.1e9), args)
    assert unlimited["pred_derived"] == 0 and unlimited["pred_host"] > int(118.1e9)
    assert unlimited["pred_kept"] == row["pred_kept"]  # the GPU split does not depend on the host


def test_longctx_memory_profile_flag_runs_on_cpu(tmp_path):
    """--memory-profile is CUDA-only: on CPU the rows are the same rows, without a profile."""
    out = tmp_path / "longctx_profile.json"
    run_script("longctx.py", "--model", "tiny", "--tokens", "256", "--modes", "offload", "--memory-profile",
               "--out", str(out))
    data = json.loads(out.read_text())
    assert data["args"]["memory_profile"] is True and data["args"]["host_bytes"] is None
    assert [r["status"] for r in data["rows"]] == ["ok"] and "peak_profile" not in data["rows"][0]


def test_longctx_swiftune_step_under_autocast_matches_the_float32_step():
    """The bf16 step (autocast, LoRA input casts off) trains the same loss as the float32 one, to
    bf16 precision, and leaves PEFT's casting switched back on."""
    import swiftune

    longctx = load_bench_module("longctx")
    device = torch.device("cpu")
    losses = []
    for autocast in (False, True):
        torch.manual_seed(0)
        model = longctx.build_model("tiny", "offload", device, 16, True)  # 64 tokens: 4 MLP tiles
        swiftune.patch_model(model, kernel_backend="reference")  # not the Triton interpreter: seconds, not minutes
        longctx.set_checkpointing(model, "offload")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        batch = longctx.make_batch(64, model.config.vocab_size, 32, device)
        losses.append([longctx.step(model, "offload", batch, opt, autocast=autocast) for _ in range(2)])
        layer = next(m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled") and hasattr(m, "lora_A"))
        assert layer.cast_input_dtype_enabled
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


@pytest.mark.parametrize("path", LONGCTX_RESULTS, ids=os.path.basename)
def test_committed_longctx_results_carry_the_current_planner(tmp_path, path):
    """docs/benchmarks.md quotes the planner columns of these files: they must be what the
    planner says today (after a planner change: python benchmarks/longctx.py --replan FILE)."""
    copy = tmp_path / os.path.basename(path)
    copy.write_text(open(path).read())
    run_script("longctx.py", "--replan", str(copy))
    committed, now = json.loads(open(path).read()), json.loads(copy.read_text())
    for a, b in zip(committed["rows"], now["rows"]):
        assert a.get("pred_allocated") == b.get("pred_allocated"), (a["mode"], a["tokens"])
        assert a.get("pred_kept") == b.get("pred_kept")


def test_rollout_tiny_checks_ab_rows_and_log_round_trip(tmp_path):
    out, log = tmp_path / "rollout.json", tmp_path / "rollout.txt"
    proc = run_script("rollout.py", "--model", "tiny", "--ab-fused-rows", "2", "--lora-rows", "2", "--out", str(out))
    log.write_text(proc.stdout)
    r = json.loads(out.read_text())
    assert r["checks"]["tiny"]["graph_equals_eager_greedy"] and r["checks"]["tiny"]["graph_equals_eager_sampled"]
    assert {(x["rows"], x["new_tokens"]) for x in r["runs"]} == {(2, 16), (4, 16), (2, 32), (4, 32)}
    assert [(x["rows"], x["fused_layers"]) for x in r["fused_ab"]] == [(2, True), (2, False)]
    assert [x["lora"] for x in r["lora"]] == ["runtime", "merge"]
    assert all("speedup_vs_generate_static" in x for x in r["runs"])
    # the JSON rebuilt from the printed lines (for logs of runs killed by a time limit) has the same rows
    again = tmp_path / "again.json"
    run_script("rollout.py", "--from-log", str(log), "--out", str(again))
    b = json.loads(again.read_text())
    assert len(b["runs"]) == len(r["runs"]) and len(b["fused_ab"]) == 2 and len(b["lora"]) == 2
    # --merge: the rows of several saved runs in one file (the plot of N=1,024 and N=8,192 together)
    merged = tmp_path / "merged.json"
    run_script("rollout.py", "--merge", str(out), str(again), "--out", str(merged))
    m = json.loads(merged.read_text())
    assert len(m["runs"]) == len(r["runs"]) + len(b["runs"]) and len(m["fused_ab"]) == 4
    assert all(x["fast"]["fused_layers"] for x in r["runs"])  # the engine's default
    assert_rows(out, "rollout", {"tokens_per_s", "step_ms"})
    assert_rows(merged, "rollout", {"tokens_per_s", "step_ms"})
    b["device"] = "another GPU"
    again.write_text(json.dumps(b))
    with pytest.raises(AssertionError, match="differs"):
        run_script("rollout.py", "--merge", str(out), str(again), "--out", str(merged))


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-gpt-oss"])
def test_moe_decode_tiny_rows(tmp_path, model):
    """benchmarks/moe_decode.py on the tiny Qwen3-MoE and gpt-oss shapes (CPU: both paths eager, the
    kernel column the reference loop): its checks pass and it writes both paths' times and the HBM
    floor as rows."""
    out = tmp_path / "moe_decode.json"
    run_script("moe_decode.py", "--model", model, "--tokens", "4,64", "--iters", "2", "--out", str(out))
    r = json.loads(out.read_text())
    assert [(x["path"], x["tokens"]) for x in r["rows"]] == [("grouped_mm", 4), ("kernel", 4), ("grouped_mm", 64),
                                                            ("kernel", 64)]
    assert all(x["vs_reference"] < 1e-2 and x["floor_ms"] > 0 for x in r["rows"])
    assert_rows(out, "moe_decode", {"ms", "hbm_floor_ms", "copy_fraction"})


def test_memory_profile_finds_the_blocks_alive_at_the_peak():
    """The two-pass replay against a brute-force one (copy of the live set after every event) on
    random alloc/free traces, including frees of blocks allocated before recording began."""
    mp = load_bench_module("memory_profile")
    gen = torch.Generator().manual_seed(0)
    sites = [[{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": f"/w/swiftune/layer{k}.py", "line": 10 + k, "name": f"f{k}"}] for k in range(5)]
    for trial in range(20):
        trace, live, next_addr = [], {}, 1000
        pre = {i: int(torch.randint(1, 50, (1,), generator=gen)) for i in range(3)}  # before recording
        for _ in range(200):
            if live and (torch.rand(1, generator=gen) < 0.45 or len(live) > 30):
                addr = list(live)[int(torch.randint(len(live), (1,), generator=gen))]
                trace.append({"action": "free_requested", "addr": addr, "size": live[addr]})
                trace.append({"action": "free_completed", "addr": addr, "size": live.pop(addr)})
            elif pre and torch.rand(1, generator=gen) < 0.05:
                addr, size = pre.popitem()
                trace.append({"action": "free_completed", "addr": addr, "size": size})
            else:
                size = int(torch.randint(1, 100, (1,), generator=gen))
                k = int(torch.randint(5, (1,), generator=gen))
                trace.append({"action": "alloc", "addr": next_addr, "size": size, "frames": sites[k]})
                live[next_addr] = size
                next_addr += 1
        # reference: level and live set after every event, the first maximum wins
        level, best, best_live, cur = 0, 0, {}, {}
        for ev in trace:
            if ev["action"] == "alloc":
                cur[ev["addr"]] = ev
                level += ev["size"]
            elif ev["action"] == "free_completed":
                level -= ev["size"]
                cur.pop(ev["addr"], None)
            if level > best:
                best, best_live = level, dict(cur)
        peak, alive = mp.blocks_at_peak(trace)
        assert peak == best and sorted(e["addr"] for e in alive) == sorted(best_live), trial
        report = mp.peak_breakdown(trace, bytes_before=10**9, top=2)
        by_site: dict = {}
        for ev in best_live.values():
            site = mp.allocation_site(ev["frames"])
            by_site[site] = by_site.get(site, 0) + ev["size"]
        want = sorted(by_site.values(), reverse=True)
        assert [round(s["gb"] * 1e9) for s in report["sites"][:2]] == want[:2]
        assert round(sum(s["gb"] for s in report["sites"]) * 1e9) == sum(want)
        assert report["step_peak_gb"] == (10**9 + best) / 1e9
    # the site is the innermost frame outside torch
    assert mp.allocation_site(sites[3]) == "f3 (layer3.py:13)"


def test_time_profile_sums_device_time_by_kind():
    """Per-kind sums and the top list against sums written out over random kernel times."""
    tp = load_bench_module("time_profile")
    gen = torch.Generator().manual_seed(1)
    names = {"attention": ["flash_fwd_kernel<...>", "triton_tem_fused_flex_attention_0", "fmha_cutlassF"],
             "matmul": ["nvjet_tst_128x256_64x4", "sm90_xmma_gemm_bf16bf16", "ampere_bf16_s16816gemm"],
             "copy host<->device": ["Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"],
             "copy device": ["Memcpy DtoD (Device -> Device)", "Memset (Device)"],
             tp.TRITON: ["_rms_norm_fwd_kernel", "triton_poi_fused_mul_0"],
             tp.OTHER: ["void at::native::vectorized_elementwise_kernel<4>", "reduce_kernel<512>"]}
    events, want = [], {}
    for kind, ks in names.items():
        for n in ks:
            us = float(torch.randint(1, 10_000, (1,), generator=gen))
            events.append((n, us, int(torch.randint(1, 9, (1,), generator=gen))))
            want[kind] = want.get(kind, 0.0) + us
            assert tp.kind_of(n) == kind, n
    events.append(("cudaDeviceSynchronize", 0.0, 1))  # no device time: left out
    p = tp.summarise(events, top=4)
    total = sum(want.values())
    assert p["device_ms"] == pytest.approx(total / 1e3)
    assert {k["kind"]: k["ms"] for k in p["kinds"]} == pytest.approx({k: us / 1e3 for k, us in want.items()})
    assert [k["ms"] for k in p["kinds"]] == sorted((k["ms"] for k in p["kinds"]), reverse=True)
    assert sum(k["share"] for k in p["kinds"]) == pytest.approx(1.0)
    assert [t["ms"] for t in p["top"]] == sorted((us / 1e3 for _, us, _ in events), reverse=True)[:4]
    assert p["launches"] == sum(c for _, us, c in events if us > 0)
    assert "attention" in tp.format_profile(p, "x")
    # against a step's wall time: the share of it the device was busy
    p["step_wall_ms"] = 4 * p["device_ms"]
    assert "device busy 25%" in tp.format_profile(p, "x") and f"{p['launches']:,} kernels" in tp.format_profile(p)


def test_host_profile_sums_own_time_by_library():
    """Per-group sums and the top list against sums written out over random own times; then the
    context manager over a real body: its own functions are found, with their call counts."""
    tp = load_bench_module("time_profile")
    gen = torch.Generator().manual_seed(2)
    files = {"swiftune": "/x/src/swiftune/models/forwards.py", "peft": "/v/site-packages/peft/tuners/lora/layer.py",
             "transformers": "/v/site-packages/transformers/models/qwen3/modeling_qwen3.py",
             "torch (Python)": "/v/site-packages/torch/utils/checkpoint.py", tp.BUILTIN: "~",
             "triton (launchers)": "/v/site-packages/triton/runtime/jit.py", tp.HOST_OTHER: "/usr/lib/python3.11/json/encoder.py"}
    entries, want = [], {}
    for i, (group, f) in enumerate(files.items()):
        for j in range(2):
            t = float(torch.rand(1, generator=gen))
            entries.append((f, 10 * i + j, f"fn{i}{j}", t, 3 + j))
            want[group] = want.get(group, 0.0) + t
        assert tp.host_group_of(f) == group, f
    p = tp.summarise_host(entries, top=3)
    assert p["host_ms"] == pytest.approx(1e3 * sum(want.values()))
    assert {g["group"]: g["ms"] for g in p["groups"]} == pytest.approx({g: 1e3 * t for g, t in want.items()})
    assert [t["ms"] for t in p["top"]] == sorted((1e3 * e[3] for e in entries), reverse=True)[:3]
    assert p["calls"] == sum(e[4] for e in entries) and sum(g["share"] for g in p["groups"]) == pytest.approx(1.0)

    def busy(n):
        return sum(i * i for i in range(n))

    r = {}
    with tp.host_time_profile(r):
        for _ in range(7):
            busy(20_000)
    hp = r["host_profile"]
    mine = [t for t in hp["top"] if t["function"].startswith("busy ")]
    assert mine and mine[0]["calls"] == 7 and 0 < hp["host_ms"] <= hp["wall_ms"] * 1.05
    assert "top functions" in tp.format_host_profile(hp, "x")


def test_step_context_callback_wraps_exactly_the_chosen_step():
    """The profilers' Trainer callback: the context is entered as step ``k`` begins and left as it
    ends (global_step counts finished steps, so step k begins at k - 1), once."""
    import contextlib
    from types import SimpleNamespace

    workload = load_bench_module("workload")
    events = []

    @contextlib.contextmanager
    def probe():
        events.append("enter")
        yield
        events.append("exit")

    cb = workload.step_context_callback(3, probe)
    for finished in range(6):  # the Trainer's order: begin at global_step = k - 1, end at k
        cb.on_step_begin(None, SimpleNamespace(global_step=finished), None)
        events.append(f"step {finished + 1}")
        cb.on_step_end(None, SimpleNamespace(global_step=finished + 1), None)
    assert events == ["step 1", "step 2", "enter", "step 3", "exit", "step 4", "step 5", "step 6"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_time_profile_puts_a_large_matmul_first():
    tp = load_bench_module("time_profile")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    r: dict = {}
    with tp.device_time_profile(r):
        for _ in range(5):
            a @ a
        a.float().sum()
    assert r["profile"]["kinds"][0]["kind"] == "matmul" and r["profile"]["kinds"][0]["share"] > 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_profile_names_the_line_that_held_the_peak():
    mp = load_bench_module("memory_profile")
    keep = torch.empty(2**20, device="cuda")  # allocated before: not part of the step
    r: dict = {}
    with mp.peak_profile(r):
        big = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        small = torch.empty(2**20, dtype=torch.uint8, device="cuda")
        del big
        small.zero_()
    top = r["peak_profile"]["sites"][0]
    assert "test_benchmark_scripts.py" in top["site"] and top["gb"] == pytest.approx(64 * 2**20 / 1e9, rel=0.01)
    assert r["peak_profile"]["before_step_gb"] >= keep.numel() * 4 / 1e9


def test_attention_benchmark_flop_count_and_cpu_refusal():
    """Causal attention FLOPs written out for one case; without CUDA the script says so and exits 2."""
    ab = load_bench_module("attention_backends")
    # 2 documents of 1024 tokens, 4 heads of 64: forward 2 * 4 * 1024^2 * 64 * 4 / 2, backward 2.5x
    assert ab.attention_flops(1024, 2, 4, 64) == 3.5 * (2 * 4 * 1024**2 * 64 * 4 / 2)
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, "-m", "benchmarks.attention_backends"], capture_output=True, cwd=ROOT,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
        assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr


# ------------------------------------------------------------------------------ results as data


def _row(**kw):
    from benchmarks.results import Row

    base = dict(tool="swiftune", mode="swiftune", model="qwen3-8b", settings={"batch": 16}, metric="tokens_per_s",
                value=1.0, unit="tok/s", gpu="NVIDIA H200", versions={"torch": "2.11.0"}, date="2026-12-01",
                command="python -m benchmarks.sft --out x.json")
    return Row(**{**base, **kw})


@pytest.mark.parametrize("bad", [dict(unit="GB"), dict(value=float("nan")), dict(value="7"), dict(tool="mine"),
                                 dict(versions={"transformers": "5"}), dict(versions={"torch": "2", "jax": "0"}),
                                 dict(date="01/12/2026"), dict(command="python3 benchmarks/sft.py"),
                                 dict(metric="speed", unit="tok/s"), dict(settings=[16]), dict(model="")],
                         ids=lambda d: next(iter(d)))
def test_results_schema_refuses_a_row_that_breaks_it(tmp_path, bad):
    from benchmarks.results import read_rows, validate, write_rows

    validate(_row())
    with pytest.raises(ValueError):
        validate(_row(**bad))
    with pytest.raises(ValueError):
        write_rows(str(tmp_path / "bad.jsonl"), [_row(), _row(**bad)])
    good = tmp_path / "good.jsonl"
    write_rows(str(good), [_row(), _row(metric="peak_gb", unit="GB", value=19.4)])
    assert read_rows(str(good)) == [_row(), _row(metric="peak_gb", unit="GB", value=19.4)]
    good.write_text(good.read_text().replace('"unit": "GB"', '"unit": "GB", "extra": 1'))
    with pytest.raises(ValueError, match="fields"):
        read_rows(str(good))


def test_cuda_only_scripts_json_converts_to_valid_rows():
    """kernels, attention_backends, losses and tune_kernels need CUDA: their converters run on the
    committed JSON (or one written out here) instead, through the same path the scripts take."""
    from benchmarks import results

    ctx = results.Context(command="python -m benchmarks.kernels --out k.json", date="2026-12-01", gpu="NVIDIA H200",
                          versions={"torch": "2.11.0", "trl": "1.16.0"})
    for name in ("kernels_h200.json", "attention_backends_h200.json"):
        with open(os.path.join(ROOT, "docs", "results", name)) as f:
            rows = results.rows_from(json.load(f), ctx)
        assert rows and all(results.validate(r) is None for r in rows)
        assert all("trl" not in r.versions for r in rows)  # only where the tool used it
    losses = {"benchmark": "losses", "rows": [
        {"tokens": 8192, "loss": "ce", "method": "plain", "status": "ok", "ms": 42.5, "peak_bytes": 13.9e9},
        {"tokens": 131072, "loss": "ce", "method": "plain", "status": "oom"},
        {"tokens": 8192, "loss": "ce", "method": "swiftune", "status": "ok", "ms": 31.2, "peak_bytes": 1.35e9}]}
    rows = results.rows_from(losses, ctx)
    assert {(r.tool, r.metric, r.value) for r in rows} >= {("transformers+peft", "fits", 0), ("swiftune", "ms", 31.2)}
    tune = {"benchmark": "tune_kernels", "rows": [{"kernel": "glu_fwd", "settings": {"block": 1024}, "tb_per_s": 4.3}]}
    assert [r.value for r in results.rows_from(tune, ctx)] == [4.3]
    with pytest.raises(ValueError):
        results.rows_from({"something": "else"}, ctx)


def test_every_script_with_figures_writes_rows():
    """Each script that measures figures hands them to benchmarks.results (the smoke runs above
    check the rows of the ones that run on CPU)."""
    bench = os.path.join(ROOT, "benchmarks")
    for name in ("sft", "grpo", "longctx", "rollout", "kernels", "losses", "attention_backends", "loss_curve",
                 "tune_kernels", "merge_bisect", "grpo_e2e"):
        with open(os.path.join(bench, f"{name}.py")) as f:
            text = f.read()
        assert f'save("{name}", argv' in text, name
        assert "sys.path" not in text and "issue" not in text.lower(), name


def test_published_rows_are_the_committed_raw_results():
    """docs/results/results.jsonl is what the importer makes of the raw JSON today: neither can
    change without the other (after a change: python -m benchmarks.results import)."""
    from benchmarks.results import import_published, read_rows

    committed = read_rows(os.path.join(ROOT, "docs", "results", "results.jsonl"))
    assert import_published(ROOT) == committed
    for r in committed:
        assert r.command.startswith("python -m benchmarks."), r.command
    # every Qwen3 figure measured without the q/k fix has been measured again (the last, the single 409,600-token
    # sequence, on 2026-12-02): no published row is marked
    assert not [r.settings["figure"] for r in committed if r.settings.get("before_qk_fix")]
    single = [r for r in committed if r.settings["figure"] == "longctx_sweep_qwen3-8b" and r.tool == "swiftune"
              and r.settings.get("run") == "one sequence"]
    assert single and {r.date for r in single} == {"2026-12-02"}
    new = [r for r in committed if r.settings["figure"] == "longctx_largest" and r.model == "qwen3-8b"
           and r.tool == "swiftune" and r.metric == "max_fit_tokens"]
    assert [(r.value, r.date) for r in new] == [(893952, "2026-12-01")]


def test_docs_tables_are_generated_from_the_committed_rows():
    """docs/benchmarks.md's tables are what benchmarks.report renders from the committed rows."""
    from benchmarks import report
    from benchmarks.results import read_rows

    page_path = os.path.join(ROOT, "docs", "benchmarks.md")
    with open(page_path) as f:
        page = f.read()
    tables = report.render_tables(read_rows(os.path.join(ROOT, "docs", "results", "results.jsonl")))
    assert report.rewrite(page, tables) == page, "run python -m benchmarks.report"
    assert {m.group("name") for m in report.BLOCK.finditer(page)} == set(tables)
    assert "| **swiftune** | 16 | 7,672 | 3.20 | 2.43 | 3.03 | 19.4 |" in tables["sft_qwen3-8b_b16"]
    # a changed row changes the page
    rows = read_rows(os.path.join(ROOT, "docs", "results", "results.jsonl"))
    rows[0].value *= 2
    assert report.rewrite(page, report.render_tables(rows)) != page
    for stale in ("session", "/tmp/site", "python3 benchmarks/", "issue "):
        assert stale not in page.lower(), stale
    for png in set(re.findall(r"\(plots/([^)]+\.png)\)", page)):
        assert os.path.exists(os.path.join(ROOT, "docs", "plots", png)), png


def test_unsloth_sft_turns_the_anchors_records_into_sft_rows(tmp_path):
    """benchmarks.unsloth_sft runs the anchor in child processes (here a stand-in printing the
    anchor's RESULT records) and writes benchmarks.sft rows of tool ``unsloth``."""
    from benchmarks import unsloth_sft
    from benchmarks.results import read_rows

    shared = tmp_path / "shared"
    (shared / "anchors").mkdir(parents=True)
    (shared / "anchors" / "unsloth_anchor.py").write_text(
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "if '--save-model-only' in args:\n"
        "    d = args[args.index('--model-dir') + 1]; os.makedirs(d, exist_ok=True)\n"
        "    open(os.path.join(d, 'unsloth_anchor_model.json'), 'w').write('{}')\n"
        "else:\n"
        "    packed = '--packing' in args\n"
        "    m = dict(tokens_per_s=6000.0 if packed else 2500.0, peak_mem_gib=20.0, step_time_ms=1500.0,\n"
        "             padding_fraction=0.0, timed_steps=16)\n"
        "    print('RESULT ' + json.dumps(dict(status='ok', metrics=m, versions=dict(unsloth='2026.10.9'))))\n")
    out = tmp_path / "u.json"
    assert unsloth_sft.main(["--shared", str(shared), "--site", str(tmp_path), "--model-dir", str(tmp_path / "ck"),
                             "--out", str(out)]) == 0
    rows = json.load(open(out))
    assert [r["mode"] for r in rows] == ["unsloth", "unsloth_packed"]
    assert rows[1]["tokens_per_s"] == 6000.0 and abs(rows[0]["peak_gb"] - 20.0 * 2**30 / 1e9) < 1e-9
    result_rows = read_rows(str(tmp_path / "u.rows.jsonl"))
    assert {r.tool for r in result_rows} == {"unsloth"} and all(r.versions["unsloth"] == "2026.10.9" for r in result_rows)
    # an anchor that prints nothing: an error row, not a crash
    (shared / "anchors" / "unsloth_anchor.py").write_text(
        "import os, sys\nargs = sys.argv[1:]\n"
        "if '--save-model-only' in args:\n"
        "    d = args[args.index('--model-dir') + 1]; os.makedirs(d, exist_ok=True)\n"
        "    open(os.path.join(d, 'unsloth_anchor_model.json'), 'w').write('{}')\n"
        "else:\n    sys.exit('CUDA out of memory')\n")
    assert unsloth_sft.main(["--shared", str(shared), "--site", str(tmp_path), "--model-dir", str(tmp_path / "ck"),
                             "--modes", "unsloth", "--out", str(out)]) == 0
    assert "out of memory" in json.load(open(out))[0]["error"]


def test_qlora_benchmark_flags_quantise_every_mode_they_run(tmp_path):
    """--load-in-4bit: the SFT rows say qlora and the model the step ran on held NF4 weights; the
    GRPO bisection runs a QLoRA trial and its planner line counts 4-bit weights (fewer bytes: a
    larger answer than without)."""
    pytest.importorskip("bitsandbytes")
    from benchmarks import grpo

    proc = run_script("sft", "--one", "swiftune", "--model", "tiny", "--batch", "4", "--steps", "3", "--warmup", "1",
                      "--load-in-4bit")
    row = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert row["finetune"] == "qlora r=16" and row["tokens_per_s"] > 0
    import torch

    from benchmarks.workload import quantize_linears_4bit, random_model

    model = random_model("tiny", "cpu", torch.float32)
    quantize_linears_4bit(model, torch.float32)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear4bit" in kinds and type(model.lm_head).__name__ == "Linear"
    args = grpo.build_parser().parse_args(["--bisect-completion", "--model", "qwen3-0.6b", "--share-prompt",
                                           "--gpu-budget-gb", "3.5"])
    plain = grpo.planner_max_completion(args, host_bytes=int(3e9))
    args.load_in_4bit = True
    quantised = grpo.planner_max_completion(args, host_bytes=int(3e9))
    assert plain["gpu_bytes"] == int(3.5e9) and quantised["completion"] > plain["completion"]


def test_grpo_e2e_times_a_whole_step_per_tool_and_reports_failures(tmp_path):
    """benchmarks.grpo_e2e: swiftune's whole GRPOTrainer step (generation to optimizer step) on the
    tiny shape, every completion full length, the phases adding up to the step; TRL's where TRL is
    installed; a tool whose process fails gives an error record, not a crash; the Unsloth mode's
    checkpoint is a plain transformers model + tokenizer that loads back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks import grpo_e2e

    out = tmp_path / "e2e.json"
    modes = ["swiftune"] + (["trl"] if importlib.util.find_spec("trl") else [])
    run_script("grpo_e2e", "--model", "tiny", "--prompts", "2", "--generations", "2", "--prompt-tokens", "8",
               "--completion-tokens", "12", "--micro-batch", "2", "--modes", *modes, "--out", str(out))
    records = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in records] == modes
    for r in records:
        assert "error" not in r, r
        assert r["completions"] == 4 and r["generated_tokens"] == 4 * 12 and r["all_full_length"]
        assert r["phases"]["generation"] > 0 and r["phases"]["policy"] > 0
        assert abs(sum(r["phases"].values()) - r["step_s"]) < 1e-6
    rows = assert_rows(out, "grpo_e2e", {"step_s", "peak_gb", "phase_s"})
    assert {r.settings["phase"] for r in rows if r.metric == "phase_s"} == {"generation", "scoring", "policy", "other"}

    ck = tmp_path / "ck"
    assert grpo_e2e.main(["--save-checkpoint", str(ck), "--model", "tiny"]) == 0
    tok = AutoTokenizer.from_pretrained(str(ck))
    assert tok.eos_token == "t1" and tok("t5 t7")["input_ids"] == [5, 7]
    assert AutoModelForCausalLM.from_pretrained(str(ck)).config.vocab_size == tok.vocab_size

    site = tmp_path / "site"
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text("raise ImportError('Unsloth needs a GPU')\n")
    out = tmp_path / "u.json"
    assert grpo_e2e.main(["--model", "tiny", "--modes", "unsloth", "--site", str(site), "--model-dir", str(ck),
                          "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())["rows"]
    assert record["mode"] == "unsloth" and "Unsloth needs a GPU" in record["error"]


def test_rollout_benchmark_counts_nf4_weight_bytes_for_the_hbm_floor():
    """benchmarks.rollout --load-in-4bit: the floor reads each NF4 weight's packed half-bytes and its
    quantisation state (absmax, and the double quantisation's own), not the bf16 bytes; the rows say nf4."""
    pytest.importorskip("bitsandbytes")
    import torch

    from benchmarks import results, rollout

    model = rollout.build_model("tiny", torch.device("cpu"), torch.float32)
    plain = rollout.weight_bytes(model)
    decoder_linear = sum(m.weight.numel() for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    others = plain - 4 * decoder_linear
    q = rollout.build_model("tiny", torch.device("cpu"), torch.float32, load_in_4bit=True)
    states = sum(rollout.quant_state_bytes(p) for p in q.parameters())
    assert states > 0
    assert rollout.weight_bytes(q) == others + decoder_linear // 2 + states
    ctx = results.Context(command="python -m benchmarks.rollout --load-in-4bit --out r.json", date="2026-12-01",
                          gpu="NVIDIA H200", versions={"torch": "2.11.0"})
    run = {"model": "qwen3-8b", "rows": 8, "new_tokens": 1024, "hbm_floor_ms": 3.0,
           "fast": {"tokens_per_s": 900.0, "step_ms": 8.0, "fused_layers": True}}
    rows = results.rows_from({"benchmark": "rollout", "weights": "nf4", "prompt_tokens": 256, "runs": [run]}, ctx)
    assert rows and all(r.settings["weights"] == "nf4" for r in rows)
    rows = results.rows_from({"benchmark": "rollout", "weights": "bfloat16", "prompt_tokens": 256, "runs": [run]}, ctx)
    assert all("weights" not in r.settings for r in rows)


def test_rollout_benchmark_counts_fp8_weight_bytes_and_decodes_from_them(tmp_path):
    """benchmarks.rollout --load-in-fp8: the floor reads a byte per e4m3 weight plus a float32 scale per
    output row of each decoder projection, not the fp32 / bf16 bytes; a CPU run of the script decodes
    from the FP8 layers (LoRA at run time only: e4m3 weights take no merge) and its JSON says fp8."""
    import torch

    from benchmarks import rollout
    from swiftune.models.fp8_linear import FP8Linear

    model = rollout.build_model("tiny", torch.device("cpu"), torch.float32)
    plain = rollout.weight_bytes(model)
    linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    decoder_linear = sum(m.weight.numel() for m in linears)
    rows = sum(m.out_features for m in linears)
    q = rollout.build_model("tiny", torch.device("cpu"), torch.float32, load_in_fp8=True)
    layers = [m for m in q.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == len(linears) and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert rollout.weight_bytes(q) == plain - 4 * decoder_linear + decoder_linear + 4 * rows
    with pytest.raises(SystemExit):
        rollout.main(["--model", "tiny", "--load-in-4bit", "--load-in-fp8"])
    out = tmp_path / "rollout_fp8.json"
    run_script("rollout.py", "--model", "tiny", "--load-in-fp8", "--rows", "2", "--new-tokens", "8",
               "--lora-rows", "2", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["weights"] == "fp8"
    assert r["checks"]["tiny"]["graph_equals_eager_greedy"]
    assert [(x["rows"], x["new_tokens"]) for x in r["runs"]] == [(2, 8)]
    assert abs(r["runs"][0]["weight_gb"] * 1e9 - rollout.weight_bytes(q)) < 1
    assert [x["lora"] for x in r["lora"]] == ["runtime"]
    assert_rows(out, "rollout", {"tokens_per_s", "step_ms"})
