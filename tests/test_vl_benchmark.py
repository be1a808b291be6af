"""Smoke tests of benchmarks/vl.py on the tiny Qwen3-VL shape (CPU): both modes of ``sft`` (swiftune's
padding-free SFTTrainer and TRL 1.16's VLM SFTTrainer) train on the same image-text rows and count their
tokens as transformers' own Qwen3-VL processor tokenizes those rows; ``grpo`` (QLoRA requested) times the
policy step on an image prompt and brackets the largest completion within the tolerance; every run writes
rows that validate against benchmarks.results' schema.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.bench_helpers import ROOT, assert_rows, run_script

pytest.importorskip("PIL")
pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3VLForConditionalGeneration"):
    pytest.skip("this transformers has no Qwen3-VL", allow_module_level=True)


def test_vl_sft_both_modes_count_the_processor_tokens(tmp_path):
    out = tmp_path / "vl_sft.json"
    # 4 rows, 2 a step: text lengths of the reference workload up to 240 (all four differ: TRL pads)
    run_script("vl", "sft", "--model", "tiny-vl", "--batch", "2", "--steps", "2", "--warmup", "1",
               "--max-text-length", "240", "--out", str(out), timeout=240)
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"swiftune", "trl"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["sec_per_step"] > 0
        assert r["image_tokens_per_row"] == (64 // 16) ** 2 // 2**2  # a 4 x 4 patch grid, merged 2 x 2
    assert rows["swiftune"]["padding_fraction"] == 0.0  # one padding-free row a batch
    assert rows["trl"]["padding_fraction"] > 0.0  # right padding to the longest row
    assert rows["swiftune"]["trainable_fraction"] == rows["trl"]["trainable_fraction"]  # the same adapters

    # the reference count: transformers' Qwen3-VL processor on every row (text and image tokens, no padding)
    from benchmarks.vl import build_processor, image_text_rows
    from trl.data_utils import prepare_multimodal_messages

    processor = build_processor("tiny-vl", transformers_processor=True)
    expected = 0
    for row in image_text_rows(4, 64, 240):
        messages = prepare_multimodal_messages(row["messages"], images=row["images"])
        ids = processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        expected += len(ids[0] if isinstance(ids[0], list) else ids)
    assert rows["swiftune"]["tokens_all_steps"] == rows["trl"]["tokens_all_steps"] == expected
    got = assert_rows(out, "vl", {"tokens_per_s", "peak_gb", "step_s", "padding_fraction"})
    assert {r.tool for r in got} == {"swiftune", "trl"}
    assert any(r.settings.get("excl_collate") for r in got)


def test_vl_grpo_qlora_step_and_bracket(tmp_path):
    out = tmp_path / "vl_grpo.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vl", "grpo", "--model", "tiny-vl", "--load-in-4bit",
                           "--prompt-tokens", "32", "--completion-lengths", "32", "--bisect-start", "32",
                           "--simulate-capacity", "200", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    data = json.loads(out.read_text())
    mode = data["modes"]["swiftune_vl"]
    if mode["status"] == "refused":  # loading refused QLoRA on the family: the run must say so, and fail
        assert proc.returncode == 1
        assert "NOT MEASURED" in proc.stdout and mode["error"]
        return
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert mode["nf4_linears"] > 0  # the text decoder's projections really are 4-bit
    assert mode["prompt_text_tokens"] == 32 and mode["prompt_image_tokens"] == 4
    fixed = [t for t in mode["trials"] if t["completion"] == 32]
    assert len(fixed) == 1 and fixed[0]["status"] == "ok" and fixed[0]["first_s"] > 0 and fixed[0]["s"] > 0
    # shared prompt: the prompt once, then G=2 completions (each its last token left out as an input)
    assert fixed[0]["tokens"] == 36 + 2 * 31
    lo, hi = mode["max_fit"], mode["first_fail"]
    assert mode["status"] == "converged" and lo and hi and lo < hi
    assert hi <= lo * 1.05 or hi - lo <= 16  # bracketed within the tolerance or the granularity
    assert 36 + 2 * lo <= 200 < 36 + 2 * hi  # --simulate-capacity's limit lies inside the bracket
    assert "largest completion per row that fits: " + str(lo) in proc.stdout
    got = assert_rows(out, "vl", {"max_fit_completion", "first_fail_completion", "step_s", "fits"})
    assert all(r.settings.get("load_in_4bit") is True for r in got)


@pytest.mark.parametrize("argv, message", [
    (["sft", "--model", "qwen3-8b"], "not a Qwen3-VL shape"),
    (["sft", "--model", "tiny-vl", "--warmup", "0"], "--warmup must be at least 1"),
    (["sft", "--model", "tiny-vl", "--image-size", "8"], "--image-size must be at least 32"),
    (["grpo", "--model", "tiny-vl", "--fixed-only"], "give at least one"),
    (["grpo", "--model", "tiny-vl", "--completion-lengths", "1"], "at least 2 tokens"),
])
def test_vl_benchmark_refuses_bad_arguments_before_building_a_model(argv, message, capsys):
    from benchmarks.vl import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
