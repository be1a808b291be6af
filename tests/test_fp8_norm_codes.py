"""The decode loop's norms making the FP8 codes of q/k/v's and gate/up's input (``add_rms_norm_fp8``,
``FastRolloutEngine(fp8_norm_codes=True)``), and the MLP's activation making ``down_proj``'s (``glu_fp8``,
``fp8_glu_codes=True``).

References: the kernels' bytes against the rowwise quantiser and the float64 norm / activation are in
tests/test_kernels.py. Here the engine with the kernels making the codes against the engine quantising each
input in its own launch (which tests/test_fp8.py and tests/test_fp8_stacked_qkv.py check against transformers'
own model): the same greedy tokens and log-probabilities bit for bit on the CPU, with the separate quantiser
no longer run on those inputs. The FP8 x FP8 rows (17..64) need ``_scaled_mm``'s path, switched on by hand on
the CPU.
"""

from __future__ import annotations

import pytest
import torch

import swiftune.models.fp8_linear as fl
import swiftune.models.lora_linear as ll
import swiftune.rl.rollout.layers as rollout_layers
from tests.helpers import tiny_model
from tests.test_fp8_stacked_qkv import _peft_fp8


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-projection"])
def test_norm_codes_decode_as_the_separate_quantiser(lora, stacked, monkeypatch):
    from swiftune.models import patch_model
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from tests.test_fp8 import _require_cpu_scaled_mm

        _require_cpu_scaled_mm()
    model = tiny_model("qwen3").to(torch.bfloat16).to(device).eval()
    fl.quantize_model_fp8(model, scaled_mm=True)
    model = patch_model(model)
    model = _peft_fp8(model) if lora else model
    layers = len((model.base_model.model if lora else model).model.layers)
    fused, quantised = [], []  # per call: rows of add_rms_norm_fp8; rows of the shared input's own quantiser
    made, own = [], []  # rows of the activations that made down_proj's codes; rows down_proj quantised itself
    norm_fp8, shared = rollout_layers.add_rms_norm_fp8, fl.quantize_shared_input
    glu, quantise, dot = rollout_layers.gated_activation_fp8, fl.quantize_activation, fl.fp8_dot_matmul
    width = (model.base_model.model if lora else model).config.intermediate_size
    monkeypatch.setattr(rollout_layers, "add_rms_norm_fp8", lambda x, *a, **k: fused.append(x.shape[0]) or norm_fp8(x, *a, **k))
    monkeypatch.setattr(ll, "quantize_shared_input",
                        lambda x, *a, **k: quantised.append(x.shape[0]) or shared(x, *a, **k))
    monkeypatch.setattr(rollout_layers, "gated_activation_fp8",
                        lambda mlp, g, u: made.append(g.reshape(-1, g.shape[-1]).shape[0]) or glu(mlp, g, u))
    # down_proj quantising its own input: _scaled_mm's path, or the FP8 x FP8 kernel's given no codes
    monkeypatch.setattr(fl, "quantize_activation",
                        lambda x, *a, **k: (own.append(x.shape[0]) if x.shape[-1] == width else None) or
                        quantise(x, *a, **k))
    monkeypatch.setattr(fl, "fp8_dot_matmul",
                        lambda x, *a, **k: (own.append(x.shape[0]) if x.shape[-1] == width and "x_scale" not in k
                                            else None) or dot(x, *a, **k))
    prompts = [[5, 9, 17, 33, 2], [7, 8, 100, 12], [3, 4, 5]]
    params = SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=())
    runs, counts = {}, {}
    for on in (False, True):
        fused.clear(), quantised.clear(), made.clear(), own.clear()
        # (the LoRA decode kernel off: with it, decode_mlp also serves gate/up as two products, which the counts
        # below do not describe; the engine's defaults, stacked, are the "stacked" cases)
        engine = FastRolloutEngine(model, use_cuda_graph=False, kv_bucket=4, fp8_norm_codes=on, fp8_glu_codes=on,
                                   fp8_stacked_qkv=stacked, fp8_stacked_gate_up=stacked, lora_decode_kernel=False)
        runs[on] = engine.generate(prompts, 6, params)  # 18 rows: the FP8 x FP8 decode kernel's, codes shared
        counts[on] = (sorted(set(fused)), len(fused), sorted(set(quantised)), len(quantised), len(made),
                      sorted(set(own)), len(own))
    steps = params.max_tokens - 1  # decode steps (the first token comes from the prefill)
    # off: every q/k/v and gate/up input of a decode step quantised by its own launch (gate/up only when the
    # MLP is stacked: otherwise the MLP's own forward quantises it, not through this function's caller)
    per_step = 2 * layers if stacked else layers
    assert counts[False][:2] == ([], 0) and counts[False][3] >= steps * per_step
    # on: the norms make them (the first layer's q/k/v input comes from the embedding's norm, quantised apart)
    assert counts[True][0] == [18] and counts[True][1] == steps * (per_step - 1)
    assert counts[True][3] == counts[False][3] - steps * (per_step - 1)
    # down_proj: off, it quantises its input in each decode step; on, the stacked MLP's activation makes the codes
    # (the per-projection MLP runs its own forward, the activation included: down_proj quantises as before)
    assert counts[False][4:] == (0, [18], steps * layers)
    assert counts[True][4:] == ((steps * layers, [], 0) if stacked else (0, [18], steps * layers))
    assert runs[True].completion_ids == runs[False].completion_ids
    for got, want in zip(runs[True].logprobs, runs[False].logprobs):
        assert torch.equal(got, want)  # the same codes: the same products


def test_norm_codes_left_out_where_the_projections_do_not_quantise(monkeypatch):
    """bf16 weights, and the weight-only kernel's rows (<= 16): the norms make no codes (nothing reads them)."""
    from swiftune.models import patch_model
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams

    calls = []
    original = rollout_layers.add_rms_norm_fp8
    monkeypatch.setattr(rollout_layers, "add_rms_norm_fp8", lambda *a, **k: calls.append(1) or original(*a, **k))
    plain = patch_model(tiny_model("qwen3").to(torch.bfloat16).eval())
    FastRolloutEngine(plain, use_cuda_graph=False).generate([[5, 9, 17]], 18, SamplingParams(max_tokens=3))
    fp8 = tiny_model("qwen3").to(torch.bfloat16).eval()
    fl.quantize_model_fp8(fp8, scaled_mm=True)
    FastRolloutEngine(patch_model(fp8), use_cuda_graph=False).generate([[5, 9, 17]], 4, SamplingParams(max_tokens=3))
    assert calls == []

