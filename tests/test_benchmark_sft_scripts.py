"""Smoke tests of the SFT benchmark scripts (benchmarks.sft in every mode, benchmarks.unsloth_sft's
records, the QLoRA flags), each in its tiny mode in a subprocess (tests/bench_helpers.py): the JSON keys
the docs read, and result rows that validate against benchmarks.results' schema."""

import json

import pytest

from tests.bench_helpers import assert_rows, run_script, stand_in_unsloth_anchor


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
    """--host-profile of one step, here with the deferred NaN/inf check, which the row and its results say."""
    out = tmp_path / "sft_host.json"
    proc = run_script("sft.py", "--model", "tiny", "--batch", "2", "--steps", "3", "--warmup", "2",
                      "--modes", "swiftune", "--max_length", "128", "--host-profile", "--deferred-nonfinite-check",
                      "--out", str(out))
    (row,) = json.loads(out.read_text())
    hp = row["host_profile"]
    assert hp["host_ms"] > 0 and {g["group"] for g in hp["groups"]} >= {"swiftune", "peft"}
    assert "# host time of swiftune batch 2" in proc.stdout
    assert row["deferred_nonfinite_check"] is True and "error" not in row
    assert all(r.settings["deferred_nonfinite_check"] for r in assert_rows(out, "sft", {"tokens_per_s"}))


def test_sft_benchmark_times_one_window_synchronised_at_its_ends(tmp_path):
    """--step-sync ends: the timed steps as one window (no device sync between them), said by the row and its
    results; with graphed layers, the graphs captured inside the window, and a steady figure only without any."""
    out = tmp_path / "sft_ends.json"
    run_script("sft.py", "--model", "tiny", "--batch", "2", "--steps", "5", "--warmup", "2", "--modes",
               "swiftune_graphs", "--max_length", "128", "--step-sync", "ends", "--out", str(out))
    (row,) = json.loads(out.read_text())
    assert "error" not in row and row["step_sync"] == "ends" and row["tokens_per_s"] > 0
    assert row["window_captures"] >= 0 and "steps_capturing" not in row
    assert row["steady_tokens_per_s"] == (None if row["window_captures"] else row["tokens_per_s"])
    result_rows = assert_rows(out, "sft", {"tokens_per_s", "window_captures"})
    assert all(r.settings["step_sync"] == "ends" for r in result_rows)


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


def test_unsloth_sft_turns_the_anchors_records_into_sft_rows(tmp_path):
    """benchmarks.unsloth_sft runs the anchor in child processes (here a stand-in printing the
    anchor's RESULT records) and writes benchmarks.sft rows of tool ``unsloth``."""
    from benchmarks import unsloth_sft
    from benchmarks.results import read_rows

    shared = tmp_path / "shared"
    stand_in_unsloth_anchor(shared, """
packed = '--packing' in args
m = dict(tokens_per_s=6000.0 if packed else 2500.0, peak_mem_gib=20.0, step_time_ms=1500.0,
         padding_fraction=0.0, timed_steps=16)
print('RESULT ' + json.dumps(dict(status='ok', metrics=m, versions=dict(unsloth='2026.10.9'))))
""")
    out = tmp_path / "u.json"
    assert unsloth_sft.main(["--shared", str(shared), "--site", str(tmp_path), "--model-dir", str(tmp_path / "ck"),
                             "--out", str(out)]) == 0
    rows = json.load(open(out))
    assert [r["mode"] for r in rows] == ["unsloth", "unsloth_packed"]
    assert rows[1]["tokens_per_s"] == 6000.0 and abs(rows[0]["peak_gb"] - 20.0 * 2**30 / 1e9) < 1e-9
    result_rows = read_rows(str(tmp_path / "u.rows.jsonl"))
    assert {r.tool for r in result_rows} == {"unsloth"} and all(r.versions["unsloth"] == "2026.10.9" for r in result_rows)
    # an anchor that prints nothing: an error row, not a crash
    stand_in_unsloth_anchor(shared, "sys.exit('CUDA out of memory')")
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




def test_sft_benchmark_adapts_gpt_oss_experts_when_asked(tmp_path):
    """--lora-target-parameters: gpt-oss's experts (parameters, which "all-linear" does not reach) adapted as
    PEFT's own get_peft_model adapts them with those targets (the same share of trainable weights; the
    baseline modes build that same LoraConfig), more than attention alone (the MoE SFT table's setting); the
    rows and their results say so."""
    import peft
    import torch

    from benchmarks.workload import random_model

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    out = tmp_path / "sft_oss.json"
    proc = run_script("sft.py", "--model", "tiny-gpt-oss", "--batch", "2", "--steps", "2", "--warmup", "1",
                      "--modes", "swiftune", "--max_length", "64", "--lora-target-parameters", *experts,
                      "--out", str(out))
    (row,) = json.loads(out.read_text())
    assert "error" not in row, proc.stdout[-2000:]

    def peft_share(**targets) -> float:
        model = peft.get_peft_model(random_model("tiny-gpt-oss", "cpu", torch.float32),
                                    peft.LoraConfig(r=16, target_modules="all-linear", **targets))
        trainable, total = model.get_nb_trainable_parameters()
        return trainable / total

    assert row["trainable_fraction"] == pytest.approx(peft_share(target_parameters=experts), rel=1e-12)
    assert row["trainable_fraction"] > 1.5 * peft_share()
    assert row["lora_target_parameters"] == experts
    assert all(r.settings["lora_target_parameters"] == ",".join(experts)
               for r in assert_rows(out, "sft", {"tokens_per_s"}))
