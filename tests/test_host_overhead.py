"""benchmarks.host_overhead runs and writes valid rows; the trainers' cached LoRA layer index
finds what a walk of the module tree finds, and walks again when the adapters change."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import child_env, module_command
from benchmarks.results import read_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_script_writes_valid_rows(tmp_path):
    env = child_env()
    env.pop("TRITON_INTERPRET", None)  # the script measures the kernels' CPU references, as documented
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), env["PYTHONPATH"]])
    env["CUDA_VISIBLE_DEVICES"] = ""
    out, profile = tmp_path / "host.json", tmp_path / "profile.txt"
    proc = subprocess.run(
        [*module_command("host_overhead"), "--model-depth", "2", "--steps", "2", "--warmup", "1", "--batch", "2",
         "--profile-steps", "1", "--out", str(out), "--profile-out", str(profile)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(out.read_text())
    assert [m["mode"] for m in measured] == ["swiftune", "baseline"]
    for m in measured:
        assert m["step_ms"] > 0 and m["training_step_ms"] > 0 and m["forward_backward_ms"] > 0
        assert m["python_calls_per_step"] > 1000
    rows = read_rows(str(tmp_path / "host.rows.jsonl"))
    assert {r.tool for r in rows} == {"swiftune", "transformers+peft"}
    assert {r.mode for r in rows} == {"host_overhead"} and {r.metric for r in rows} == {"host_ms_per_step"}
    assert {r.settings["part"] for r in rows} == {"step", "training_step", "trainer_own", "forward_backward",
                                                   "optimizer"}
    text = profile.read_text()
    assert "===== swiftune" in text and "===== baseline" in text and "cumulative" in text
    assert text.count("Python calls per step by file") == 2 and "torch/nn/modules/module.py" in text


def test_script_refuses_the_triton_interpreter():
    env = child_env()
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([*module_command("host_overhead"), "--steps", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "TRITON_INTERPRET" in proc.stderr


def _tiny_peft_model():
    peft = pytest.importorskip("peft")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft, peft.get_peft_model(Qwen3ForCausalLM(config), lora)


def test_lora_layer_index_follows_the_adapters():
    from swiftune.training.lora_casting import LORA_CAST_FLAG, LoraLayerIndex, lora_input_casting

    peft, model = _tiny_peft_model()
    index = LoraLayerIndex()
    walked = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, LORA_CAST_FLAG)]
    assert len(walked) == 4 and index.layers(model) == walked
    assert index.layers(model) is index.layers(model)  # kept, not walked again
    # a second adapter on more modules: new LoRA layers, found because the adapter names changed
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj", "o_proj"]))
    layers = index.layers(model)
    assert len(layers) == 6 and layers == [m for m in model.modules() if hasattr(m, "lora_A")]
    with lora_input_casting(model, enabled=False, index=index):
        assert all(getattr(m, LORA_CAST_FLAG) is False for m in model.modules() if hasattr(m, "lora_A"))
    assert all(getattr(m, LORA_CAST_FLAG) is True for m in model.modules() if hasattr(m, "lora_A"))
    _, other = _tiny_peft_model()  # another model object: its own layers
    assert index.layers(other) == [m for m in other.modules() if hasattr(m, "lora_A")]
    assert not set(map(id, index.layers(other))) & set(map(id, layers))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
