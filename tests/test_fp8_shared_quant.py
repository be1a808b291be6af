"""One quantisation of a shared input for several FP8 linears (``quantize_shared_input``, ``quantized=``).

At 17-64 rows under ``no_grad`` an :class:`FP8Linear` multiplies with the FP8 x FP8 decode kernel, which
quantises its input per row first; a decoder layer's q/k/v (and gate/up) read the same input, so the
rollout engine's decode step quantises it once for them. References: each layer quantising ``x`` itself
(the same bits required), the float64 formula ``(q(x) sx) (Q s)^T + b`` on plain torch's e4m3 codes
(tests/test_fp8_dot.py's helpers and tolerance), and the engine's own decoding with the sharing switched
off (the same greedy tokens and log-probabilities). On CPU the kernels run through the Triton interpreter
(tests/conftest.py) and ``_scaled_mm``'s path is switched on by hand, as tests/test_fp8_matmul.py does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import swiftune.kernels.fp8_dot as fd
import swiftune.models.fp8_linear as fl
import swiftune.models.lora_linear as ll
import swiftune.rl.rollout.layers as rollout_layers
from tests.test_fp8_dot import _abs_terms, _assert_formula, _float64, _fp8_slack, _operands, _torch_quant

K = 64
OUTS = (64, 32, 48)  # q, k, v-like widths (multiples of 16: _scaled_mm's condition)


def _require_fp8_path(device: str) -> None:
    from tests.test_fp8 import _require_cpu_scaled_mm

    if device == "cpu":
        _require_cpu_scaled_mm()
    elif torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 x FP8 decode path needs FP8 tensor cores")


def _layers(device: str) -> list[fl.FP8Linear]:
    """Three FP8 linears reading one input: codes spanning e4m3's range, per-row scales, two with a bias."""
    layers = []
    for i, n in enumerate(OUTS):
        _, q, s, b = _operands(17, n, K, torch.bfloat16, bias=i != 1, seed=10 + i, device=device)
        layer = fl.FP8Linear(K, n, bias=b is not None, device=device, compute_dtype=torch.bfloat16, scaled_mm=True)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = s.view(-1, 1)
        if b is not None:
            layer.bias = nn.Parameter(b, requires_grad=False)
        layers.append(layer)
    return layers


def _count_quantise(monkeypatch) -> list[int]:
    """Rows of each call of the per-row quantise kernel's launcher by the FP8 x FP8 path."""
    calls: list[int] = []
    quantise = fd.fp8_quantize_rowwise
    monkeypatch.setattr(fd, "fp8_quantize_rowwise", lambda x, *a, **k: calls.append(x.shape[0]) or quantise(x, *a, **k))
    return calls


@pytest.mark.parametrize("rows", [17, 40, 64])
def test_shared_codes_equal_each_layers_own_quantisation_and_the_float64_formula(device, rows, monkeypatch):
    """One quantise launch for three layers, the bits of three; both within tests/test_fp8_dot.py's bound
    of the float64 formula on plain torch's codes; the shared codes are plain torch's."""
    _require_fp8_path(device)
    layers = _layers(device)
    x2, _, _, _ = _operands(rows, 16, K, torch.bfloat16, bias=False, seed=rows, device=device)  # a zero row too
    x = x2.view(rows, 1, K)  # the decode step's [B, 1, hidden]
    calls = _count_quantise(monkeypatch)
    with torch.no_grad():
        own = [layer(x) for layer in layers]
        assert calls == [rows] * len(layers)
        shared = fl.quantize_shared_input(x, layers)
        assert shared is not None and calls == [rows] * (len(layers) + 1)
        ys = [layer(x, quantized=shared) for layer in layers]
    assert calls == [rows] * (len(layers) + 1)  # the layers given codes quantise nothing
    xq, xs = _torch_quant(x2)
    assert torch.equal(shared.codes.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(shared.scales, xs)
    for layer, y, mine in zip(layers, ys, own):
        assert y.shape == (rows, 1, layer.out_features) and y.dtype == torch.bfloat16
        assert torch.equal(y, mine)
        q, s, b = layer.weight, layer.weight_scale.view(-1), layer.bias
        want = _float64(xq, xs, q, s, b)
        assert want.abs().max() > 0
        for got in (y, mine):
            _assert_formula(got.view(rows, -1), want, _abs_terms(xq, xs, q, s), torch.bfloat16, _fp8_slack(device))


def test_sharing_only_where_every_layer_quantises_its_input_and_misuse_is_refused(device):
    """Sharing wherever each layer would quantise ``x`` the same way: the FP8 x FP8 decode path (no_grad,
    17-64 rows) and ``_scaled_mm``'s (wider no_grad products, and grad mode: training), each with its
    own quantiser's codes. ``None`` (each layer runs as before) for the weight-only kernel's row counts, a
    non-FP8 layer, layers without ``_scaled_mm``, ``x`` outside the compute dtype, or layers that would
    take different paths; codes of another tensor, or for a product that quantises nothing, are refused."""
    _require_fp8_path(device)
    layers = _layers(device)
    x = torch.randn(24, 1, K, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for rows in (1, fl.DECODE_MAX_ROWS):
            other = torch.randn(rows, 1, K, device=device, dtype=torch.bfloat16)
            assert fl.quantize_shared_input(other, layers) is None
        wide = torch.randn(fl.DOT_DECODE_MAX_ROWS + 1, 1, K, device=device, dtype=torch.bfloat16)
        wide_shared = fl.quantize_shared_input(wide, layers)  # _scaled_mm's path under no_grad
        assert wide_shared is not None
        for layer in layers:
            assert torch.equal(layer(wide, quantized=wide_shared), layer(wide))
        plain = nn.Linear(K, 16, device=device, dtype=torch.bfloat16)
        assert fl.quantize_shared_input(x, [*layers, plain]) is None
        assert fl.quantize_shared_input(x, []) is None
        assert fl.quantize_shared_input(x.float(), layers) is None  # fp32 compute: not _scaled_mm's path
        with torch.autocast(device, dtype=torch.bfloat16):  # a float32 x under bf16 autocast: its own rule
            assert fl.quantize_shared_input(x.float(), layers) is None
        layers[0].scaled_mm = False
        assert fl.quantize_shared_input(x, layers) is None
        layers[0].scaled_mm = True
        shared = fl.quantize_shared_input(x, layers)
        assert shared is not None
        with pytest.raises(ValueError, match="this very input"):
            layers[0](x.clone(), quantized=shared)
        with pytest.raises(ValueError, match="quantise their input"):
            fl.fp8_matmul(x.view(24, K).float(), layers[0].weight, fl.FP8State(layers[0].weight_scale, True, True),
                          torch.float32, quantized=shared)
    trained = fl.quantize_shared_input(x, layers)  # grad mode: _scaled_mm's codes
    assert trained is not None and trained.codes.shape == (24, K)
    # the two quantisers make the same codes of one input (each is plain torch's, the first test)
    assert torch.equal(trained.codes.view(torch.uint8), shared.codes.view(torch.uint8))
    for layer in layers:
        assert torch.equal(layer(x, quantized=trained), layer(x))


def _fp8_bf16_model(tmp_path_factory):
    from swiftune.training import FastModel
    from tests.helpers import save_tiny_checkpoints

    path = save_tiny_checkpoints(tmp_path_factory, families=("qwen3",))["qwen3"]
    model, tokenizer = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.bfloat16, device_map="cpu")
    layers = [m for m in model.modules() if isinstance(m, fl.FP8Linear)]
    for m in layers:
        m.scaled_mm = True  # chosen at load on an FP8 GPU; CPU torch has _scaled_mm too
    return model.eval(), tokenizer, layers


def test_engine_decode_quantises_once_per_shared_input_with_the_same_tokens(tmp_path_factory, monkeypatch):
    """The fast engine decoding 18 rows from FP8 weights (every decode product on the FP8 x FP8 path):
    with the sharing, 4 quantise launches per layer and step instead of 7 (q/k/v one, gate/up one, o and
    down their own), the same 7 products, and the same greedy tokens and log-probabilities, bit for bit,
    as the engine with each projection quantising its own input."""
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams

    _require_fp8_path("cpu")
    model, tokenizer, layers = _fp8_bf16_model(tmp_path_factory)
    prompts = [tokenizer(t)["input_ids"] for t in ("Reverse: abc\n", "Hi\n")]
    group = 9  # 2 prompts x 9 completions: 18 rows per decode step, in the FP8 x FP8 path's range
    quantise = _count_quantise(monkeypatch)
    dot_calls: list[bool] = []  # per product: was it given codes
    dot = fl.fp8_dot_matmul
    monkeypatch.setattr(fl, "fp8_dot_matmul",
                        lambda x, *a, **k: dot_calls.append(x.dtype == torch.float8_e4m3fn) or dot(x, *a, **k))
    steps: list[int] = []
    attention = rollout_layers.decode_attention
    monkeypatch.setattr(rollout_layers, "decode_attention",
                        lambda a, x, *r: steps.append(x.shape[0]) or attention(a, x, *r))

    def generate():
        quantise.clear(), dot_calls.clear(), steps.clear()
        engine = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, kv_bucket=4, check_every=3,
                                   fp8_stacked_qkv=False, fp8_stacked_gate_up=False, fp8_norm_codes=False)
        # a product per projection, each input quantised by its own launch: what is counted is the sharing per
        # projection (the stacked products: tests/test_fp8_stacked_qkv.py; the norms' codes:
        # tests/test_fp8_norm_codes.py)
        return engine.generate(prompts, group, SamplingParams(max_tokens=4, temperature=0)), list(quantise), \
            list(dot_calls), list(steps)

    with monkeypatch.context() as off:  # "before": every projection quantises its own input
        off.setattr(ll, "quantize_shared_input", lambda x, projections: None)
        before, q_before, dot_before, steps_before = generate()
    after, q_after, dot_after, steps_after = generate()

    n_layers = model.config.num_hidden_layers
    assert steps_before == steps_after and steps_after and set(steps_after) == {len(prompts) * group}
    decode_layers = len(steps_after)  # decode steps x layers
    assert not any(dot_before) and sum(dot_after) == 5 * decode_layers  # q, k, v, gate, up given codes
    assert len(dot_before) == len(dot_after) >= 7 * decode_layers  # the same products (prefill's too)
    assert len(q_before) - len(q_after) == 3 * decode_layers
    assert decode_layers % n_layers == 0 and len(layers) == 7 * n_layers
    assert after.completion_ids == before.completion_ids
    assert all(len(c) == 4 for c in after.completion_ids)
    for got, want in zip(after.logprobs, before.logprobs):
        assert torch.equal(got, want)
