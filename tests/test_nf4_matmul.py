"""The weight-only NF4 decode kernel (``swiftune.kernels.nf4_matmul``) and its binding on bitsandbytes layers.

Reference: bitsandbytes itself, never swiftune: its ``Linear4bit`` forward (dequantise, then multiply) on the
same codes, and its ``dequantize_4bit`` for the weight the kernel decodes in registers. On CPU the kernel
runs through the Triton interpreter (tests/conftest.py); on a GPU compiled.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

from swiftune.kernels.nf4_matmul import (  # noqa: E402
    nf4_dequantize_reference,
    nf4_kernel_runs_on,
    nf4_kernel_takes,
    nf4_weight_only_matmul,
)
from swiftune.models.nf4_decode import (  # noqa: E402
    bind_nf4_decode,
    nf4_decode_applies,
    nf4_weight_of,
    unbind_nf4_decode,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _layer(k: int, n: int, dtype: torch.dtype, nested: bool, bias: bool, device: str, seed: int = 0,
           blocksize: int = 64):
    """A bitsandbytes NF4 ``Linear4bit`` quantised from random weights of a few magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0.5, n).reshape(-1, 1)
    layer = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=dtype, compress_statistics=nested, quant_type="nf4",
                              device="meta")
    layer.weight = bnb.nn.Params4bit(w.to(dtype), requires_grad=False, compress_statistics=nested, quant_type="nf4",
                                     blocksize=blocksize)
    if bias:
        layer.bias = nn.Parameter(torch.randn(n, generator=g).to(dtype), requires_grad=False)
    layer = layer.to(device)
    layer.support_avx512bf16_for_cpu = False  # keep the layout it was quantised in (training.quantization)
    return layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nested", [True, False])
def test_decoded_weight_is_bitsandbytes_dequantize_4bit(device, nested):
    """The kernel's decoding formula (its plain-PyTorch form) gives bitsandbytes' own dequantised weight, bit for bit."""
    layer = _layer(256, 96, torch.bfloat16, nested, False, device)
    ref = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    got = nf4_dequantize_reference(nf4_weight_of(layer), torch.bfloat16)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("m,bias,split_k", [(1, False, None), (5, True, None), (16, False, 1), (16, True, 3),
                                            (17, False, 2)])
def test_kernel_equals_bitsandbytes_linear4bit(device, dtype, nested, m, bias, split_k):
    """``y`` against bitsandbytes' ``Linear4bit`` forward on the same codes; K not a multiple of the K step."""
    k, n = 320, 80
    layer = _layer(k, n, dtype, nested, bias, device, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    with torch.no_grad():
        ref = layer(x)
        got = nf4_weight_only_matmul(x, nf4_weight_of(layer), layer.bias, split_k=split_k)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.isfinite(got).all()
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocksize,k", [(32, 160), (128, 384), (256, 512)])
def test_kernel_takes_other_absmax_blocks(device, blocksize, k):
    """Absmax blocks of 32 (a K step of 32 columns), 128 and 256 (steps of 128 inside one block): the kernel
    itself (``backend="triton"``), against bitsandbytes' forward, with K split into ranges and tiles of 16 rows."""
    if not nf4_kernel_runs_on(torch.device(device)):
        pytest.skip("the kernel runs on this device only interpreted (the CPU run of the suite covers it)")
    layer = _layer(k, 48, torch.bfloat16, True, True, device, blocksize=blocksize)
    w = nf4_weight_of(layer)
    assert w.blocksize == blocksize and nf4_kernel_takes(w)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)
    with torch.no_grad():
        ref = layer(x)
        for split_k, block_n, stages, lookup in [(None, None, None, None), (2, 16, 2, 1), (None, 32, 3, 2)]:
            got = nf4_weight_only_matmul(x, w, layer.bias, backend="triton", split_k=split_k, block_n=block_n,
                                         num_stages=stages, lookup=lookup)
            assert _rel(got, ref) < 8e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nested", [True, False])
def test_unrolled_k_loops_equal_bitsandbytes(device, nested):
    """2 and 4 K steps an iteration (their loads first), alone and with K split into ranges; K = 320 (5 steps of
    64) takes one step an iteration whatever is asked."""
    if not nf4_kernel_runs_on(torch.device(device)):
        pytest.skip("the kernel runs on this device only interpreted (the CPU run of the suite covers it)")
    for k in (1024, 320):
        layer = _layer(k, 40, torch.bfloat16, nested, True, device, seed=k)
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
        with torch.no_grad():
            ref = layer(x)
            for unroll, split_k in [(2, None), (4, None), (4, 2), (2, 3)]:
                got = nf4_weight_only_matmul(x, nf4_weight_of(layer), layer.bias, backend="triton", unroll=unroll,
                                             split_k=split_k)
                assert _rel(got, ref) < 8e-3, (k, unroll, split_k)


def test_rows_straddling_absmax_blocks_are_refused_and_left_unbound():
    """K = 96 with blocks of 64: a row's codes start inside a block, which the kernel's one-absmax-per-step loop
    cannot read (and bitsandbytes' CPU layout of such a weight is not the flat formula): the matmul refuses it
    with what to do, and bind_nf4_decode leaves the layer on bitsandbytes' forward (equal to its unbound output)."""
    model = nn.Sequential(_layer(96, 40, torch.float32, True, False, "cpu"), nn.ReLU(),
                          _layer(40, 64, torch.float32, True, False, "cpu", seed=1))
    w = nf4_weight_of(model[0])
    assert not nf4_kernel_takes(w) and not nf4_kernel_takes(nf4_weight_of(model[2]))  # 40 % 64 != 0
    with pytest.raises(ValueError, match="multiple of the absmax blocksize"):
        nf4_weight_only_matmul(torch.randn(2, 96), w)
    x = torch.randn(2, 96)
    with torch.no_grad():
        ref = model(x)
        assert bind_nf4_decode(model) == 0
        assert torch.equal(model(x), ref)


def test_refusals_say_what_to_change():
    layer = _layer(64, 32, torch.float32, True, False, "cpu")
    w = nf4_weight_of(layer)
    with pytest.raises(ValueError, match="in_features"):
        nf4_weight_only_matmul(torch.randn(2, 63), w)
    with pytest.raises(ValueError, match="block_n"):
        nf4_weight_only_matmul(torch.randn(2, 64), w, block_n=24)
    with pytest.raises(ValueError, match="num_stages"):
        nf4_weight_only_matmul(torch.randn(2, 64), w, num_stages=0)
    with pytest.raises(ValueError, match="lookup"):
        nf4_weight_only_matmul(torch.randn(2, 64), w, lookup=3)
    with pytest.raises(ValueError, match="unroll"):
        nf4_weight_only_matmul(torch.randn(2, 64), w, unroll=3)
    with pytest.raises(RuntimeError, match="no_grad"):
        nf4_weight_only_matmul(torch.randn(2, 64, requires_grad=True), w)


def test_bound_layers_run_the_kernel_for_few_rows_without_gradients(monkeypatch):
    """bind_nf4_decode: a no-grad call of 2-16 rows runs the kernel (and equals bitsandbytes); one row, more rows,
    or gradients, run bitsandbytes' own forward; unbinding restores the class's forward."""
    device = DEVICES[-1]  # where the kernel runs: CUDA when there is one (CPU only interpreted)
    model = nn.Sequential(_layer(128, 64, torch.float32, True, True, device), nn.ReLU(),
                          _layer(64, 32, torch.float32, True, False, device, seed=1))
    x = torch.randn(4, 128, device=device)
    with torch.no_grad():
        ref = model(x)
    assert bind_nf4_decode(model) == 2 and bind_nf4_decode(model) == 0
    import swiftune.models.nf4_decode as nd

    calls = []
    real = nd.nf4_weight_only_matmul
    monkeypatch.setattr(nd, "nf4_weight_only_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))

    def reads_quant_state(module):  # a bound call must not: its offset is a device tensor (a sync in a capture)
        raise AssertionError("the bound forward read the layer's quant_state")

    real_weight_of = nd.nf4_weight_of
    monkeypatch.setattr(nd, "nf4_weight_of", reads_quant_state)
    with torch.no_grad():
        got = model(x)
        model(torch.randn(17, 128, device=device))
    assert len(calls) == 2 and _rel(got, ref) < 1e-5
    model(x)  # gradients enabled: bitsandbytes
    assert len(calls) == 2
    assert not nf4_decode_applies(torch.randn(2, 8))  # gradients enabled
    with torch.no_grad():
        assert nf4_decode_applies(torch.randn(2, 8, 8, device=device))
        assert not nf4_decode_applies(torch.randn(3, 6, 8, device=device))
        assert not nf4_decode_applies(torch.randn(1, 1, 8, device=device))  # bitsandbytes' one-row kernel
        model(x[:1])
    assert len(calls) == 2
    assert unbind_nf4_decode(model) == 2
    assert all("forward" not in m.__dict__ for m in model)
    with torch.no_grad():
        model(x)
    assert len(calls) == 2
    # a binding of up to 32 rows: 17 and 32 rows take the kernel, 33 does not; bounds outside 2..64 are refused
    x17 = torch.randn(17, 128, device=device)
    with torch.no_grad():
        ref17 = model(x17)
    monkeypatch.setattr(nd, "nf4_weight_of", real_weight_of)  # binding reads it; bound calls do not (above)
    assert bind_nf4_decode(model, max_rows=32) == 2
    with torch.no_grad():
        assert _rel(model(x17), ref17) < 1e-5
        assert len(calls) == 4
        model(torch.randn(32, 128, device=device))
        assert len(calls) == 6
        model(torch.randn(33, 128, device=device))
        assert len(calls) == 6
    unbind_nf4_decode(model)
    for bad in (1, 65, 16.0, True):
        with pytest.raises(ValueError, match="max_rows"):
            bind_nf4_decode(model, max_rows=bad)
    assert all("forward" not in m.__dict__ for m in model)  # a refused bound binds nothing


def test_peft_qlora_layers_keep_their_adapters():
    """PEFT's QLoRA layer is also named ``Linear4bit`` and exposes its base's ``weight``: only the bitsandbytes
    base is bound, so a bound model's no-grad output still holds the adapters (equal to PEFT's unbound)."""
    import peft

    model = nn.Sequential()
    model.add_module("proj", _layer(128, 64, torch.float32, True, False, "cpu"))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"],
                                                       init_lora_weights=False))
    x = torch.randn(3, 128)
    with torch.no_grad():
        ref = model(x)
        assert bind_nf4_decode(model) == 1
        got = model(x)
    assert _rel(got, ref) < 1e-5
    assert _rel(got, model.base_model.model.proj.base_layer(x)) > 1e-3  # the adapters count


def test_kernel_benchmark_table_checks_the_kernel_against_bitsandbytes(monkeypatch):
    """``benchmarks.kernels --nf4-matmul``'s rows, on one small shape on CPU (the kernel interpreted): the
    kernel's product is compared with bitsandbytes' own on the same layer, and a wrong one is caught."""
    import benchmarks.kernels as kb

    calls = []

    def timed(fn, copies):
        for i in range(copies):
            fn(i)
        calls.append(copies)
        return 1.0

    rows = kb.nf4_matmul_rows(1e9, shapes={"tiny": (64, 256)}, ms=(1, 3), device="cpu", timed=timed,
                               copies=2)
    assert [r["m"] for r in rows] == [1, 3] and calls == [2] * 6  # ours, bitsandbytes, bf16 at each M
    assert all(r["rel_err"] < 1e-2 and r["vs_bnb"] == 1.0 for r in rows), rows
    # the check is live: a kernel that drops the absmax scale is far from bitsandbytes
    import swiftune.kernels.nf4_matmul as nm

    real = nm.nf4_weight_only_matmul
    monkeypatch.setattr(nm, "nf4_weight_only_matmul", lambda x, w, *a, **k: 2 * real(x, w, *a, **k))
    bad = kb.nf4_matmul_rows(1e9, shapes={"tiny": (64, 256)}, ms=(1,), device="cpu", timed=timed, copies=2)
    assert bad[0]["rel_err"] > 0.5


def test_kernel_sweep_checks_every_setting_against_bitsandbytes():
    """``--nf4-matmul``'s sweep of tile widths, K splits and pipeline depths, on a small shape on CPU: every
    setting runs the kernel and its product is checked against bitsandbytes' on the same layer."""
    import benchmarks.kernels as kb

    rows = kb.nf4_sweep_rows(1e9, shapes={"tiny": ((48, 256), 3)}, device="cpu", timed=lambda fn, copies: 1.0,
                             copies=2, block_ns=(16, 32), splits=(None, 2), stages=(2,), lookups=(0, 2),
                             unrolls=(1, 2))
    assert [(r["block_n"], r["split_k"], r["lookup"], r["unroll"]) for r in rows] == [
        (b, s, lookup, u) for b in (16, 32) for s in ("auto", 2) for lookup in (0, 2) for u in (1, 2)]
    assert all(r["rel_err"] < 1e-2 for r in rows), rows
