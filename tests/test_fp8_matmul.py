"""The weight-only FP8 decode kernel (``swiftune.kernels.fp8_matmul``) and its use in ``FP8Linear``.

Reference: a float64 formula in plain torch, ``x (Q * s)^T + b`` with ``Q`` decoded by torch's own
``float8_e4m3fn -> float64`` conversion, never swiftune; the decoding of every byte against torch's
``float8_e4m3fn -> float32``; for the rollout engine, transformers' own ``generate`` on the unpatched
model holding the dequantised weights. On CPU the kernel runs through the Triton interpreter
(tests/conftest.py); on a GPU compiled.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import swiftune.models.fp8_linear as fl
from swiftune.kernels import fp8_weight_only_matmul, fp8_weight_only_matmul_reference

E4M3 = torch.float8_e4m3fn


def _operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0, device: str = "cpu"):
    """x ``[m, k]``, e4m3 codes spanning e4m3's range (subnormals included), per-row scales, bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * torch.logspace(-3, 2.4, k)[torch.randperm(k, generator=g)]).clamp(-448, 448)
    q = w.to(E4M3)
    s = torch.rand(n, generator=g) * 1e-2 + 1e-3
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return (x.to(device), q.to(device), s.to(device), None if b is None else b.to(device))


def _float64(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ (q.double() * s.double().reshape(-1, 1)).t()
    return y if b is None else y + b.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _assert_close(y: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: within float32 summation error of the float64 value; bf16/fp16: within one rounding of it."""
    assert y.dtype == dtype and y.shape == want.shape
    assert torch.isfinite(y).all()
    if dtype == torch.float32:
        assert _rel(y, want) < 1e-6
    else:
        half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # relative, at most (just above a power of 2)
        err = (y.double() - want).abs()
        assert torch.all(err <= want.abs() * half_ulp + 1e-6 * want.abs().max()), float(err.max())
        assert _rel(y, want) < 4e-3


_SHAPES = [(1, 37, 53, None), (5, 100, 300, 2), (16, 64, 256, None), (33, 129, 130, 3), (64, 70, 256, 2)]
_CASES = ([(dtype, *shape, bias) for dtype in (torch.float32, torch.bfloat16) for shape in _SHAPES
           for bias in (False, True)]
          + [(torch.float16, 1, 37, 53, None, True), (torch.float16, 33, 129, 130, 3, False)])


@pytest.mark.parametrize("dtype,m,n,k,split,bias", _CASES,
                         ids=[f"{str(c[0])[6:]}-m{c[1]}-n{c[2]}-k{c[3]}-split{c[4]}-{'bias' if c[5] else 'nobias'}"
                              for c in _CASES])
def test_kernel_equals_float64_formula(device, dtype, m, n, k, split, bias):
    x, q, s, b = _operands(m, n, k, dtype, bias, device=device)
    with torch.no_grad():
        y = fp8_weight_only_matmul(x, q, s, b, backend="triton", split_k=split)
        ref = fp8_weight_only_matmul_reference(x, q, s, b)
    want = _float64(x, q, s, b)
    _assert_close(y, want, dtype)
    _assert_close(ref, want, dtype)
    assert want.abs().max() > 0


def test_leading_axes_strided_x_and_64_bit_indexing(device):
    x, q, s, b = _operands(6, 40, 96, torch.float32, True, seed=1, device=device)
    x3 = torch.randn(2, 3, 200, device=device)[..., 50:146]  # rows 200 apart, not contiguous
    with torch.no_grad():
        y = fp8_weight_only_matmul(x3, q, s.view(-1, 1), b, backend="triton")
        y64 = fp8_weight_only_matmul(x3, q.view(torch.uint8), s, b, backend="triton", _force_int64=True, split_k=2)
    want = _float64(x3.reshape(-1, 96), q, s, b).view(2, 3, 40)
    assert y.shape == (2, 3, 40)
    assert _rel(y, want) < 1e-6 and _rel(y64, want) < 1e-6
    # the fixed-order split-K reduction: a repeat gives the same bits
    with torch.no_grad():
        again = fp8_weight_only_matmul(x3, q, s, b, backend="triton", _force_int64=True, split_k=2)
    assert torch.equal(again, y64)


@pytest.mark.parametrize("m,split,bias", [(5, 2, True), (16, 3, False), (40, 4, True)])
def test_split_reduced_in_launch_equals_second_launch_bit_for_bit(device, m, split, bias):
    """A split K's partials added by each tile's last program (``reduce_in_launch``) give the bits of the second
    reduce launch, with several column tiles (and row tiles past 16 rows), within the float64 formula's
    bound; a repeat gives them again (the tile counts were left at zero). On CUDA: 100 back-to-back calls."""
    x, q, s, b = _operands(m, 200, 1024, torch.bfloat16, bias, seed=split, device=device)
    repeats = 100 if device == "cuda" else 1
    with torch.no_grad():
        launched = fp8_weight_only_matmul(x, q, s, b, backend="triton", split_k=split, block_n=32,
                                          reduce_in_launch=False)
        here = [fp8_weight_only_matmul(x, q, s, b, backend="triton", split_k=split, block_n=32, reduce_in_launch=True)
                for _ in range(repeats)]
        again = fp8_weight_only_matmul(x, q, s, b, backend="triton", split_k=split, block_n=32, reduce_in_launch=True)
    assert all(torch.equal(y, launched) for y in here) and torch.equal(again, launched)
    _assert_close(launched, _float64(x, q, s, b), torch.bfloat16)
    assert launched.abs().max() > 0


def _decodes(device: str) -> list[str]:
    native = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    return ["bits", "native"] if native else ["bits"]


def test_every_e4m3_byte_decodes_as_torch(device):
    """All 256 codes, each the only weight of its output row (``K = 1``, ``x = 1``, ``s = 1``: ``y`` is
    the decoded code, NaNs stay NaN), and the 254 finite codes along K of one row against one-hot
    rows of x (``M = 254``: the codes inside full ``tl.dot`` tiles, four row tiles)."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(E4M3).float()
    finite = codes[~want.isnan()]
    for decode in _decodes(device):
        with torch.no_grad():
            y = fp8_weight_only_matmul(torch.ones(1, 1, device=device), codes.view(E4M3)[:, None].to(device),
                                       torch.ones(256, device=device), backend="triton", decode=decode)[0].cpu()
        assert torch.equal(y.isnan(), want.isnan()), decode
        assert torch.equal(y[~want.isnan()], want[~want.isnan()]), decode
        assert y.isnan().sum() == 2  # 0x7F and 0xFF
        eye = torch.eye(finite.numel(), device=device)
        with torch.no_grad():
            y = fp8_weight_only_matmul(eye, finite.view(E4M3)[None].to(device), torch.ones(1, device=device),
                                       backend="triton", decode=decode)[:, 0].cpu()
        assert torch.equal(y, finite.view(E4M3).float()), decode


def test_bad_inputs_are_refused():
    x, q, s, b = _operands(2, 8, 16, torch.float32, True)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_weight_only_matmul(x, q.float(), s)
    with pytest.raises(ValueError, match="in_features"):
        fp8_weight_only_matmul(x[:, :8], q, s)
    with pytest.raises(ValueError, match="one float32 value per output row"):
        fp8_weight_only_matmul(x, q, s[:4])
    with pytest.raises(ValueError, match="bias must have"):
        fp8_weight_only_matmul(x, q, s, b[:3])
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        fp8_weight_only_matmul(x, q, s, block_n=24)
    with pytest.raises(RuntimeError, match="no backward"):
        fp8_weight_only_matmul(x.requires_grad_(), q, s)


def _counting(monkeypatch) -> list[int]:
    """Count the FP8 linear's calls of the weight-only kernel's launcher (rows per call)."""
    calls: list[int] = []
    launcher = fl.fp8_weight_only_matmul
    monkeypatch.setattr(fl, "fp8_weight_only_matmul", lambda x2, *a, **k: calls.append(x2.shape[0]) or launcher(x2, *a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_linear_no_grad_small_m_forward_equals_formula(device, dtype, monkeypatch):
    """Under ``no_grad`` with at most DECODE_MAX_ROWS rows the layer runs the weight-only kernel, and
    gives ``F.linear(x, Q * s, b)`` in float64 (the formula of the reference forward); with more rows,
    or with grad mode on (training), it does not call it."""
    torch.manual_seed(0)
    layer = fl.FP8Linear.from_linear(nn.Linear(96, 80, device=device, dtype=dtype))
    calls = _counting(monkeypatch)
    x = torch.randn(2, 3, 96, device=device, dtype=dtype)
    want = nn.functional.linear(x.double(), layer.weight.double() * layer.weight_scale.double(), layer.bias.double())
    with torch.no_grad():
        y = layer(x)
    assert calls == [6]
    _assert_close(y, want, dtype)
    with torch.no_grad():
        layer(torch.randn(fl.DECODE_MAX_ROWS + 1, 96, device=device, dtype=dtype))
    layer(x)  # grad mode: the autograd path (training keeps _scaled_mm where it runs)
    assert calls == [6]
    # the reference forward (grad mode, the dequantising path: the weight dequantised to the compute
    # dtype, one matmul in it; on an FP8 GPU the layer's training path is _scaled_mm, which rounds x to
    # e4m3 too, so it is switched off here) is as close as its roundings allow: up to bf16 error
    layer.scaled_mm = False
    ref = layer(x)
    assert _rel(ref, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert _rel(y, want) <= _rel(ref, want) + 1e-7


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "a-product-each"])
def test_fp8_engine_greedy_tokens_equal_transformers_generate(tmp_path_factory, monkeypatch, stacked):
    """The fast rollout engine on an FP8 model without adapters decodes through the weight-only
    kernel (every prefill and decode product has <= DECODE_MAX_ROWS rows here) and gives transformers' own greedy
    tokens on the unpatched model holding the dequantised weights; with q/k/v as one product and gate/up as one (the
    defaults), and with a product per projection."""
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
    from swiftune.training import FastModel
    from tests.helpers import save_tiny_checkpoints
    from tests.test_fp8 import _plain_with_weights

    path = save_tiny_checkpoints(tmp_path_factory, families=("qwen3",))["qwen3"]
    model, tokenizer = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.float32, device_map="cpu")
    model.eval()
    reference = _plain_with_weights(path, model).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("Reverse: abc\n", "Hi\n")]
    calls = _counting(monkeypatch)
    engine = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, kv_bucket=4, check_every=3,
                               fp8_stacked_qkv=stacked, fp8_stacked_gate_up=stacked)
    out = engine.generate(prompts, 1, SamplingParams(max_tokens=5, temperature=0))
    layers = sum(isinstance(m, fl.FP8Linear) for m in model.modules())
    products = layers - (3 * len(model.model.layers) if stacked else 0)  # stacked: q/k/v one product, gate/up one
    assert layers and len(calls) >= 5 * products  # the prefill and every decode step through the kernel
    for prompt, got in zip(prompts, out.completion_ids):
        with torch.no_grad():
            ref = reference.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                     dtype=torch.long), do_sample=False, max_new_tokens=5,
                                     pad_token_id=tokenizer.pad_token_id)
        assert got == ref[0, len(prompt):].tolist()


def test_fp8_lora_layers_under_no_grad_take_the_weight_only_kernel(tmp_path_factory, monkeypatch):
    """A LoRA model on FP8 bases (swiftune's fused LoRA node, as the engine runs adapters with
    ``lora="runtime"``) multiplies its bases with the weight-only kernel under ``no_grad``, with the
    logits of its training-mode forward (the dequantising path, which tests/test_fp8.py holds against
    PEFT on the dequantised weights); in grad mode it does not call the kernel."""
    from swiftune.training import FastModel
    from tests.helpers import save_tiny_checkpoints

    path = save_tiny_checkpoints(tmp_path_factory, families=("qwen3",))["qwen3"]
    model, _ = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.float32, device_map="cpu")
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    with torch.no_grad():  # adapters that change the output, so a dropped adapter shows
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.tensor([[5, 9, 17, 33, 2, 71]])
    calls = _counting(monkeypatch)
    train_logits = model(input_ids=ids).logits.detach()
    assert calls == []
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    layers = sum(isinstance(m, fl.FP8Linear) for m in model.modules())
    assert layers and len(calls) == layers and set(calls) == {ids.numel()}
    assert _rel(logits, train_logits) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernel: needs CUDA")
@pytest.mark.parametrize("m", [8, 64])
def test_cuda_qwen3_8b_projection_compiled_equals_reference(m):
    """A Qwen3-8B MLP projection (K = 4096, N = 12288) compiled, both decodings and a forced split-K
    and tile width, against the float64 formula; a CUDA graph replay of the launcher equals its
    eager result bit for bit (no host sync, deterministic sums)."""
    x, q, s, b = _operands(m, 12288, 4096, torch.bfloat16, False, device="cuda")
    want = _float64(x, q, s, b)
    with torch.no_grad():
        for decode in _decodes("cuda"):
            for block_n, split in ((None, None), (64, 4), (128, 1)):
                y = fp8_weight_only_matmul(x, q, s, b, decode=decode, block_n=block_n, split_k=split)
                _assert_close(y, want, torch.bfloat16)
        eager = fp8_weight_only_matmul(x, q, s, b, split_k=2)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fp8_weight_only_matmul(x, q, s, b, split_k=2)  # compiled before the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            captured = fp8_weight_only_matmul(x, q, s, b, split_k=2)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_fp8_linear_no_grad_17_to_64_rows_take_the_fp8_dot_kernel(device, monkeypatch):
    """Under ``no_grad`` with DECODE_MAX_ROWS < M <= DOT_DECODE_MAX_ROWS rows, where ``_scaled_mm`` would run,
    the layer multiplies with the FP8 x FP8 decode kernel and gives the float64 formula of ``_scaled_mm``'s
    math (x rounded to e4m3 with its own per-row scale, then ``x_q (Q * s)^T + b``); above the range, or in
    grad mode, it does not call the kernel. The formula's activation codes come from torch's own e4m3 cast."""
    from tests.test_fp8 import _require_cpu_scaled_mm

    if device == "cpu":
        _require_cpu_scaled_mm()
    elif torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("_scaled_mm needs FP8 tensor cores")
    torch.manual_seed(0)
    layer = fl.FP8Linear.from_linear(nn.Linear(96, 80, device=device, dtype=torch.bfloat16), scaled_mm=True)
    calls: list[int] = []
    launcher = fl.fp8_dot_matmul
    monkeypatch.setattr(fl, "fp8_dot_matmul", lambda x2, *a, **k: calls.append(x2.shape[0]) or launcher(x2, *a, **k))
    x = torch.randn(40, 96, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
    assert calls == [40]
    sx = x.double().abs().amax(dim=1, keepdim=True) / 448.0
    xq = (x.double() / sx).float().to(E4M3).double() * sx  # torch's own rounding to e4m3
    want = xq @ (layer.weight.double() * layer.weight_scale.double()).t() + layer.bias.double()
    assert _rel(y, want) < 1e-2  # the bf16 output's rounding and float32 sums
    assert _rel(y, want) < _rel(y, _float64(x, layer.weight, layer.weight_scale.reshape(-1), layer.bias)) + 1e-3
    with torch.no_grad():
        layer(torch.randn(fl.DOT_DECODE_MAX_ROWS + 1, 96, device=device, dtype=torch.bfloat16))
    layer(x)  # grad mode: the training path
    assert calls == [40]


def test_reduce_decode_splits_in_launch_reaches_both_decode_kernels(tmp_path_factory, monkeypatch):
    """``reduce_decode_splits_in_launch(model)`` sets every FP8 layer of a LoRA model on FP8 bases, and its
    decode products then ask both kernels for the in-launch reduction (few rows: the weight-only kernel;
    17..64 rows: the FP8 x FP8 one, with stacked q/k/v and gate/up where the engine stacks them); off, they
    ask for the second launch. The logits are the same bits either way (the reductions add the same partials
    in the same order)."""
    from swiftune.training import FastModel
    from tests.helpers import save_tiny_checkpoints
    from tests.test_fp8 import _require_cpu_scaled_mm

    _require_cpu_scaled_mm()  # 17..64 rows take the FP8 x FP8 kernel where _scaled_mm would run
    path = save_tiny_checkpoints(tmp_path_factory, families=("qwen3",))["qwen3"]
    model, _ = FastModel.from_pretrained(path, load_in_fp8=True, dtype=torch.bfloat16, device_map="cpu")
    for layer in model.modules():
        if isinstance(layer, fl.FP8Linear):
            layer.scaled_mm = True
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    asked: list[tuple[str, bool]] = []
    for name in ("fp8_weight_only_matmul", "fp8_dot_matmul"):
        launcher = getattr(fl, name)
        monkeypatch.setattr(fl, name, lambda *a, _n=name, _f=launcher, **k: asked.append((_n, k["reduce_in_launch"]))
                            or _f(*a, **k))
    few, many = torch.tensor([[5, 9, 17, 33]]), torch.randint(3, 90, (1, 20))
    layers = sum(isinstance(m, fl.FP8Linear) for m in model.modules())
    logits = {}
    for enabled in (False, True):
        assert fl.reduce_decode_splits_in_launch(model, enabled) == layers > 0
        asked.clear()
        with torch.no_grad():
            logits[enabled] = (model(input_ids=few).logits, model(input_ids=many).logits)
        assert {n for n, _ in asked} == {"fp8_weight_only_matmul", "fp8_dot_matmul"}, asked
        assert {flag for _, flag in asked} == {enabled}
    assert all(torch.equal(a, b) for a, b in zip(logits[False], logits[True]))
