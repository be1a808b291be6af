"""``swiftune.kernels.lora_decode_add_``: a LoRA adapter's product added to its base product in two launches.

References: the float64 formula ``y + s (x A^T) B^T`` and PEFT's own ``lora.Linear`` forward (its base layer and
adapters, unpatched). On the CPU the kernel runs through the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from swiftune.kernels.lora_decode import LORA_DECODE_MAX_ROWS, lora_decode_add_, lora_decode_add_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, k, n, r, y_dtype, lora_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(y_dtype)
    a = (torch.randn(r, k, generator=g) / k ** 0.5).to(lora_dtype)
    b = torch.randn(n, r, generator=g).to(lora_dtype)
    wide = torch.randn(m, n + 40, generator=g).to(y_dtype)  # y: a column slice of a wider product
    return (t.to(DEVICE) for t in (x, a, b, wide))


@pytest.mark.parametrize("m", [1, 8, 17, 64])
@pytest.mark.parametrize("k,n,r", [(64, 96, 16), (200, 300, 8)])
@pytest.mark.parametrize("y_dtype,lora_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float32)])
def test_lora_decode_add_is_the_formula_in_place(m, k, n, r, y_dtype, lora_dtype):
    x, a, b, wide = _operands(m, k, n, r, y_dtype, lora_dtype, seed=m + k)
    before = wide.clone()
    y = wide[:, 24:24 + n]
    with torch.no_grad():
        out = lora_decode_add_(y, x, a, b, 0.75, backend="triton")
    assert out.data_ptr() == y.data_ptr()
    assert torch.equal(wide[:, :24], before[:, :24]) and torch.equal(wide[:, 24 + n:], before[:, 24 + n:])
    # float64: h rounded to the adapter's dtype as torch.mm's result is, then one rounding to y's dtype
    h = (x.double() @ a.double().t()).to(lora_dtype).double()
    want = before[:, 24:24 + n].double() + 0.75 * (h @ b.double().t())
    rounding = torch.finfo(y_dtype).eps  # the one rounding of the result (2^-7 bf16, 2^-23 float32)
    # the adapter's two sums, each in float32 in its own order: x A^T's error (|x| |A|^T bounds |h|) carried
    # through B, then h B^T's (CUDA's cuBLAS and the kernel split K differently: both count)
    inexact = torch.finfo(lora_dtype).eps * ((x.double().abs() @ a.double().abs().t()) @ b.double().abs().t()) * 0.75 * 8
    err = (y.double() - want).abs()
    assert (err <= want.abs() * rounding + inexact + 1e-30).all(), err.max()
    # the ops it replaces: equal to float32 rounding before the last rounding (an ulp of y's dtype at most)
    ref = lora_decode_add_reference(before[:, 24:24 + n].clone(), x, a, b, 0.75)
    assert ((y.double() - ref.double()).abs() <= ref.double().abs() * rounding + inexact + 1e-30).all()
    assert (y != before[:, 24:24 + n]).float().mean() > 0.5  # the adapter moved most entries


def test_lora_decode_add_matches_peft_lora_linear():
    """PEFT's own ``lora.Linear`` (float32 adapters over a bf16 base, its forward): base product plus the
    kernel's adapter product equals it to an ulp of bf16."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(96, 160, bias=False)).to(torch.bfloat16).to(DEVICE)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=12, target_modules=["0"]))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
        x = torch.randn(8, 96, device=DEVICE).to(torch.bfloat16)
        want = layer(x)
        y = layer.base_layer(x)
        lora_decode_add_(y, x, layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                         layer.scaling["default"], backend="triton")
    assert layer.lora_A["default"].weight.dtype == torch.float32  # PEFT's default adapter dtype
    torch.testing.assert_close(y, want, rtol=2 ** -7, atol=2 ** -7)
    assert (y != layer.base_layer(x)).any()


def test_lora_decode_add_refuses_what_it_does_not_compute():
    x, a, b, wide = _operands(4, 64, 96, 16, torch.bfloat16, torch.float32)
    y = wide[:, :96]
    with pytest.raises(ValueError, match="shapes do not chain"):
        lora_decode_add_(y, x[:, :32], a, b, 1.0)
    with pytest.raises(TypeError, match="one float dtype"):
        lora_decode_add_(y, x, a, b.to(torch.bfloat16), 1.0)
    big = torch.zeros(LORA_DECODE_MAX_ROWS + 1, 96, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 64 rows"):
        lora_decode_add_(big, torch.zeros(LORA_DECODE_MAX_ROWS + 1, 64, device=DEVICE), a, b, 1.0)
    with pytest.raises(RuntimeError, match="no_grad"):
        lora_decode_add_(y, x, a.clone().requires_grad_(), b, 1.0)
