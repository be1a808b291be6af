"""Smoke tests of the long-context benchmark (benchmarks.longctx: tiny rows, the planner-guided search,
the merge of runs) and the committed long-context results against the current planner."""

import json
import os

import pytest
import torch

from tests.bench_helpers import ROOT, assert_rows, load_bench_module, run_script


LONGCTX_RESULTS = [os.path.join(ROOT, "docs", "results", f"longctx_qwen3-8b_{k}.json")
                   for k in ("sweep_h200", "400k_single_h200", "offload_overhead_h200", "32k")]


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
