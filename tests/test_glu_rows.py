"""The GLU kernels on row-strided inputs: gate and up as the two column halves of one wider product (the rollout
engine's stacked FP8 gate/up product), read in place by ``_glu_rows_fwd_kernel``.

References: transformers' formula (``F.silu(gate) * up``, ``F.gelu(gate, approximate) * up`` in the input dtype)
and the flat kernel on contiguous copies of the same halves; the backward through the views against autograd of
the formula on copies.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swiftune.kernels import glu
from tests.conftest import DEVICES
from tests.helpers import count_launches

DEVICE = DEVICES[0]  # CUDA (compiled) on the GPU machine, else the CPU (interpreter)


def _halves(shape: tuple[int, ...], cols: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate, up``: the column halves of one ``[*shape, 2 * cols]`` tensor (views, rows ``2 * cols`` apart)."""
    both = 3 * torch.randn(*shape, 2 * cols, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    return both[..., :cols], both[..., cols:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,cols", [((5,), 96), ((3, 1), 1500), ((2, 4), 33)])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_strided_halves_give_the_flat_kernel_and_transformers_bits(dtype, shape, cols, act):
    """Column views (not contiguous) take the row kernel: the same bits as the flat kernel on copies, and
    transformers' own formula (the activation rounded to the input dtype before the product) to bf16's rounding
    (one ulp compiled; two under the interpreter, which truncates float32 -> bf16, as tests/test_kernels.py
    allows the flat kernel)."""
    gate, up = _halves(shape, cols, dtype, seed=cols)
    assert not gate.is_contiguous() and not up.is_contiguous()
    if act == "silu":
        got, flat = glu.swiglu(gate, up), glu.swiglu(gate.contiguous(), up.contiguous())
        want = F.silu(gate) * up
    else:
        approximate = "none" if act == "gelu" else "tanh"
        got = glu.geglu(gate, up, approximate)
        flat = glu.geglu(gate.contiguous(), up.contiguous(), approximate)
        want = F.gelu(gate, approximate=approximate) * up
    assert got.shape == gate.shape and got.is_contiguous() and got.dtype == dtype
    assert torch.equal(got, flat)
    if dtype == torch.bfloat16:
        ulps = 1 if DEVICE == "cuda" else 2
        bound = ulps * want.float().abs() * 2**-7 + 1e-4 * want.float().abs().max()
        assert ((got.float() - want.float()).abs() <= bound).all()
    else:  # float32: the kernel's exp / erf differ from torch's in the last bits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_kernel_is_what_runs_on_column_views(monkeypatch):
    """The row kernel runs for column halves; contiguous inputs and views whose rows do not share one stride
    (a transpose) take the flat kernel on copies, as before."""
    launched = count_launches(monkeypatch, glu, "_glu_rows_fwd_kernel")
    gate, up = _halves((4,), 64, torch.bfloat16, seed=0)
    want = glu.swiglu(gate.contiguous(), up.contiguous())
    assert not launched
    assert torch.equal(glu.swiglu(gate, up), want) and launched == [(4, 1)]
    assert torch.equal(glu.swiglu(gate.t(), up.t()), want.t())  # [64, 4], columns 128 apart: no one row stride
    assert len(launched) == 1


def test_backward_through_the_views_equals_autograd_of_the_formula():
    """Gradients reach both halves of the wider tensor as autograd of transformers' formula gives them."""
    both = torch.randn(6, 2 * 80, generator=torch.Generator().manual_seed(1)).to(DEVICE).requires_grad_()
    dout = torch.randn(6, 80, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    glu.swiglu(both[:, :80], both[:, 80:]).backward(dout)
    ref = both.detach().clone().requires_grad_()
    (F.silu(ref[:, :80]) * ref[:, 80:]).backward(dout)
    assert both.grad.abs().sum() > 0
    torch.testing.assert_close(both.grad, ref.grad, rtol=1e-5, atol=1e-6)
