"""Smoke tests of the FP8 accuracy scripts (the loss curve's ``--compare fp8`` and the GRPO reward curve), each in
its tiny mode in a subprocess (tests/bench_helpers.py); apart from the other GRPO script tests so that
``--dist loadfile`` can run them on another worker."""

import json

from tests.bench_helpers import assert_rows, run_script


def test_loss_curve_fp8_against_bf16_tiny(tmp_path):
    """``--compare fp8``: the same rows and the same LoRA initialisation on a bf16 and an FP8 base; the
    FP8 run's losses differ from the bf16 run's (its weights are quantised) but stay close."""
    out = tmp_path / "loss_curve_fp8.json"
    run_script("loss_curve.py", "--compare", "fp8", "--model", "tiny", "--steps", "6", "--batch", "4",
               "--max_length", "256", "--out", str(out))
    r = json.loads(out.read_text())
    assert (r["reference"], r["measured"]) == ("swiftune_packed", "swiftune_packed_fp8")
    assert r["same_data"] and r["same_init"]
    assert len(r["modes"]["swiftune_packed_fp8"]["losses"]) == 6
    assert 0 < r["max_abs_diff"] and r["max_rel_diff"] < 1e-2, r["max_rel_diff"]
    assert_rows(out, "loss_curve", {"max_abs_diff", "final_loss"})


def test_reward_curve_fp8_and_bf16_runs(tmp_path):
    """Both ``swiftune grpo`` runs of the built-in task (bf16 LoRA, FP8 base + LoRA) log a reward per step."""
    out = tmp_path / "reward_curve.json"
    run_script("reward_curve.py", "--max-steps", "3", "--sft-warmup-steps", "4", "--workdir", str(tmp_path / "w"),
               "--out", str(out))
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"bf16", "fp8"}
    for run in r["runs"].values():
        assert len(run["rewards"]) == 3 and all(0 <= x <= 1 for x in run["rewards"])
    assert "--load_in_fp8 true" in r["runs"]["fp8"]["command"]
    assert_rows(out, "reward_curve", {"reward_first_fifth", "reward_last_fifth"})
