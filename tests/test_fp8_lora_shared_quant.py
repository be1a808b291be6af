"""One activation quantisation shared by LoRA layers over FP8 bases (LoRA applied at run time).

GRPO rollouts run PEFT's LoRA layers as they are (``lora="runtime"``; FP8 weights cannot take a merge),
so an FP8 model's q/k/v and gate/up are fused LoRA layers (:func:`swiftune.models.lora_linear.fused_lora_forward`)
over :class:`~swiftune.models.fp8_linear.FP8Linear`. At 17-64 rows under ``no_grad`` their base products
take the FP8 x FP8 decode kernel, which quantises its input per row: the decode step quantises it once
for all of them (:func:`~swiftune.models.lora_linear.fp8_product_layer` hands the bases to
:func:`~swiftune.models.fp8_linear.quantize_shared_input`), and the adapter products stay in bf16 on the
input itself. References: each layer quantising its own input (the same bits required); the float64
formula ``(q(x) sx) (Q s)^T + b + s (x A^T) B^T`` on plain torch's e4m3 codes; the engine with the
sharing off (same greedy tokens and log-probabilities, bit for bit); and transformers' own forward of
the dequantised model with PEFT's own LoRA on top (float32). CPU: the Triton interpreter
(tests/conftest.py), ``_scaled_mm``'s path switched on by hand as tests/test_fp8_shared_quant.py does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

import swiftune.models.fp8_linear as fl  # noqa: E402
import swiftune.models.lora_linear as ll  # noqa: E402
import swiftune.rl.rollout.layers as rollout_layers  # noqa: E402
from tests.helpers import lora_tensors, rel_err  # noqa: E402
from tests.test_engine import forward_logprobs  # noqa: E402
from tests.test_fp8_dot import _abs_terms, _float64, _operands, _torch_quant  # noqa: E402
from tests.test_fp8_shared_quant import K, _count_quantise, _layers, _require_fp8_path  # noqa: E402

SCALING = 2.0  # lora_alpha / r


class _Projections(nn.Module):
    def __init__(self, layers: list[fl.FP8Linear]):
        super().__init__()
        self.q, self.k, self.v = layers


def _lora_layers(device: str, targets: tuple[str, ...] = ("q", "k", "v")) -> list[nn.Module]:
    """tests/test_fp8_shared_quant.py's three FP8 linears under PEFT's LoRA (bf16 adapters of rank 4 whose
    product is of the base product's size), with swiftune's fused forward."""
    module = _Projections(_layers(device))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)
    module = peft.inject_adapter_in_model(config, module)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name in targets:
            layer = getattr(module, name)
            a, b = layer.lora_A["default"], layer.lora_B["default"]
            a.to(torch.bfloat16), b.to(torch.bfloat16)
            a.weight.copy_(torch.randn(a.weight.shape, generator=g) * 0.3)
            b.weight.copy_(torch.randn(b.weight.shape, generator=g) * 3.0)
    assert ll.fuse_lora_linears(module) == len(targets)
    return [module.q, module.k, module.v]


def _float64_lora(x2: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The base product on plain torch's codes and the adapter product on ``x`` itself, in float64, and
    the sum of the magnitudes of their terms (the scale of any rounding)."""
    xq, xs = _torch_quant(x2)
    base = layer.base_layer
    q, s = base.weight, base.weight_scale.view(-1)
    a = layer.lora_A["default"].weight.double()
    b = layer.lora_B["default"].weight.double()
    h = x2.double() @ a.t()
    adapter = SCALING * h @ b.t()
    terms = _abs_terms(xq, xs, q, s) + SCALING * (x2.double().abs() @ a.abs().t()) @ b.abs().t()
    return _float64(xq, xs, q, s, base.bias), adapter, terms


@pytest.mark.parametrize("rows", [17, 40, 64])
def test_lora_layers_share_the_codes_with_the_bits_of_their_own_call_and_the_float64_formula(device, rows,
                                                                                               monkeypatch):
    """One quantise launch for three LoRA layers over FP8, the bits of three own calls; within a few bf16
    roundings of the float64 formula, whose adapter term is far outside that (so a lost adapter, or an
    adapter product on the quantised input, fails)."""
    _require_fp8_path(device)
    layers = _lora_layers(device)
    x2, _, _, _ = _operands(rows, 16, K, torch.bfloat16, bias=False, seed=rows, device=device)  # a zero row too
    x = x2.view(rows, 1, K)  # the decode step's [B, 1, hidden]
    calls = _count_quantise(monkeypatch)
    with torch.no_grad():
        own = [layer(x) for layer in layers]
        assert calls == [rows] * len(layers)
        bases = [ll.fp8_product_layer(layer, x) for layer in layers]
        assert bases == [layer.base_layer for layer in layers]
        shared = fl.quantize_shared_input(x, bases)
        assert shared is not None and calls == [rows] * (len(layers) + 1)
        ys = [layer(x, quantized=shared) for layer in layers]
    assert calls == [rows] * (len(layers) + 1)  # the layers given codes quantise nothing
    for layer, y, mine in zip(layers, ys, own):
        assert y.shape == (rows, 1, layer.out_features) and y.dtype == torch.bfloat16
        assert torch.equal(y, mine)
        base, adapter, terms = _float64_lora(x2, layer)
        want = base + adapter
        err = (y.view(rows, -1).double() - want).abs()
        # bf16 roundings: the base product, x A^T, the adapter product and the sum (2^-8 each, of the
        # terms), and float32 summation well inside that
        bound = 4 * 2.0**-8 * terms + 1e-6 * want.abs().max()
        assert torch.all(err <= bound), float((err - bound).max())
        assert (adapter.abs() > 4 * bound).any() and rel_err(y.view(rows, -1), want) < 1e-2
        assert rel_err(base, want) > 0.2  # the adapter is a sizeable part of the output


def test_sharing_with_lora_only_where_every_layer_quantises_its_input_and_misuse_is_refused(device):
    """A bare FP8 layer beside LoRA ones shares too, under no_grad and in grad mode (training); PEFT's own
    forward, disabled adapters, the weight-only kernel's row counts get ``None`` (each layer runs as
    before); codes of another tensor, or for a layer whose base is not FP8, are refused."""
    _require_fp8_path(device)
    x = torch.randn(24, 1, K, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        q, k, v = _lora_layers(device, targets=("q", "v"))
        assert ll.fp8_product_layer(k, x) is k and isinstance(k, fl.FP8Linear)
        shared = fl.quantize_shared_input(x, [ll.fp8_product_layer(m, x) for m in (q, k, v)])
        assert shared is not None
        assert torch.equal(q(x, quantized=shared), q(x)) and torch.equal(k(x, quantized=shared), k(x))
        for rows in (1, fl.DECODE_MAX_ROWS):
            other = torch.randn(rows, 1, K, device=device, dtype=torch.bfloat16)
            assert fl.quantize_shared_input(other, [ll.fp8_product_layer(m, other) for m in (q, k, v)]) is None
        with pytest.raises(ValueError, match="this very input"):
            q(x.clone(), quantized=shared)
        q.enable_adapters(False)  # PEFT's own forward runs: it takes no codes
        assert ll.fp8_product_layer(q, x) is None
        with pytest.raises(ValueError, match="fused LoRA layer over an FP8 base"):
            q(x, quantized=shared)
        q.enable_adapters(True)
        ll.unfuse_lora_linears(_Holder(v))
        assert ll.fp8_product_layer(v, x) is None  # PEFT's own forward
        plain = peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["lin"]),
                                             _Plain(device)).lin
        ll.fuse_lora_linears(_Holder(plain))
        assert ll.fp8_product_layer(plain, x) is None  # a bf16 base
        with pytest.raises(ValueError, match="FP8 base"):
            plain(x, quantized=shared)
    assert ll.fp8_product_layer(q, x) is q.base_layer
    trained = ll.shared_fp8_input(x, (q, k))  # grad mode: _scaled_mm's codes
    assert set(trained) == {"quantized"}
    assert ll.shared_fp8_input(x, (q, k, v)) == {}  # v runs PEFT's own forward now
    assert ll.shared_fp8_input(x, (q, plain)) == {}  # a bf16 base
    for m in (q, k):
        assert torch.equal(m(x, **trained), m(x))


class _Holder(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer


class _Plain(nn.Module):
    def __init__(self, device: str):
        super().__init__()
        self.lin = nn.Linear(K, 16, device=device, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_lora_model(tmp_path_factory):
    """A tiny Qwen3 in bf16 with FP8 projections (``_scaled_mm``'s path on), under LoRA on all seven
    projections with random B (so the adapters change the tokens), and its checkpoint's folder."""
    from swiftune.training import FastModel
    from tests.helpers import save_tiny_checkpoints
    from tests.test_gradient_parity import PROJECTIONS

    path = save_tiny_checkpoints(tmp_path_factory, families=("qwen3",))["qwen3"]
    model, tokenizer = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.bfloat16, device_map="cpu")
    for m in model.modules():
        if isinstance(m, fl.FP8Linear):
            m.scaled_mm = True  # chosen at load on an FP8 GPU; CPU torch has _scaled_mm too
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                     use_gradient_checkpointing=False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in lora_tensors(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval(), tokenizer, path


def test_engine_with_runtime_lora_shares_the_quantisation_and_matches_transformers_peft(fp8_lora_model,
                                                                                          monkeypatch):
    """The engine decoding 18 rows with LoRA at run time over FP8 weights: 3 fewer quantise launches per
    layer and step (q/k/v one, gate/up one), the five LoRA layers given the codes, and the same greedy
    tokens and log-probabilities, bit for bit, as with each projection quantising its own input; those
    log-probabilities within FP8's error of transformers' forward of the dequantised model with PEFT's
    LoRA (float32), which the adapters move by far more than that."""
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
    from tests.test_fp8 import _plain_with_weights

    _require_fp8_path("cpu")
    model, tokenizer, path = fp8_lora_model
    prompts = [tokenizer(t)["input_ids"] for t in ("Reverse: abc\n", "Hi\n")]
    group = 9  # 2 prompts x 9 completions: 18 rows per decode step, in the FP8 x FP8 path's range
    quantise = _count_quantise(monkeypatch)
    given: list[bool] = []  # per fused LoRA node: was it given codes
    apply = ll.LoRALinearFunction.apply
    monkeypatch.setattr(ll.LoRALinearFunction, "apply", lambda *a: given.append(a[-1] is not None) or apply(*a))
    steps: list[int] = []
    attention = rollout_layers.decode_attention
    monkeypatch.setattr(rollout_layers, "decode_attention",
                        lambda a, x, *r: steps.append(x.shape[0]) or attention(a, x, *r))

    def generate(**options):
        quantise.clear(), given.clear(), steps.clear()
        engine = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, kv_bucket=4, check_every=3,
                                   lora="runtime", **{"fp8_stacked_qkv": False, "fp8_stacked_gate_up": False,
                                                      "fp8_norm_codes": False, "lora_decode_kernel": False,
                                                      **options})
        # a product per projection, each input quantised by its own launch: what is counted is the sharing per
        # projection (the stacked products: tests/test_fp8_stacked_qkv.py; the norms' codes:
        # tests/test_fp8_norm_codes.py)
        return engine.generate(prompts, group, SamplingParams(max_tokens=2, temperature=0)), list(quantise), \
            list(given), list(steps)

    with monkeypatch.context() as off:  # "before": every projection quantises its own input
        off.setattr(ll, "quantize_shared_input", lambda x, projections: None)
        before, q_before, given_before, steps_before = generate()
    after, q_after, given_after, steps_after = generate()

    assert steps_before == steps_after and steps_after and set(steps_after) == {len(prompts) * group}
    decode_layers = len(steps_after)  # decode steps x layers
    assert not any(given_before) and sum(given_after) == 5 * decode_layers  # q, k, v, gate, up
    assert len(given_before) == len(given_after) >= 7 * decode_layers  # every projection a LoRA node
    assert len(q_before) - len(q_after) == 3 * decode_layers
    assert after.completion_ids == before.completion_ids
    assert all(len(c) == 2 for c in after.completion_ids)
    for got, want in zip(after.logprobs, before.logprobs):
        assert torch.equal(got, want)
    # the engine's defaults but the LoRA kernel (stacked products, the norms making the codes): the same bits, so
    # the reference below checks them too; with the kernel too (all the defaults): the first kernel run below
    defaults = generate(fp8_stacked_qkv=True, fp8_stacked_gate_up=True, fp8_norm_codes=True)[0]
    assert defaults.completion_ids == after.completion_ids
    for got, want in zip(defaults.logprobs, after.logprobs):
        assert torch.equal(got, want)
    # each adapter's product added in one launch (lora_decode_add_: its sums in another order, and under the
    # interpreter a bf16 store that truncates), with the defaults' stacked products and without: the same tokens,
    # log-probabilities bf16 roundings apart (an ulp of some projection outputs), and the reference's to the
    # bound below, as the ops' are
    kernel_calls = []
    add = ll.lora_decode_add_
    monkeypatch.setattr(ll, "lora_decode_add_", lambda y, *a, **k: kernel_calls.append(y.shape) or add(y, *a, **k))
    kernel_runs = [generate(fp8_stacked_qkv=stacked, fp8_stacked_gate_up=stacked, fp8_norm_codes=stacked,
                            lora_decode_kernel=True)[0] for stacked in (True, False)]
    assert len(kernel_calls) >= 2 * 7 * decode_layers  # every adapted projection of every decode step, both runs
    for run in kernel_runs:
        assert run.completion_ids == after.completion_ids
        for got, want in zip(run.logprobs, after.logprobs):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-2)

    # the reference: transformers + PEFT, unpatched, on the dequantised weights and these adapters
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(_lora_targets(model)), lora_dropout=0.0)
    reference = peft.get_peft_model(_plain_with_weights(path, model), config).eval()
    want_tensors, got_tensors = lora_tensors(reference), lora_tensors(model)
    assert want_tensors.keys() == got_tensors.keys()
    with torch.no_grad():
        for name, p in want_tensors.items():
            p.copy_(got_tensors[name])
    rows = range(0, len(prompts) * group, group)  # greedy: the group's completions are equal
    got = torch.cat([after.logprobs[i] for i in rows])
    want = torch.cat([forward_logprobs(reference, prompts[i // group], after.completion_ids[i], 1.0) for i in rows])
    with reference.disable_adapter():
        bare = torch.cat([forward_logprobs(reference, prompts[i // group], after.completion_ids[i], 1.0)
                          for i in rows])
    # e4m3 activations (3 mantissa bits) and bf16 against float32: tests/test_fp8.py's bound for the
    # _scaled_mm path against the same dequantised reference (its training step's loss); the adapters
    # alone move the log-probabilities by over 50 times that
    err, bound = rel_err(got, want), 1e-3
    assert 0 < err < bound, err
    assert rel_err(bare, want) > 50 * bound, rel_err(bare, want)
    for run in kernel_runs:
        assert rel_err(torch.cat([run.logprobs[i] for i in rows]), want) < bound


def _lora_targets(model: nn.Module) -> set[str]:
    """The projection names the model's adapters sit on."""
    return {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora_tensors(model)}
