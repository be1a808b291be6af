"""The fused per-row FP8 quantise kernel (``swiftune.kernels.fp8_quant``) against plain PyTorch.

Reference: torch's own ops written out here (absmax, ``/ 448``, divide, clamp,
``.to(torch.float8_e4m3fn)``), never swiftune. The kernel must give the same e4m3 bytes and the same
float32 scales, bit for bit: on CPU through the Triton interpreter (tests/conftest.py), on the GPU
compiled. The kernel rounds to e4m3 in float32 before its cast, so the interpreter's own (wrong at
mantissa carries) float32 -> e4m3 conversion never decides a byte; see the module docstring.
"""

from __future__ import annotations

import pytest
import torch

from swiftune.kernels import fp8_quantize_rowwise, fp8_quantize_rowwise_reference

E4M3 = torch.float8_e4m3fn


def _torch_quant(x: torch.Tensor, col: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: v = x (* col) in float32, s = max|v| / 448 (1 for a zero row), q = e4m3(clamp(v / s))."""
    v = x.float() if col is None else x.float() * col.float()
    amax = v.abs().amax(dim=-1, keepdim=True)
    # divided by a tensor: CUDA torch turns `/ 448.0` into a multiply by float32(1 / 448), which is not
    # the IEEE quotient (off by an ulp for about half of all values); CPU torch divides either way
    s = amax / torch.full_like(amax, 448.0)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (v / s).clamp(-448.0, 448.0).to(E4M3), s


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (wq, ws) = got, want
    assert q.dtype == E4M3 and s.dtype == torch.float32
    assert q.shape == wq.shape and s.shape == ws.shape
    diff = (q.view(torch.uint8) != wq.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} of {q.numel()} e4m3 codes differ"
    assert torch.equal(s, ws)
    assert q.is_contiguous()


def _rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows spanning 12 decades within a row (subnormal e4m3 codes appear), a row of zeros,
    a row with huge magnitudes and one with tiny ones."""
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g) * torch.logspace(-8, 4, n)[torch.randperm(n, generator=g)]
    x2 = x.view(-1, n)
    x2[0] = 0.0
    if x2.shape[0] > 2:
        x2[1] *= 1e30 if dtype == torch.float32 else 1e32  # bf16's range is float32's
        x2[2] *= 1e-30
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 1), (5, 33), (2, 3, 129), (4, 5000)], ids=["w1", "w33", "w129", "w5000"])
def test_kernel_bytes_and_scales_equal_torch(device, dtype, shape):
    x = _rows(shape, dtype).to(device)
    want = _torch_quant(x)
    _assert_same(fp8_quantize_rowwise(x, backend="triton"), want)
    _assert_same(fp8_quantize_rowwise_reference(x), want)
    q, s = fp8_quantize_rowwise(x, backend="triton")
    zero = x.reshape(-1, shape[-1])[0]
    assert torch.all(s.reshape(-1, 1)[0] == 1.0) and torch.all(q.reshape(-1, shape[-1])[0].float() == 0) and not zero.any()
    # the largest magnitude of each row maps to 448 exactly, and the values round-trip within e4m3's 2^-4
    nonzero = s.reshape(-1)[1:] != 1.0
    assert torch.all(q.float().abs().reshape(-1, shape[-1]).amax(-1)[1:][nonzero] == 448.0)
    deq = q.double() * s.double()
    big = x.double().abs() > (s.double() * 2**-6)  # the normal e4m3 range of each row
    assert torch.all(((deq - x.double()).abs() <= x.double().abs() * 2**-4)[big])


def test_ties_round_to_even_and_every_code_is_reached(device):
    """A row whose absmax is 448 (scale 1, so the codes are the values themselves): every e4m3 value,
    and every midpoint between neighbours (ties, to even), subnormals included."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448, the finite positives
    mids = (codes[:-1] + codes[1:]) / 2
    row = torch.cat([codes, mids, -codes, -mids, torch.tensor([448.0, 447.0, 440.0, 1e-4, -3e-3])])
    x = row[None].to(device)
    q, s = fp8_quantize_rowwise(x, backend="triton")
    _assert_same((q, s), _torch_quant(x))
    assert s.item() == 1.0
    assert torch.equal(q[0, :127].view(torch.uint8).cpu(), torch.arange(0, 127, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_scale_is_multiplied_in_float32(device, dtype):
    """The FP8 linear's backward quantises ``g * s^T`` (its weight's per-row scales): one float32
    product per element, as torch's ``g.float() * s``."""
    x = _rows((6, 4500), dtype, seed=1).to(device)
    col = (torch.rand(4500, generator=torch.Generator().manual_seed(2)) * 1e-2 + 1e-4).to(device)
    want = _torch_quant(x, col)
    _assert_same(fp8_quantize_rowwise(x, col, backend="triton"), want)
    _assert_same(fp8_quantize_rowwise_reference(x, col), want)
    _assert_same(fp8_quantize_rowwise(x[:, :96], col[:96], backend="triton"), _torch_quant(x[:, :96], col[:96]))


def test_strided_rows_and_64_bit_indexing(device):
    x = _rows((8, 200), torch.float32, seed=3).to(device)
    view = x[::2, 10:110]  # rows 400 elements apart, 100 wide: not contiguous
    _assert_same(fp8_quantize_rowwise(view, backend="triton"), _torch_quant(view))
    _assert_same(fp8_quantize_rowwise(view, backend="triton", _force_int64=True), _torch_quant(view))
    empty = torch.empty(0, 16, device=device)
    q, s = fp8_quantize_rowwise(empty, backend="triton")
    assert q.shape == (0, 16) and s.shape == (0, 1)


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError, match="floating tensor"):
        fp8_quantize_rowwise(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="col_scale must have x's last dimension"):
        fp8_quantize_rowwise(torch.ones(2, 4), torch.ones(3))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        fp8_quantize_rowwise(torch.ones(2, 0))
    with pytest.raises(RuntimeError, match="no backward"):
        fp8_quantize_rowwise(torch.ones(2, 4, requires_grad=True))


def test_fp8_linear_scaled_mm_path_quantises_exactly_as_torch(device, monkeypatch):
    """The FP8 linear's ``_scaled_mm`` path quantises its activation (forward) and the gradient times
    the weight's row scales (backward) through ``fp8_quantize_rowwise``: the fused kernel on CUDA, its
    reference on CPU. Its outputs equal ``_scaled_mm`` on torch's own quantisation exactly (same bytes
    in, same matmul). On an FP8 GPU the path is chosen at load; on CPU it is switched on (CPU torch
    has ``_scaled_mm`` too)."""
    from torch import nn

    import swiftune.models.fp8_linear as fl

    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    torch.manual_seed(0)
    layer = fl.FP8Linear.from_linear(nn.Linear(1024, 512, bias=False, device=device, dtype=torch.bfloat16))
    assert layer.scaled_mm == (device == "cuda")
    layer.scaled_mm = True
    launches = []
    quant = fl.fp8_quantize_rowwise
    monkeypatch.setattr(fl, "fp8_quantize_rowwise",
                        lambda *a, **k: launches.append(k.get("backend")) or quant(*a, **k))
    x = torch.randn(3, 100, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(3, 100, 512, device=device, dtype=torch.bfloat16)
    w, s = layer.weight, layer.weight_scale
    xq, xs = _torch_quant(x.detach().reshape(-1, 1024))
    gq, gs = _torch_quant(g.reshape(-1, 512), s.view(-1))
    try:
        want_y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
        want_dx = torch._scaled_mm(gq, w.t().contiguous().t(), scale_a=gs,
                                   scale_b=torch.ones(1, 1024, device=device), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm with per-row scales does not run on this {device} torch: {e}")
    y = layer(x)
    y.backward(g)
    assert launches == (["auto", "auto"] if device == "cuda" else ["reference", "reference"])
    assert torch.equal(y.reshape(-1, 512), want_y)
    assert torch.equal(x.grad.reshape(-1, 1024), want_dx)
    assert want_y.abs().sum() > 0 and want_dx.abs().sum() > 0
