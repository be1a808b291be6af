"""Smoke tests of the GRPO benchmark scripts (the step, the largest-completion bisection and its merge, the
end-to-end step beside TRL / Unsloth) and of the loss curve and the plots, each in its tiny mode in a
subprocess (tests/bench_helpers.py): the JSON keys the docs and benchmarks.plots read, and result rows
that validate against benchmarks.results' schema."""

import importlib
import importlib.util
import json
import os
import types

import pytest
import torch

from tests.bench_helpers import ROOT, assert_rows, load_bench_module, run_script, stand_in_unsloth_anchor


COMMITTED = [os.path.join(ROOT, "docs", "results", f)
             for f in ("sft_qwen3-8b_b16.json", "sft_qwen3-8b_sweep_h200.json", "longctx_qwen3-8b_32k.json",
                       "longctx_qwen3-8b_sweep_h200.json", "rollout_h200.json", "grpo_step_qwen3-1.7b_h200.json",
                       "grpo_figure3_qwen3-8b_h200.json", "longctx_figure3_llama3-8b_h200.json",
                       "longctx_figure3_qwen3-8b_h200.json")]


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
        failed = [t for t in res["trials"] if t["status"] == "oom"]
        assert failed and all(t["where"][-1].startswith("benchmarks/grpo.py:") for t in failed), failed
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


def test_planner_max_completion_plans_flex_for_attention_sinks():
    """gpt-oss's sinks have no sdpa or varlen path: its rows run flex whatever their length, so the
    planner's answer is the largest row that fits with flex's terms (bf16 dq, K/V heads kept), never
    sdpa's float32 dq, on the shape the GRPO row of the benchmarks uses."""
    import argparse

    from swiftune.attention.backends import planner_attention_terms
    from swiftune.memory import plan_memory

    grpo = load_bench_module("grpo")
    from benchmarks.workload import MODEL_SHAPES

    args = argparse.Namespace(model="gpt-oss-20b", share_prompt=True, prompt_tokens=256, bisect_rows=2)
    gpu, host = int(80e9), int(100e9)
    plan = grpo.planner_max_completion(args, gpu_bytes=gpu, host_bytes=host)
    assert plan["attention"] == "flex" and plan["longest"] is None
    kw = dict(gradient_checkpointing="offload", tiled_projections=True, host_bytes=host, autocast=True,
              lora_input_casts=False)

    def fits(t):
        return plan_memory(dict(MODEL_SHAPES["gpt-oss-20b"]), t, 16, gpu_bytes=gpu, **kw,
                           **planner_attention_terms("flex")).fits

    assert fits(plan["tokens"]) and not fits(plan["tokens"] + 1)
    assert plan["completion"] == (plan["tokens"] - 256) // 2


def test_grpo_bisect_repeats_fixed_trials_and_offloads_every_layer(tmp_path):
    """--trial-repeats reports the last of N steps (the first one's time kept), and
    --swiftune-checkpointing offload_all runs the swiftune step with every layer input offloaded, within a
    --host-budget-gb cap above all of them (recorded with its margin). The same run (one process start
    less for the suite) takes --load-in-fp8 (e4m3 base weights) and --attention-output-layers 1
    --attention-outputs-on-host (the last layer keeps its sdpa outputs through the recompute, in host memory),
    all recorded."""
    out = tmp_path / "repeats.json"
    run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", "swiftune", "--share-prompt",
               "--swiftune-checkpointing", "offload_all", "--trial-repeats", "2", "--fixed-only",
               "--completion-lengths", "96", "--host-budget-gb", "1", "--host-margin-gb", "0", "--load-in-fp8",
               "--attention-output-layers", "1", "--attention-outputs-on-host", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["trial_repeats"] == 2 and r["swiftune_checkpointing"] == "offload_all"
    assert r["host_budget_gb"] == 1.0 and r["host_margin_gb"] == 0.0 and r["attention_output_layers"] == 1
    assert r["attention_outputs_on_host"] is True
    (t,) = r["modes"]["swiftune"]["trials"]
    assert t["status"] == "ok" and t["completion"] == 96 and t["first_s"] > 0 and t["s"] > 0


def test_grpo_bisect_host_budget_caps_the_offloaded_checkpoints(tmp_path):
    """--host-budget-gb reaches swiftune's offloaded checkpoints: with every layer input sent to the
    host, a cap below one input makes the trial fail as out of host memory (a cap above all of them lets
    it run: the test above)."""
    out = tmp_path / "cap.json"
    run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", "swiftune", "--share-prompt",
               "--swiftune-checkpointing", "offload_all", "--fixed-only", "--completion-lengths", "96",
               "--host-budget-gb", "0.000001", "--host-margin-gb", "0", "--out", str(out))
    (starved,) = json.loads(out.read_text())["modes"]["swiftune"]["trials"]
    assert starved["status"] == "oom_host", starved
    # where it failed: swiftune's offloaded checkpointing, named by file and function
    assert any(f.startswith("swiftune/training/") for f in starved["where"]), starved["where"]


def test_grpo_fixed_lengths_skip_what_a_shorter_failure_rules_out(tmp_path):
    """Fixed lengths after one that ran out of memory are not tried (a longer row needs more memory),
    and say why; a shorter one after it still runs; a resumed process's known failure (``hi``) counts."""
    grpo = load_bench_module("grpo")
    assert grpo.shorter_failure([{"completion": 96, "status": "oom"}], 128) == 96
    assert grpo.shorter_failure([{"completion": 96, "status": "oom_killed"}], 64) is None
    assert grpo.shorter_failure([{"completion": 96, "status": "ok"}], 128) is None
    assert grpo.shorter_failure([], 128, hi=112) == 112 and grpo.shorter_failure([], 100, hi=112) is None
    out = tmp_path / "fixed.json"
    run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", "swiftune", "--share-prompt",
               "--fixed-only", "--completion-lengths", "96", "128", "32", "--simulate-capacity", "600",
               "--out", str(out))
    trials = json.loads(out.read_text())["modes"]["swiftune"]["trials"]
    assert [(t["completion"], t["status"]) for t in trials] == [(96, "oom"), (128, "skipped"), (32, "ok")], trials
    assert trials[1]["reason"] == "96 did not fit"


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


def test_grpo_bisect_reports_a_crash_inside_a_trial_as_a_crash(monkeypatch):
    """A child that ends with an error that is not out of memory (exit 1) during a trial is no evidence
    that the length does not fit: the trial says 'crashed' with the child's last lines, and no new child
    resumes from it; only a SIGKILL (the OOM killer) is 'oom_killed' (end to end: the test above)."""
    import subprocess
    import sys

    grpo = load_bench_module("grpo")
    args = grpo.build_parser().parse_args(["--bisect-completion", "--model", "tiny", "--fixed-only"])

    real = subprocess.Popen

    def child(exit_code: int):  # a trial child that starts length 512 and ends without a result
        script = ("import json, os, sys; print('START ' + json.dumps({'completion': 512}), flush=True); "
                  f"print('RuntimeError: something else went wrong', flush=True); os._exit({exit_code})")
        return lambda cmd, **kw: real([sys.executable, "-c", script], **kw)

    monkeypatch.setattr(grpo.subprocess, "Popen", child(1))
    trials, result, killed, tail, code = grpo.launch_mode("swiftune", args, 60.0, None, None, [512])
    assert result is None and killed is None and code == 1
    (t,) = trials
    assert t["status"] == "crashed" and t["completion"] == 512, t
    assert "exit 1" in t["error"] and "RuntimeError: something else went wrong" in t["error"], t
    assert grpo.bracket_from_trials(trials) == (None, None)  # a crash bounds nothing
    monkeypatch.setattr(grpo.subprocess, "Popen", child(137))
    trials, _, killed, _, _ = grpo.launch_mode("swiftune", args, 60.0, None, None, [512])
    assert killed == 512 and trials[0]["status"] == "oom_killed"


def test_grpo_bisect_child_says_where_a_trial_crashed(tmp_path):
    """A trial that raises something other than out of memory (as an illegal memory access does) is
    recorded by the child itself before it ends: status 'crashed', the exception, its innermost frames
    and swiftune's offload counters; the trials before it keep their results, the whole output of the
    child is kept beside --out, and the mode's error holds the traceback, not only its last lines."""
    out = tmp_path / "crash.json"
    # tokens = 2 x (256 + L): 64 -> 640 runs, 96 -> 704 raises (the warm-up, at 64, runs too)
    proc = run_script("grpo.py", "--bisect-completion", "--model", "tiny", "--bisect-modes", "swiftune",
                      "--completion-lengths", "64", "96", "--fixed-only", "--simulate-error-above", "650",
                      "--out", str(out))
    res = json.loads(out.read_text())["modes"]["swiftune"]
    ok, crashed = res["trials"]
    assert ok["completion"] == 64 and ok["status"] == "ok", ok
    assert crashed["completion"] == 96 and crashed["status"] == "crashed", crashed
    assert crashed["error"].startswith("RuntimeError: simulated"), crashed
    assert any(f.startswith("benchmarks/grpo.py:") for f in crashed["where"]), crashed["where"]
    assert {"restored", "derived_recomputed", "offloaded", "kept"} <= set(crashed["offload"]), crashed["offload"]
    assert res["status"] == "crashed" and "Traceback (most recent call last)" in res["error"], res["error"]
    assert "RuntimeError: simulated" in res["error"]
    assert "offload counters" in proc.stdout
    assert "Traceback (most recent call last)" in (tmp_path / "crash.swiftune.log").read_text()
    grpo = load_bench_module("grpo")
    assert grpo.bracket_from_trials(res["trials"]) == (64, None)  # a crash bounds nothing


def test_shape_of_cuts_a_shape_to_its_first_layers():
    """``NAME:layers=N`` (the repro shapes of the GPU suite): NAME's sizes with N decoder layers, the
    per-layer list of a config that has one cut to match, the planner's shape with them; bad names say why."""
    from benchmarks.workload import MODEL_SHAPES, model_config, shape_of
    from swiftune.memory.shapes import model_shape

    cut = shape_of("qwen3-8b:layers=4")
    assert cut == {**MODEL_SHAPES["qwen3-8b"], "num_hidden_layers": 4}
    assert MODEL_SHAPES["qwen3-8b"]["num_hidden_layers"] == 36  # the table itself is left alone
    assert model_shape(cut).layers == 4 and model_shape(shape_of("qwen3-8b")).layers == 36
    oss = model_config("gpt-oss-20b:layers=3")
    assert oss.num_hidden_layers == 3 and len(oss.layer_types) == 3
    assert shape_of("tiny-vl:layers=1")["text_config"]["num_hidden_layers"] == 1
    with pytest.raises(ValueError, match="36 decoder layers"):
        shape_of("qwen3-8b:layers=37")
    with pytest.raises(KeyError, match="unknown model shape 'qwen9'"):
        shape_of("qwen9:layers=2")


def test_failure_summary_keeps_the_traceback_and_counts_repeated_device_assertions():
    from benchmarks.child_output import collapse_repeats, failure_summary

    asserts = [f"/pytorch/aten/src/ATen/native/cuda/IndexKernelUtils.cu:16: vectorized_gather_kernel: block: "
               f"[327,0,0], thread: [{t},0,0] Assertion `ind >=0 && ind < ind_dim_size` failed." for t in range(150)]
    frames = [f'  File "/site-packages/pkg/mod{i}.py", line {i}, in f{i}\n    call_{i}()' for i in range(40)]
    text = "\n".join(["loading...", "step 1", *asserts, "Traceback (most recent call last):", *frames,
                      "torch.AcceleratorError: CUDA error: device-side assert triggered",
                      "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
                      "[W1204 18:36:59.7 CUDAEvent.h:57] Warning: CUDA warning: device-side assert triggered",
                      "[W1204 18:36:59.8 CUDAEvent.h:57] Warning: CUDA warning: device-side assert triggered"])
    s = failure_summary(text, 1500)
    assert len(s) <= 1500
    assert s.startswith("/pytorch/aten/src/ATen/native/cuda/IndexKernelUtils.cu:16") and "[x 150]" in s, s[:400]
    assert s.count("Assertion `") == 1
    # the innermost frames and the exception stay; the outermost frames went to make room
    assert "mod39.py" in s and "call_39()" in s and "mod0.py" not in s and "... " in s
    assert "torch.AcceleratorError: CUDA error: device-side assert triggered" in s
    assert "CUDAEvent.h:57] Warning: CUDA warning: device-side assert triggered [x 2]" in s
    # no traceback: the last lines, repeats collapsed
    assert failure_summary("a\nwarn 1\nwarn 2\nKilled") == "a | warn 1 [x 2] | Killed"
    assert collapse_repeats(["x 1", "y", "x 2"]) == ["x 1 [x 2]", "y"]


def test_host_allocator_failures_count_as_host_memory():
    grpo = load_bench_module("grpo")
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 5536481280 bytes. Error code 12 (Cannot allocate memory)")
    assert grpo._is_host_oom(cpu) and not grpo._is_oom(cpu)
    assert not grpo._is_host_oom(RuntimeError("shape mismatch")) and grpo._is_oom(MemoryError())


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


def test_merge_bisect_device_leaves_out_runs_that_name_none():
    """Unsloth's GRPO JSON names no device: the merged figure's device is the other runs', not "H200 / None"."""
    merge_bisect = load_bench_module("merge_bisect")
    runs = [("a", {"device": "NVIDIA H200"}, []), ("b", {}, []), ("c", {"device": None}, [])]
    assert merge_bisect.merged_device(runs) == "NVIDIA H200"
    assert merge_bisect.merged_device(runs + [("d", {"device": "NVIDIA H100"}, [])]) == "NVIDIA H100 / NVIDIA H200"
    assert merge_bisect.merged_device([("b", {}, [])]) is None


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
    # a merged file merged again (one more trial joined later): its modes keep the provenance recorded there
    # (the runs' settings, e.g. share_prompt), not the merged file's header, which has none
    fits_src = dict(fits, share_prompt=True)
    first = merge_bisect.merge([("fits.json", fits_src, [(mode, "swift")])])
    again = merge_bisect.merge([("merged.json", first, [("swift", "swift")]),
                                ("more.json", run((390, "ok")), [(mode, "+swift")])])
    src = again["sources"]["swift"]
    assert (src["file"], src["via"], src["share_prompt"]) == ("fits.json", "merged.json", True)
    assert [j["file"] for j in src["joined"]] == ["more.json"] and again["modes"]["swift"]["max_fit"] == 390
    # a failure below the fit does not bound it; without a failure above, the first run's status stays
    alone = merge_bisect.joined_mode(fits["modes"][mode], run((100, "oom"))["modes"][mode])
    assert (alone["max_fit"], alone["first_fail"], alone["status"]) == (380, None, "fixed_only")
    with pytest.raises(ValueError, match="earlier file"):
        merge_bisect.merge([("a", fits, [(mode, mode)]), ("b", fails, [(mode, "+other")])])
    with pytest.raises(ValueError, match="no mode"):
        merge_bisect.merge([("a", fits, [(mode, mode)]), ("b", fails, [("nonexistent", "+" + mode)])])


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
    # swiftune's engine reports the KV cache its step's peak includes (the transformers engine on CPU: none);
    # the table gives it a column beside the peak when a row has it
    assert "kv_cache_gb" in records[0] and records[0]["kv_cache_gb"] >= 0
    from benchmarks import report

    rendered = report.grpo_e2e(report.Figure(rows)).splitlines()
    assert rendered[0].split(" | ")[6:8] == ["peak GB", "of which KV cache GB"], rendered[0]
    assert len(rendered) == 2 + len(modes)
    assert {r.settings["phase"] for r in rows if r.metric == "phase_s"} == {"generation", "scoring", "policy", "other"}

    ck = tmp_path / "ck"
    assert grpo_e2e.main(["--save-checkpoint", str(ck), "--model", "tiny"]) == 0
    tok = AutoTokenizer.from_pretrained(str(ck))
    assert tok.eos_token == "t1" and tok("t5 t7")["input_ids"] == [5, 7]
    # pad on eos: min_new_tokens keeps both out of TRL's and Unsloth's completions (Unsloth rebuilds its
    # masks from the pad id, and a sampled pad id broke its rows)
    assert tok.pad_token_id == tok.eos_token_id == 1
    config = grpo_e2e.trl_config(grpo_e2e.build_parser().parse_args(["--completion-tokens", "12"]), False,
                                 lambda **fields: types.SimpleNamespace(**fields))
    assert config.generation_kwargs == {"min_new_tokens": 12}
    assert AutoModelForCausalLM.from_pretrained(str(ck)).config.vocab_size == tok.vocab_size

    site = tmp_path / "site"
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text("raise ImportError('Unsloth needs a GPU')\n")
    out = tmp_path / "u.json"
    assert grpo_e2e.main(["--model", "tiny", "--modes", "unsloth", "--site", str(site), "--model-dir", str(ck),
                          "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())["rows"]
    assert record["mode"] == "unsloth" and "Unsloth needs a GPU" in record["error"]
    # the summary keeps the traceback (where it failed); the whole output is kept beside --out
    assert "Traceback (most recent call last)" in record["error"] and "ImportError" in record["error"], record
    assert "Unsloth needs a GPU" in (tmp_path / "u.unsloth.log").read_text() and record["log"].endswith("u.unsloth.log")


def test_grpo_e2e_keeps_each_finished_tool_when_a_later_one_is_stopped(tmp_path, monkeypatch):
    """The --out file holds every tool that has finished by the time the next one starts (a run stopped
    during TRL's or Unsloth's process keeps swiftune's row), written whole each time."""
    from benchmarks import grpo_e2e

    out = tmp_path / "e2e.json"
    seen = []

    def fake_child(mode, args, extra, env):
        seen.append([r["mode"] for r in json.loads(out.read_text())["rows"]] if out.exists() else None)
        if mode == "unsloth":
            raise KeyboardInterrupt  # the run stopped while this tool ran
        return {"mode": mode, "model": "tiny", "step_s": 1.0, "phases": {"generation": 1.0}, "peak_gb": 0.1}

    monkeypatch.setattr(grpo_e2e, "run_child", fake_child)
    monkeypatch.setattr(grpo_e2e, "unsloth_env_and_dir", lambda args: ({}, str(tmp_path)))
    with pytest.raises(KeyboardInterrupt):
        grpo_e2e.main(["--model", "tiny", "--modes", "swiftune", "trl", "unsloth", "--out", str(out)])
    assert seen == [None, ["swiftune"], ["swiftune", "trl"]]
    assert [r["mode"] for r in json.loads(out.read_text())["rows"]] == ["swiftune", "trl"]
    assert [f.name for f in tmp_path.iterdir()] == ["e2e.json"]  # no partial file left beside it


def test_grpo_bisect_load_in_fp8_builds_fp8_weights_and_plans_their_bytes():
    """--load-in-fp8: the benchmark's model holds e4m3 base weights (its trial runs in the test of
    --trial-repeats above), the planner counts one byte a weight (between NF4's answer and bf16's on the
    same budget), and --load-in-4bit with --load-in-fp8 is refused before any model is built."""
    import subprocess
    import sys

    grpo = load_bench_module("grpo")
    model = grpo.base_model("tiny", torch.device("cpu"), load_in_fp8=True)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "FP8Linear" in kinds and type(model.lm_head).__name__ == "Linear"
    args = grpo.build_parser().parse_args(["--bisect-completion", "--model", "qwen3-8b", "--share-prompt",
                                           "--gpu-budget-gb", "24"])
    plain = grpo.planner_max_completion(args, host_bytes=int(100e9))["completion"]
    args.load_in_fp8 = True
    fp8 = grpo.planner_max_completion(args, host_bytes=int(100e9))["completion"]
    args.load_in_fp8, args.load_in_4bit = False, True
    nf4 = grpo.planner_max_completion(args, host_bytes=int(100e9))["completion"]
    assert plain < fp8 < nf4, (plain, fp8, nf4)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.grpo", "--model", "tiny", "--load-in-4bit", "--load-in-fp8"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "pick one" in proc.stderr


def test_unsloth_grpo_turns_the_anchors_probes_into_a_bisection(tmp_path, monkeypatch):
    """benchmarks.unsloth_grpo runs the anchor in a child process (here a stand-in printing the anchor's
    RESULT records: fixed probes, then a scan's probes and summary) and writes a benchmarks.grpo bisection
    JSON of mode ``unsloth`` (GiB -> GB, the first call apart, OOM probes as failed trials) and its rows."""
    from benchmarks import unsloth_grpo
    from benchmarks.results import read_rows

    shared = tmp_path / "shared"
    stand_in_unsloth_anchor(shared, """
def out(r): print('RESULT ' + json.dumps(dict(r, versions=dict(unsloth='2026.10.9', torch='2.11.0', trl='1.15.0'),
                                             gpu='NVIDIA H200')))
assert args[args.index('--num-generations') + 1] == '2' and '--4bit' in args
def probe(c, scan=False):
    if c > 3100:
        return dict(completion_length=c, status='oom', oom_kind='cuda', mode='grpo', scan_probe=scan)
    return dict(completion_length=c, status='ok', fwd_bwd_s_median=c / 1000, peak_mem_gib=c / 100,
                first_call=dict(fwd_bwd_s=c / 500), mode='grpo', scan_probe=scan)
for c in args[args.index('--completion-length') + 1].split(','):
    out(probe(int(c)))
if '--scan' in args:
    for c in (1024, 2048, 4096, 3072):
        out(probe(c, True))
    out(dict(mode='grpo-scan', status='ok', max_ok_completion_length=3072, min_failed_completion_length=3200,
             stop_reason='oom', probes=[]))
""")
    out = tmp_path / "u.json"
    assert unsloth_grpo.main(["--shared", str(shared), "--site", str(tmp_path), "--model-dir", str(tmp_path / "ck"),
                              "--model", "tiny", "--4bit", "--completion-lengths", "2000", "--scan",
                              "--scan-start", "1024", "--out", str(out)]) == 0
    data = json.load(open(out))
    mode = data["modes"]["unsloth"]
    assert (mode["max_fit"], mode["first_fail"], mode["status"]) == (3072, 3200, "converged")
    # the child's GPU and libraries, under the keys benchmarks.grpo's JSON uses (benchmarks.merge_bisect keeps them)
    assert (data["device"], data["torch"], data["trl"], data["unsloth"]) == ("NVIDIA H200", "2.11.0", "1.15.0",
                                                                            "2026.10.9")
    assert "transformers" not in data  # what the anchor did not name is not made up
    assert data["mem_get_info"] == "card"  # no budget: Unsloth saw the card's own memory
    first = mode["trials"][0]
    assert first["completion"] == 2000 and first["tokens"] == 2 * (256 + 2000)
    assert first["s"] == 2.0 and first["first_s"] == 4.0 and abs(first["peak_gb"] - 20 * 2**30 / 1e9) < 1e-9
    assert [t["status"] for t in mode["trials"]] == ["ok", "ok", "ok", "oom", "ok"]
    rows = read_rows(str(tmp_path / "u.rows.jsonl"))
    assert {r.tool for r in rows} == {"unsloth"} and all(r.versions["unsloth"] == "2026.10.9" for r in rows)
    assert {(r.metric, r.value) for r in rows if r.metric.endswith("_completion")} == {
        ("max_fit_completion", 3072), ("first_fail_completion", 3200)}
    # fixed lengths only: the bracket comes from the trials; an anchor that prints nothing fails the run
    assert unsloth_grpo.main(["--shared", str(shared), "--site", str(tmp_path), "--model-dir", str(tmp_path / "ck"),
                              "--model", "tiny", "--4bit", "--completion-lengths", "2000", "4000",
                              "--out", str(out)]) == 0
    mode = json.load(open(out))["modes"]["unsloth"]
    assert (mode["max_fit"], mode["first_fail"], mode["status"]) == (2000, 4000, "fixed_only")
    # --records: an earlier run's --out-jsonl, converted without running anything
    records = tmp_path / "anchor.jsonl"
    records.write_text(json.dumps(dict(completion_length=65536, status="ok", fwd_bwd_s_median=31.6,
                                       peak_mem_gib=66.5, mode="grpo")) + "\n")
    assert unsloth_grpo.main(["--records", str(records), "--completion-lengths", "65536", "--out", str(out)]) == 0
    mode = json.load(open(out))["modes"]["unsloth"]
    assert mode["max_fit"] == 65536 and mode["trials"][0]["s"] == 31.6 and "first_s" not in mode["trials"][0]
    assert "mem_get_info" not in json.load(open(out))  # how the earlier run saw the card is not known here
    monkeypatch.setattr(unsloth_grpo, "gpu_fraction", lambda budget_gb: 0.5)  # a budget needs CUDA otherwise
    assert unsloth_grpo.main(["--shared", str(shared), "--site", str(tmp_path), "--model-dir", str(tmp_path / "ck"),
                              "--model", "tiny", "--4bit", "--completion-lengths", "2000", "--gpu-budget-gb", "80",
                              "--out", str(out)]) == 0
    assert json.load(open(out))["mem_get_info"] == "budget"  # through benchmarks.capped_card
    stand_in_unsloth_anchor(shared, "sys.exit('ImportError: no unsloth')")
    assert unsloth_grpo.main(["--shared", str(shared), "--site", str(tmp_path), "--model-dir", str(tmp_path / "ck"),
                              "--completion-lengths", "2000", "--out", str(out)]) == 1
    assert "no unsloth" in json.load(open(out))["modes"]["unsloth"]["error"]


def test_capped_card_reports_the_capped_share_of_the_card():
    """benchmarks.capped_card: ``mem_get_info`` as a card of ``fraction`` x the total would report it: total the
    capped bytes, free those less everything the driver counts as used (never below 0)."""
    from benchmarks.capped_card import capped_mem_get_info

    calls = []

    def real(device=None):
        calls.append(device)
        return used_free, 150_000_000_000

    used_free = 100_000_000_000  # 50e9 used of the 150e9 card
    info = capped_mem_get_info(real, 0.5)
    assert info() == (25_000_000_000, 75_000_000_000) and info(1) == (25_000_000_000, 75_000_000_000)
    assert calls == [None, 1]  # the device asked about is the one the driver is asked about
    used_free = 60_000_000_000  # 90e9 used: more than the capped card holds
    assert info() == (0, 75_000_000_000)


def test_unsloth_anchor_runs_on_the_capped_card_when_a_budget_is_given(tmp_path):
    """With a GPU fraction, benchmarks.unsloth_sft.run_anchor starts the anchor through benchmarks/capped_card.py:
    the anchor runs as __main__ with its own arguments, torch.cuda.mem_get_info (both names) is the capped one,
    and its own folder, not benchmarks/ (whose kernels.py / losses.py / results.py would shadow packages), leads
    sys.path. Without a fraction it runs plainly."""
    from benchmarks.unsloth_sft import run_anchor

    shared = tmp_path / "shared"
    stand_in_unsloth_anchor(shared, """
import torch
capped = torch.cuda.mem_get_info.__qualname__.startswith('capped_mem_get_info')
try:
    import results  # benchmarks/results.py, if benchmarks/ were on the path
    shadowed = True
except ImportError:
    shadowed = False
print('RESULT ' + json.dumps(dict(status='ok', args=args, capped=capped, same=torch.cuda.memory.mem_get_info is
                                  torch.cuda.mem_get_info, path0=sys.path[0], shadowed=shadowed, name=__name__)))
""")
    got = run_anchor(str(shared), str(tmp_path), ["--mode", "grpo", "--4bit"], 120, gpu_fraction=0.533)
    assert len(got) == 1 and got[0]["status"] == "ok", got
    r = got[0]
    assert r["args"] == ["--mode", "grpo", "--4bit"] and r["capped"] and r["same"] and not r["shadowed"]
    assert r["name"] == "__main__"
    assert os.path.samefile(r["path0"], shared / "anchors")
    plain = run_anchor(str(shared), str(tmp_path), ["--mode", "grpo"], 120)[0]
    assert plain["args"] == ["--mode", "grpo"] and not plain["capped"]
