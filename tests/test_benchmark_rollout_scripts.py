"""Smoke tests of the rollout, MoE decode and attention benchmark scripts, each in its tiny mode in a
subprocess (tests/bench_helpers.py), and their HBM floors for NF4 and FP8 weights."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.bench_helpers import ROOT, assert_rows, load_bench_module, run_script


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


def test_attention_benchmark_flop_count_and_cpu_refusal():
    """Causal attention FLOPs written out for one case; without CUDA the script says so and exits 2."""
    ab = load_bench_module("attention_backends")
    # 2 documents of 1024 tokens, 4 heads of 64: forward 2 * 4 * 1024^2 * 64 * 4 / 2, backward 2.5x
    assert ab.attention_flops(1024, 2, 4, 64) == 3.5 * (2 * 4 * 1024**2 * 64 * 4 / 2)
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, "-m", "benchmarks.attention_backends"], capture_output=True, cwd=ROOT,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
        assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr


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
    from the FP8 layers (LoRA at run time only: e4m3 weights take no merge; q/k/v as one product,
    --fp8-stacked-qkv) and its JSON says fp8."""
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
               "--lora-rows", "2", "--fp8-stacked-qkv", "--fp8-stacked-gate-up", "--no-fp8-norm-codes",
               "--lora-decode-kernel", "--kv-cache-dtype", "fp8", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["weights"] == "fp8"
    assert r["checks"]["tiny"]["graph_equals_eager_greedy"]
    assert [(x["rows"], x["new_tokens"]) for x in r["runs"]] == [(2, 8)]
    assert abs(r["runs"][0]["weight_gb"] * 1e9 - rollout.weight_bytes(q)) < 1
    assert [x["lora"] for x in r["lora"]] == ["runtime"]
    for run in (r["runs"][0], r["lora"][0]):  # the options reached both
        assert run["fast"]["fp8_stacked_qkv"] and run["fast"]["fp8_stacked_gate_up"]
        assert run["fast"]["kv_cache_dtype"] == "fp8" and run["fast"]["fp8_norm_codes"] is False
        assert run["fast"]["lora_decode_kernel"] is True
    # the floor counts the FP8 cache's bytes: a byte a code plus a float32 scale per head's vector
    from swiftune.rl.rollout.fast import head_dim_of

    cfg = q.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (head_dim_of(cfg) + 4)
    assert abs(r["runs"][0]["kv_mean_gb"] * 1e9 - 2 * per_token * (r["prompt_tokens"] + 8 / 2)) < 1
    assert_rows(out, "rollout", {"tokens_per_s", "step_ms"})


def test_decode_profile_divides_the_profiled_run_by_its_steps(monkeypatch):
    """--profile-steps: the kernels' device time and launches of the profiled generate, per decode step."""
    import contextlib

    rollout = load_bench_module("rollout")
    tp = load_bench_module("time_profile")

    calls = []

    class Engine:
        def generate(self, prompts, rows, params):
            calls.append((rows, params.max_tokens))

    @contextlib.contextmanager
    def fake_profile(result):
        yield
        result["profile"] = tp.summarise([("gemm_a", 2000.0, 100), ("moe_decode_up", 1000.0, 300)])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tp, "device_time_profile", fake_profile)
    p = rollout.decode_profile(Engine(), [1, 2, 3], 8, 100)
    assert calls == [(8, 100)]
    assert p["steps"] == 100 and p["device_ms_per_step"] == pytest.approx(0.03) and p["launches_per_step"] == 4
    assert [(k["kernel"], k["ms"], k["calls"]) for k in p["top"]] == [("gemm_a", 0.02, 1), ("moe_decode_up", 0.01, 3)]
    assert p["prompt_tokens"] == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rollout.decode_profile(Engine(), [1], 8, 100) == {}


def test_profiled_steps_attend_to_the_timed_runs_mean_slots():
    """The profiled generate's prompt is lengthened so that its steps' middle sits at the timed run's mean number of
    slots (prompt + N / 2), with the prompt's own tokens; no longer than the prompt where N is short."""
    rollout = load_bench_module("rollout")
    prompt = [5, 6, 7]
    longer = rollout.profile_prompt(prompt, 1024, 256)
    assert len(longer) + 256 / 2 == len(prompt) + 1024 / 2 and longer[:3] == prompt and set(longer) == {5, 6, 7}
    assert rollout.profile_prompt(prompt, 128, 256) == prompt
