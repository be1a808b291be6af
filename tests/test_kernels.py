"""Kernels vs float64 references, forward and backward.

On CPU the Triton kernels run through the interpreter (tests/conftest.py sets it); on the GPU
machine the same tests run the compiled kernels (`device` fixture).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from swiftune.kernels import (
    add_rms_norm,
    add_rms_norm_fp8,
    add_rms_norm_reference,
    fp8_quantize_rowwise,
    fp8_quantize_rowwise_reference,
    geglu,
    geglu_reference,
    glu_fp8,
    rms_norm,
    rms_norm_reference,
    rope_qk,
    rope_qk_reference,
    swiglu,
    swiglu_reference,
)
from swiftune.kernels import rope as rope_module
from swiftune.kernels.launch import autograd_owner, choose_backend, needs_int64

rms_norm_module = importlib.import_module("swiftune.kernels.rms_norm")  # the package exports a function of that name
from swiftune.kernels.logit_grad import logit_block_grad_, logit_block_grad_reference
from swiftune.kernels.logit_stats import logit_block_stats, logit_block_stats_reference
from tests.helpers import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rope_tables(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0):
    """cos/sin [B, S, D] gathered by position ids, as transformers' rotary embedding builds them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def packed_positions(lengths: list[int]) -> torch.Tensor:
    """Position ids of one packed row: 0..len-1 for each document in turn."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


def grads_of(fn, inputs, grad_outputs):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grad_outputs)
    return [o.detach() for o in outs], [i.grad for i in inputs]


# ----------------------------------------------------------------------------------- RoPE


@pytest.fixture(params=[1, 4, 64], ids=lambda n: f"{n}-tokens")
def rope_tokens(request, monkeypatch, device):
    """Tokens per RoPE program: 1 is what a GPU runs; the interpreter's default takes 64 (a tile of
    [64, heads, D/2]); 4 puts several programs on a launch, the last one part-empty."""
    if device != "cpu" and request.param != 1:
        pytest.skip("a GPU runs one token per program")
    monkeypatch.setattr(rope_module, "tokens_per_program", lambda interpreted: request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "head_dim,n_q,n_k", [(64, 4, 4), (80, 8, 2), (128, 8, 1), (256, 2, 1)]
)
def test_rope_matches_float64_reference(device, rope_tokens, dtype, head_dim, n_q, n_k):
    torch.manual_seed(head_dim * 31 + n_q)
    B, S = 2, 11
    pos = torch.stack([torch.arange(S), packed_positions([4, 3, 4])[0]])  # row 1 is a packed row
    cos64, sin64 = rope_tables(pos, head_dim)
    # transformers' usual layout: projections viewed as [B, S, H, D] then transposed
    q64 = torch.randn(B, S, n_q, head_dim, dtype=torch.float64).transpose(1, 2)
    k64 = torch.randn(B, S, n_k, head_dim, dtype=torch.float64).transpose(1, 2)
    dq = torch.randn(B, n_q, S, head_dim, dtype=torch.float64)
    dk = torch.randn(B, n_k, S, head_dim, dtype=torch.float64)

    ref_in = [q64.clone().requires_grad_(), k64.clone().requires_grad_()]
    (rq, rk), (rdq, rdk) = grads_of(lambda a, b: rope_qk_reference(a, b, cos64, sin64), ref_in, (dq, dk))

    cos, sin = cos64.to(device, dtype), sin64.to(device, dtype)
    q = q64.to(device, dtype).detach().requires_grad_()
    k = k64.to(device, dtype).detach().requires_grad_()
    assert not q.is_contiguous()
    (oq, ok), (gq, gk) = grads_of(
        lambda a, b: rope_qk(a, b, cos, sin, backend="triton"), [q, k], (dq.to(device, dtype), dk.to(device, dtype))
    )
    for actual, expected in ((oq, rq), (ok, rk), (gq, rdq), (gk, rdk)):
        assert rel_err(actual, expected) < TOL[dtype]


def test_rope_programs_write_no_token_past_the_last(device, rope_tokens):
    """q and k are the first B rows of larger buffers: the programs of a launch that takes several
    tokens each (the last one part-empty) rotate those rows and leave the next row's memory as it was."""
    torch.manual_seed(5)
    B, S, D = 2, 7, 16  # 14 tokens: a part-empty last program at 4 and 64 tokens each
    cos, sin = (t.float().to(device) for t in rope_tables(torch.arange(S).expand(B, S), D))
    q_buf, k_buf = torch.randn(B + 1, 4, S, D, device=device), torch.randn(B + 1, 2, S, D, device=device)
    q_spare, k_spare = q_buf[B].clone(), k_buf[B].clone()
    eq, ek = rope_qk_reference(q_buf[:B], k_buf[:B], cos, sin)
    for backward in (False, True):  # both directions, into fresh buffers of the same layout
        q_out, k_out = q_buf.clone(), k_buf.clone()
        rope_module._launch(q_buf[:B], k_buf[:B], q_out[:B], k_out[:B], cos, sin, backward=backward)
        assert torch.equal(q_out[B], q_spare) and torch.equal(k_out[B], k_spare)
        if not backward:
            assert rel_err(q_out[:B], eq) < 1e-6 and rel_err(k_out[:B], ek) < 1e-6
    oq, ok = rope_qk(q_buf[:B], k_buf[:B], cos, sin, backend="triton")  # the public call
    assert torch.equal(q_buf[B], q_spare) and torch.equal(k_buf[B], k_spare)
    assert rel_err(oq, eq) < 1e-6 and rel_err(ok, ek) < 1e-6


def test_rope_packed_row_equals_documents_alone(device, rope_tokens):
    """A packed row with restarting positions rotates each document exactly as if alone."""
    torch.manual_seed(1)
    lengths, D = [5, 2, 6], 64
    pos = packed_positions(lengths)
    cos, sin = (t.float().to(device) for t in rope_tables(pos, D))
    q = torch.randn(1, 4, sum(lengths), D, device=device)
    k = torch.randn(1, 2, sum(lengths), D, device=device)
    oq, ok = rope_qk(q.clone(), k.clone(), cos, sin, backend="triton")
    start = 0
    for n in lengths:
        c1, s1 = (t.float().to(device) for t in rope_tables(torch.arange(n)[None], D))
        eq, ek = rope_qk_reference(q[:, :, start : start + n], k[:, :, start : start + n], c1, s1)
        assert rel_err(oq[:, :, start : start + n], eq) < 1e-6
        assert rel_err(ok[:, :, start : start + n], ek) < 1e-6
        start += n
    # negative control: positions that do not restart give different rotations
    c_bad, s_bad = (t.float().to(device) for t in rope_tables(torch.arange(sum(lengths))[None], D))
    bq, _ = rope_qk(q.clone(), k.clone(), c_bad, s_bad, backend="triton")
    assert rel_err(bq, oq) > 1e-2


def test_rope_in_place_and_autograd_through_views(device, rope_tokens):
    torch.manual_seed(2)
    B, S, Hq, Hk, D = 2, 6, 4, 2, 32
    cos, sin = (t.float().to(device) for t in rope_tables(torch.arange(S).expand(B, S), D))
    x = torch.randn(B, S, Hq * D, device=device, requires_grad=True)
    y = torch.randn(B, S, Hk * D, device=device, requires_grad=True)

    def run(fn, fused: bool):
        if fused:  # q and k sliced out of one qkv buffer: must fall back to out-of-place
            proj = torch.cat([x, y], dim=-1) * 2.0
            qp, kp = proj[..., : Hq * D], proj[..., Hq * D :]
        else:  # separate projections, as Llama/Qwen/Gemma compute them
            qp, kp = x * 2.0, y * 2.0
        q = qp.view(B, S, Hq, D).transpose(1, 2)
        k = kp.view(B, S, Hk, D).transpose(1, 2)
        oq, ok = fn(q, k)
        loss = (oq * oq.detach().sin()).sum() + (ok**2).sum()
        gx, gy = torch.autograd.grad(loss, (x, y))
        return oq, ok, gx, gy, q

    for fused in (False, True):
        oq, ok, gx, gy, q = run(lambda q, k: rope_qk(q, k, cos, sin, backend="triton"), fused)
        assert (oq.data_ptr() == q.data_ptr()) != fused, "separate projections rotate in place, fused do not"
        eq, ek, ex, ey, _ = run(lambda q, k: rope_qk_reference(q, k, cos, sin), fused)
        for actual, expected in ((oq, eq), (ok, ek), (gx, ex), (gy, ey)):
            assert rel_err(actual, expected) < 1e-6

    # a broadcast (stride-0) incoming gradient, as from .sum(), through the in-place path
    qp, kp = x * 2.0, y * 2.0
    oq, ok = rope_qk(qp.view(B, S, Hq, D).transpose(1, 2), kp.view(B, S, Hk, D).transpose(1, 2), cos, sin,
                     backend="triton")
    gx, gy = torch.autograd.grad(oq.sum() + ok.sum(), (x, y))
    eq, ek = rope_qk_reference((x * 2.0).view(B, S, Hq, D).transpose(1, 2), (y * 2.0).view(B, S, Hk, D).transpose(1, 2),
                               cos, sin)
    ex, ey = torch.autograd.grad(eq.sum() + ek.sum(), (x, y))
    assert rel_err(gx, ex) < 1e-6 and rel_err(gy, ey) < 1e-6

    # a leaf that requires grad is never overwritten
    q_leaf = torch.randn(B, Hq, S, D, device=device, requires_grad=True)
    k_leaf = torch.randn(B, Hk, S, D, device=device, requires_grad=True)
    before = q_leaf.detach().clone()
    rq, _ = rope_qk(q_leaf, k_leaf, cos, sin, backend="triton")
    assert torch.equal(q_leaf.detach(), before) and rq.data_ptr() != q_leaf.data_ptr()
    # nor is a view that was made a leaf itself (its base does not require grad)
    q_view = torch.randn(B, S, Hq, D, device=device).transpose(1, 2).requires_grad_()
    rq, rk = rope_qk(q_view, k_leaf, cos, sin, backend="triton")
    assert rq.requires_grad and rq.data_ptr() != q_view.data_ptr()
    # inference (no grad) on contiguous tensors rotates in place too
    with torch.no_grad():
        qc, kc = torch.randn(B, Hq, S, D, device=device), torch.randn(B, Hk, S, D, device=device)
        eq, ek = rope_qk_reference(qc, kc, cos, sin)
        oq, ok = rope_qk(qc, kc, cos, sin, backend="triton")
        assert oq.data_ptr() == qc.data_ptr() and rel_err(oq, eq) < 1e-6 and rel_err(ok, ek) < 1e-6


class _ViewOutput(torch.autograd.Function):
    """A custom Function returning a view of a buffer made inside forward (as RMSNorm once did)."""

    @staticmethod
    def forward(ctx, x):
        return (x * 1.0).reshape(-1).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_autograd_owner_refuses_owners_outside_the_graph():
    x = torch.randn(2, 3, 4, requires_grad=True)
    plain = x * 2.0
    assert autograd_owner(plain.transpose(0, 1)) is plain  # an ordinary differentiable view
    assert autograd_owner(plain) is plain
    assert autograd_owner(x) is None and autograd_owner(x.view(-1)) is None  # a leaf that requires grad
    custom = _ViewOutput.apply(x)
    assert custom._is_view() and autograd_owner(custom) is None  # its _base is outside the graph
    assert autograd_owner(custom.transpose(0, 1)) is None
    with torch.no_grad():
        made_without_grad = plain.view(-1)
    assert autograd_owner(made_without_grad) is None  # owner requires grad, the view does not
    with torch.no_grad():  # inference: nothing is tracked, every owner may be written
        y = torch.randn(2, 3, 4)
        assert autograd_owner(y.transpose(0, 1)) is y


@pytest.mark.parametrize("producer", ["rms_norm", "custom_view"])
def test_rope_after_a_custom_function_keeps_q_and_k_in_the_graph(device, producer):
    """The Qwen3 / Gemma 3 chain: per-head norm of the projection, then in-place RoPE of the
    transposed result. q and k must keep their history and get the reference's gradients."""
    torch.manual_seed(3)
    B, S, Hq, Hk, D = 1, 10, 4, 2, 16
    cos, sin = (t.float().to(device) for t in rope_tables(torch.arange(S).expand(B, S), D))
    xq = torch.randn(B, S, Hq, D, device=device, requires_grad=True)
    xk = torch.randn(B, S, Hk, D, device=device, requires_grad=True)
    w = torch.randn(D, device=device, requires_grad=True)

    def norm(x, fused):
        if producer == "custom_view":
            return _ViewOutput.apply(x * 1.0) if fused else x * 1.0
        return rms_norm(x * 1.0, w, 1e-6) if fused else rms_norm_reference(x * 1.0, w, 1e-6)

    def run(fused):
        q, k = norm(xq, fused).transpose(1, 2), norm(xk, fused).transpose(1, 2)
        rope = (lambda q, k: rope_qk(q, k, cos, sin, backend="triton")) if fused else (
            lambda q, k: rope_qk_reference(q, k, cos, sin))
        oq, ok = rope(q, k)
        assert oq.grad_fn is not None and ok.grad_fn is not None
        wanted = (xq, xk, w) if producer == "rms_norm" else (xq, xk)
        return oq, torch.autograd.grad((oq * oq.detach().cos()).sum() + (ok ** 3).sum(), wanted), q

    (oq, grads, q), (eq, expected, _) = run(True), run(False)
    assert rel_err(oq, eq) < 1e-6
    for g, e in zip(grads, expected):
        assert g.abs().max() > 0 and rel_err(g, e) < 1e-5
    if producer == "rms_norm":  # RMSNorm's output is its own tensor: RoPE still rotates it in place
        assert oq.data_ptr() == q.data_ptr()


def test_rope_broadcast_tables_and_int64_flag(device, rope_tokens):
    torch.manual_seed(3)
    B, S, D = 3, 7, 64
    cos, sin = (t.float().to(device) for t in rope_tables(torch.arange(S)[None], D))  # [1, S, D]
    q = torch.randn(B, 8, S, D, device=device)
    k = torch.randn(B, 1, S, D, device=device)
    eq, ek = rope_qk_reference(q, k, cos, sin)
    for force in (False, True):  # the 64-bit offset variant, forced on a small tensor
        oq, ok = rope_qk(q.clone(), k.clone(), cos, sin, backend="triton", _force_int64=force)
        assert rel_err(oq, eq) < 1e-6 and rel_err(ok, ek) < 1e-6


def test_rope_head_offsets_past_int32_with_an_int32_head_stride(device, rope_tokens):
    """A head stride that fits int32 times a head index that does not: a ``[B, H, S, D]``-contiguous
    gradient of a long row (676K tokens: a head stride of 86.5M elements, head 25 passes 2^31), the
    layout the attention hands back to RoPE's backward. The kernel's 64-bit variant must compute the
    head offsets in 64 bits too (it once wrapped them, reading and writing outside the tensors: an
    illegal memory access on CUDA, a segmentation fault under the interpreter). Three heads
    ``2^30 + 1024`` elements apart, each 16 tokens long, stand in for that row: 4.3 GB of address
    space, of which only the 16-token stretches are ever written (on CPU the rest is never resident)."""
    S, D, head_stride = 16, 64, 2**30 + 1024
    torch.manual_seed(0)
    cos, sin = (t.to(device, torch.bfloat16) for t in rope_tables(torch.arange(S)[None], D))

    def spread(heads: int) -> torch.Tensor:  # [1, heads, S, D] with heads head_stride elements apart
        try:
            base = torch.empty((heads - 1) * head_stride + S * D, device=device, dtype=torch.bfloat16)
        except (RuntimeError, MemoryError) as e:  # the address space, not memory: refused only where overcommit is off
            pytest.skip(f"cannot reserve {(heads - 1) * head_stride * 2 / 1e9:.1f} GB of address space here: {e}")
        view = base.as_strided((1, heads, S, D), (heads * head_stride, head_stride, D, 1))
        return view.normal_()

    q, k = spread(3), torch.randn(1, 1, S, D, device=device, dtype=torch.bfloat16)
    assert needs_int64(q) and q.stride(1) < 2**31 <= 2 * q.stride(1)
    oq, ok = rope_qk(q, k, cos, sin, inplace=False, backend="triton")
    eq, ek = rope_qk_reference(q.contiguous().float(), k.float(), cos.float(), sin.float())
    assert rel_err(oq.float(), eq) < 1e-2 and rel_err(ok.float(), ek) < 1e-2

    qd = q.detach().contiguous().requires_grad_(True)  # dense input, spread gradient (the backward's case)
    del q, oq, eq  # one spread tensor at a time
    kd = k.clone().requires_grad_(True)
    gq, gk = spread(3), torch.randn(1, 1, S, D, device=device, dtype=torch.bfloat16)
    oq, ok = rope_qk(qd, kd, cos, sin, inplace=False, backend="triton")
    dq, dk = torch.autograd.grad((oq, ok), (qd, kd), (gq, gk))
    qr, kr = qd.detach().float().requires_grad_(True), kd.detach().float().requires_grad_(True)
    rq, rk = rope_qk_reference(qr, kr, cos.float(), sin.float())
    eq_grad, ek_grad = torch.autograd.grad((rq, rk), (qr, kr), (gq.float().contiguous(), gk.float()))
    assert rel_err(dq.float(), eq_grad) < 1e-2 and rel_err(dk.float(), ek_grad) < 1e-2
    assert all(t.abs().sum() > 0 for t in (eq_grad, ek_grad, dk))  # every gradient is non-zero, as the reference's
    assert dq[0, 2].abs().sum() > 0  # the last head, the one whose offset passes 2^31


def test_rope_bad_input_messages():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="4-D"):
        rope_qk(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="head_dim"):
        rope_qk(q, torch.randn(1, 2, 3, 6), cos, sin)
    with pytest.raises(ValueError, match="multiple of k heads"):
        rope_qk(torch.randn(1, 3, 3, 8), k, cos, sin)
    with pytest.raises(TypeError, match="cos/sin dtype"):
        rope_qk(q, k, cos.double(), sin.double())
    with pytest.raises(ValueError, match="cos shape"):
        rope_qk(q, k, torch.randn(1, 4, 8), torch.randn(1, 4, 8))
    with pytest.raises(TypeError, match="floating"):
        rope_qk(q, k, cos.long(), sin)


# ----------------------------------------------------------------------------- SwiGLU / GeGLU

GLU_CASES = [
    ("swiglu", lambda g, u: swiglu(g, u, backend="triton"), swiglu_reference),
    ("geglu_erf", lambda g, u: geglu(g, u, "none", backend="triton"), lambda g, u: geglu_reference(g, u, "none")),
    ("geglu_tanh", lambda g, u: geglu(g, u, "tanh", backend="triton"), lambda g, u: geglu_reference(g, u, "tanh")),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 100), (1, 2077), (4, 1024)])
@pytest.mark.parametrize("name,kernel,reference", GLU_CASES, ids=[c[0] for c in GLU_CASES])
def test_glu_matches_float64_reference(device, dtype, shape, name, kernel, reference):
    torch.manual_seed(hash((name, shape)) % 1000)
    g64 = 3 * torch.randn(shape, dtype=torch.float64)
    u64 = torch.randn(shape, dtype=torch.float64)
    dout = torch.randn(shape, dtype=torch.float64)
    (ro,), (rg, ru) = grads_of(reference, [g64.clone().requires_grad_(), u64.clone().requires_grad_()], (dout,))
    g = g64.to(device, dtype).requires_grad_()
    u = u64.to(device, dtype).requires_grad_()
    (o,), (gg, gu) = grads_of(kernel, [g, u], (dout.to(device, dtype),))
    assert o.dtype == dtype
    for actual, expected in ((o, ro), (gg, rg), (gu, ru)):
        assert rel_err(actual, expected) < TOL[dtype]


@pytest.mark.parametrize("name,kernel,reference", GLU_CASES, ids=[c[0] for c in GLU_CASES])
def test_glu_bf16_matches_transformers_rounding(device, name, kernel, reference):
    """In bf16 the activation is rounded before the product, exactly as transformers does."""
    torch.manual_seed(5)
    g = 4 * torch.randn(8, 512, device=device, dtype=torch.bfloat16)
    u = torch.randn(8, 512, device=device, dtype=torch.bfloat16)
    ours, theirs = kernel(g, u).float(), reference(g, u).float()
    if device == "cuda":
        # The Triton interpreter truncates fp32 -> bf16 instead of rounding to nearest, so
        # bit-identity is checked on compiled kernels only.
        # SwiGLU: the common case is bit-identical. GELU: Triton's erf/exp differ from CUDA's
        # erff/tanhf in the last fp32 bit, which flips a bf16 rounding now and then.
        equal = (ours == theirs).float().mean().item()
        floor = 0.995 if name == "swiglu" else 0.97
        assert equal > floor, f"only {equal:.4f} of elements bit-identical"
    # One bf16 ulp is at most 2^-7 relative; the interpreter's two truncations can cost two.
    # The absolute floor covers GELU's tail, where 1 + erf(x) cancels differently per library.
    ulps = 1 if device == "cuda" else 2
    bound = ulps * theirs.abs() * 2**-7 + 1e-4 * theirs.abs().max()
    assert ((ours - theirs).abs() <= bound).all(), "differences beyond bf16 ulps"


def test_glu_int64_flag_and_errors(device):
    g, u = torch.randn(2, 300, device=device), torch.randn(2, 300, device=device)
    assert torch.allclose(swiglu(g, u, backend="triton", _force_int64=True), swiglu_reference(g, u), atol=1e-6)
    assert torch.allclose(
        geglu(g, u, "tanh", backend="triton", _force_int64=True), geglu_reference(g, u, "tanh"), atol=1e-6
    )
    with pytest.raises(ValueError, match="same shape"):
        swiglu(g, u[:, :10])
    with pytest.raises(TypeError, match="same dtype"):
        swiglu(g, u.double())
    with pytest.raises(ValueError, match="approximate"):
        geglu(g, u, "sigmoid")


# ------------------------------------------------------------------------------------ RMSNorm


@pytest.fixture(params=[1, 4, 64], ids=lambda n: f"{n}-rows")
def rms_rows(request, monkeypatch, device):
    """Rows per RMSNorm program: 1 is what a GPU runs (forward; its backward walks the rows); the
    interpreter's default takes 64 (a [64, BLOCK] tile); 4 puts several programs on a launch, the last
    one part-empty (21 rows)."""
    if device != "cpu" and request.param != 1:
        pytest.skip("a GPU runs one row per forward program")
    monkeypatch.setattr(rms_norm_module, "rows_per_program", lambda interpreted: request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100, 1000, 2050])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_float64_reference(device, rms_rows, dtype, hidden, offset):
    torch.manual_seed(hidden + int(offset))
    x64 = torch.randn(3, 7, hidden, dtype=torch.float64) * 2 + 0.3
    w64 = torch.randn(hidden, dtype=torch.float64) * 0.5 + (0.0 if offset else 1.0)
    dy = torch.randn(3, 7, hidden, dtype=torch.float64)
    (ro,), (rx, rw) = grads_of(
        lambda x, w: rms_norm_reference(x, w, 1e-6, offset),
        [x64.clone().requires_grad_(), w64.clone().requires_grad_()],
        (dy,),
    )
    x = x64.to(device, dtype).requires_grad_()
    w = w64.to(device, dtype).requires_grad_()
    (o,), (gx, gw) = grads_of(lambda a, b: rms_norm(a, b, 1e-6, offset, backend="triton"), [x, w], (dy.to(device, dtype),))
    assert o.dtype == dtype and gw.dtype == dtype
    for actual, expected in ((o, ro), (gx, rx), (gw, rw)):
        assert rel_err(actual, expected) < TOL[dtype]


def test_rms_norm_programs_write_no_row_past_the_last(device, rms_rows):
    """The rows to normalise are the first 21 of a larger buffer, and the outputs the first 21 rows of
    theirs: with several rows a program (the last program part-empty) the next row is left as it was,
    forward (y, r) and backward (dx)."""
    torch.manual_seed(4)
    n_rows, n_cols = 21, 48
    x_buf = torch.randn(n_rows + 1, n_cols, device=device)
    w = torch.randn(n_cols, device=device)
    y_buf, r_buf = torch.full_like(x_buf, 7.0), torch.full((n_rows + 1,), 7.0, device=device)
    rows = rms_norm_module.rows_per_program(True)
    rms_norm_module._rms_fwd_kernel[(-(-n_rows // rows),)](
        x_buf, w, y_buf, r_buf, n_rows, n_cols, n_cols, n_cols, 1e-6, 0.0, BLOCK=64, INT64=False, ROWS=rows)
    assert torch.all(y_buf[n_rows] == 7.0) and r_buf[n_rows] == 7.0
    assert rel_err(y_buf[:n_rows], rms_norm_reference(x_buf[:n_rows], w, 1e-6)) < 1e-6
    x = x_buf[:n_rows].clone().requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm(x, w, 1e-6, backend="triton"), (x,), torch.ones(n_rows, n_cols, device=device))
    xr = x.detach().double().requires_grad_()
    (ex,) = torch.autograd.grad(rms_norm_reference(xr, w.double(), 1e-6), (xr,), torch.ones_like(xr))
    assert rel_err(dx, ex) < 1e-5 and ex.abs().sum() > 0


def test_rms_norm_non_contiguous_fp32_weight_and_int64(device, rms_rows):
    """bf16 activations with an fp32 weight (mixed precision), strided input, forced 64-bit path."""
    torch.manual_seed(7)
    base = torch.randn(6, 2, 96, device=device, dtype=torch.float64)
    w64 = torch.randn(96, device=device, dtype=torch.float64)
    x = base.to(torch.bfloat16).transpose(0, 1).requires_grad_()  # rows not contiguous
    w = w64.float().requires_grad_()
    o = rms_norm(x, w, 1e-5, backend="triton", _force_int64=True)
    o.backward(torch.ones_like(o))
    xr = base.to(torch.bfloat16).double().transpose(0, 1).requires_grad_()
    wr = w64.clone().requires_grad_()
    ro = rms_norm_reference(xr, wr, 1e-5)
    ro.backward(torch.ones_like(ro))
    assert o.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert rel_err(o, ro) < 1e-2 and rel_err(x.grad, xr.grad) < 1e-2 and rel_err(w.grad, wr.grad) < 1e-5


def test_rms_norm_backward_takes_64_bit_offsets_from_a_gradient_whose_rows_lie_far_apart(device, rms_rows):
    """The 64-bit choice of RMSNorm's backward looks at the incoming gradient as well as the input: a
    gradient that is a view into a larger buffer (what a concatenation's backward hands back) can have
    rows ``2^30 + 1024`` elements apart while the input is small and dense. Deciding from the input
    alone, row 2's offset wrapped (reads outside the tensor: a segmentation fault under the interpreter,
    an illegal access on CUDA). 4.3 GB of address space, of which only the rows are ever written."""
    rows, n_cols, row_stride = 3, 64, 2**30 + 1024
    try:
        base = torch.empty((rows - 1) * row_stride + n_cols, device=device, dtype=torch.bfloat16)
    except (RuntimeError, MemoryError) as e:  # the address space, not memory: refused only where overcommit is off
        pytest.skip(f"cannot reserve {(rows - 1) * row_stride * 2 / 1e9:.1f} GB of address space here: {e}")
    torch.manual_seed(0)
    dy = base.as_strided((rows, n_cols), (row_stride, 1)).normal_()
    x = torch.randn(rows, n_cols, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n_cols, device=device)).to(torch.bfloat16).requires_grad_(True)
    assert needs_int64(dy) and not needs_int64(x)
    gx, gw = torch.autograd.grad(rms_norm(x, w, 1e-6, backend="triton"), (x, w), dy)
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ex, ew = torch.autograd.grad(rms_norm_reference(xr, wr, 1e-6), (xr, wr), dy.double().contiguous())
    assert rel_err(gx.double(), ex) < 1e-2 and rel_err(gw.double(), ew) < 1e-2
    assert ex.abs().sum() > 0 and gx[2].abs().sum() > 0 and gw.abs().sum() > 0  # row 2: the one past 2^31


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100, 2050])
def test_add_rms_norm_matches_reference_and_the_unfused_ops_exactly(device, dtype, hidden, offset):
    torch.manual_seed(hidden + 3 * int(offset))
    x64 = torch.randn(5, 3, hidden, dtype=torch.float64)
    r64 = torch.randn(5, 3, hidden, dtype=torch.float64) * 3
    w64 = torch.randn(hidden, dtype=torch.float64) * 0.5 + (0.0 if offset else 1.0)
    ry, rs = add_rms_norm_reference(x64, r64, w64, 1e-6, offset)
    x, res, w = (t.to(device, dtype) for t in (x64, r64, w64))
    with torch.no_grad():
        y, s = add_rms_norm(x, res, w, 1e-6, offset, backend="triton")
        # the unfused ops it replaces: the same roundings, bit for bit
        s_unfused = x + res
        y_unfused = rms_norm(s_unfused, w, 1e-6, offset, backend="triton")
    assert y.dtype == s.dtype == dtype and y.shape == s.shape == x.shape
    assert rel_err(s, rs) < TOL[dtype] and rel_err(y, ry) < TOL[dtype]
    if dtype == torch.float32 or x.is_cuda:
        assert torch.equal(s, s_unfused) and torch.equal(y, y_unfused)
    else:  # the Triton interpreter does not round float32 -> bf16 to nearest (DESIGN.md): 1 ulp apart
        assert rel_err(s, s_unfused) < TOL[dtype] and rel_err(y, y_unfused) < TOL[dtype]


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100, 2050])
def test_add_rms_norm_fp8_is_add_rms_norm_then_the_rowwise_quantiser(device, dtype, hidden, offset):
    """add_rms_norm_fp8's y and s are add_rms_norm's bit for bit; its codes and scales are the bytes of
    fp8_quantize_rowwise of that y (the quantiser an FP8 projection runs on its input), and within e4m3's
    half step of the float64 norm (checked against the plain formula, not only the kernels); a row of zeros
    gets scale 1 and zero codes. The torch reference gives the same bytes."""
    torch.manual_seed(hidden + 7 * int(offset))
    x64 = torch.randn(5, 3, hidden, dtype=torch.float64)
    r64 = torch.randn(5, 3, hidden, dtype=torch.float64) * 3
    r64[1, 2] = -x64[1, 2]  # a row whose sum is zero
    w64 = torch.randn(hidden, dtype=torch.float64) * 0.5 + (0.0 if offset else 1.0)
    x, res, w = (t.to(device, dtype) for t in (x64, r64, w64))
    with torch.no_grad():
        y, s, codes, scales = add_rms_norm_fp8(x, res, w, 1e-6, offset, backend="triton")
        y_plain, s_plain = add_rms_norm(x, res, w, 1e-6, offset, backend="triton")
        q_ref, sc_ref = fp8_quantize_rowwise(y.reshape(-1, hidden), backend="triton")
        ry, rs, rq, rsc = add_rms_norm_fp8(x, res, w, 1e-6, offset, backend="reference")
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (15, hidden) and scales.shape == (15, 1)
    assert torch.equal(y, y_plain) and torch.equal(s, s_plain)
    assert torch.equal(codes.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scales, sc_ref)
    assert torch.equal(scales[5], torch.ones(1, device=device)) and not codes[5].float().any()
    assert torch.equal(ry, add_rms_norm_reference(x, res, w, 1e-6, offset)[0]) and torch.equal(rs, x + res)
    # against float64 (the norm of the rounded sum s): the codes times their scale are y to e4m3's half step
    # (2^-4 relative, 2^-9 of the scale for subnormal codes) and y's own rounding
    y64 = rms_norm_reference(s.double().cpu(), w.double().cpu(), 1e-6, offset).reshape(-1, hidden)
    for q, sc in ((codes, scales), (rq, rsc)):
        back = q.double().cpu() * sc.double().cpu()
        assert ((back - y64).abs() <= y64.abs() * (2 ** -4 + 2 ** -7) + sc.double().cpu() * 2 ** -9 + 1e-6).all()
        assert (q.float().abs().amax(dim=1) == 448.0).sum() == 14  # each nonzero row's largest magnitude -> 448


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["silu", "none", "tanh"])
@pytest.mark.parametrize("cols", [96, 300])
def test_glu_fp8_is_the_activation_then_the_rowwise_quantiser(device, dtype, approximate, cols):
    """glu_fp8 on the two column halves of one product (as a decode step's stacked gate/up hands them): its
    output is swiglu's / geglu's kernel output bit for bit, its codes and scales the bytes of fp8_quantize_rowwise
    of that output; within e4m3's half step of the float64 activation; a row of zeros gets scale 1 and zero
    codes; the torch reference gives the reference activation and the reference quantiser's bytes of it."""
    torch.manual_seed(cols)
    wide64 = torch.randn(7, 1, 2 * cols, dtype=torch.float64) * 3
    wide64[4] = 0.0
    wide = wide64.to(device, dtype)
    gate, up = wide[..., :cols], wide[..., cols:]  # strided views: rows 2 * cols apart
    with torch.no_grad():
        out, codes, scales = glu_fp8(gate, up, approximate, backend="triton")
        plain = (swiglu(gate, up, backend="triton") if approximate == "silu"
                 else geglu(gate, up, approximate, backend="triton"))
        q_ref, sc_ref = fp8_quantize_rowwise(plain.reshape(-1, cols), backend="triton")
        r_out, r_codes, r_scales = glu_fp8(gate, up, approximate, backend="reference")
    assert out.shape == gate.shape and codes.dtype == torch.float8_e4m3fn and codes.shape == (7, cols)
    assert scales.shape == (7, 1) and scales.dtype == torch.float32
    assert torch.equal(out, plain)
    assert torch.equal(codes.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scales, sc_ref)
    assert torch.equal(scales[4], torch.ones(1, device=device)) and not codes[4].float().any()
    want = swiglu_reference(gate, up) if approximate == "silu" else geglu_reference(gate, up, approximate)
    assert torch.equal(r_out, want)
    ref_q, ref_s = fp8_quantize_rowwise_reference(want.reshape(-1, cols))
    assert torch.equal(r_codes.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(r_scales, ref_s)
    # against float64: the codes times their scale are the activation to e4m3's half step and out's own rounding
    g64, u64 = wide64[..., :cols], wide64[..., cols:]
    act = (F.silu(g64) if approximate == "silu" else F.gelu(g64, approximate=approximate)) * u64
    act = act.reshape(-1, cols)
    back = codes.double().cpu() * scales.double().cpu()
    slack = 2 ** -4 + (2 ** -7 if dtype == torch.bfloat16 else 2 ** -20) * 3
    assert ((back - act).abs() <= act.abs() * slack + scales.double().cpu() * 2 ** -9 + 1e-6).all()


def test_glu_fp8_refuses_grad():
    gate = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward"):
        glu_fp8(gate, torch.randn(3, 8))
    with pytest.raises(ValueError, match="approximate"):
        with torch.no_grad():
            glu_fp8(gate, torch.randn(3, 8), "relu")


def test_add_rms_norm_refuses_grad_and_mismatched_residual():
    x, w = torch.randn(2, 8, requires_grad=True), torch.ones(8)
    with pytest.raises(RuntimeError, match="no_grad"):
        add_rms_norm(x, torch.randn(2, 8), w, 1e-6, backend="reference")
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64), w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (8, 8, 128), (6, 1, 80)])
def test_decode_qkv_matches_float64_reference(device, dtype, norm, heads, kv_heads, dim):
    """Norm + RoPE + cache writes of one decode step against the float64 composition of the
    references; exactly the unfused Triton kernels (rms_norm, rope_qk) where rounding allows."""
    from swiftune.kernels import decode_qkv, decode_qkv_reference

    torch.manual_seed(heads * dim + norm)
    B, L = 5, 11
    q64, k64, v64 = (torch.randn(B, h, dim, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    wq64, wk64 = torch.rand(dim, dtype=torch.float64) + 0.5, torch.rand(dim, dtype=torch.float64) + 0.5
    slot = torch.tensor([0, 3, 10, 7, 3])
    cos64, sin64 = rope_tables(slot[:, None], dim)
    cos64, sin64 = cos64[:, 0], sin64[:, 0]
    kc64, vc64 = torch.randn(B, kv_heads, L, dim, dtype=torch.float64), torch.randn(B, kv_heads, L, dim, dtype=torch.float64)
    w = (wq64, wk64) if norm else (None, None)
    ref_kc, ref_vc = kc64.clone(), vc64.clone()
    ref_q = decode_qkv_reference(q64, k64, v64, *w, 1e-6, cos64, sin64, ref_kc, ref_vc, slot)

    cast = lambda t: t.to(device, dtype)  # noqa: E731
    kc, vc = cast(kc64), cast(vc64)
    kc_before, vc_before = kc.clone(), vc.clone()
    with torch.no_grad():
        got_q = decode_qkv(cast(q64), cast(k64), cast(v64), *(cast(t) if t is not None else None for t in w), 1e-6,
                           cast(cos64), cast(sin64), kc, vc, slot.to(device), backend="triton")
    assert rel_err(got_q, ref_q) < TOL[dtype]
    rows = torch.arange(B)
    assert rel_err(kc[rows, :, slot], ref_kc[rows, :, slot]) < TOL[dtype]
    assert torch.equal(vc[rows, :, slot], cast(v64))
    untouched = torch.ones(B, L, dtype=torch.bool)
    untouched[rows, slot] = False
    assert torch.equal(kc.transpose(1, 2)[untouched], kc_before.transpose(1, 2)[untouched])
    assert torch.equal(vc.transpose(1, 2)[untouched], vc_before.transpose(1, 2)[untouched])
    if dtype == torch.float32 or device == "cuda":  # the interpreter rounds bf16 differently (DESIGN.md)
        q, k = cast(q64)[:, :, None], cast(k64)[:, :, None]
        if norm:
            q, k = rms_norm(q, cast(wq64), 1e-6, backend="triton"), rms_norm(k, cast(wk64), 1e-6, backend="triton")
        with torch.no_grad():
            uq, uk = rope_qk(q, k, cast(cos64)[:, None], cast(sin64)[:, None], backend="triton")
        assert torch.equal(got_q, uq[:, :, 0]) and torch.equal(kc[rows, :, slot], uk[:, :, 0])


def test_decode_qkv_errors():
    from swiftune.kernels import decode_qkv

    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    cache = torch.zeros(2, 2, 5, 8)
    cs = torch.randn(2, 8)
    with pytest.raises(ValueError, match="shapes"):
        decode_qkv(q, k, torch.randn(2, 2, 6), None, None, 1e-6, cs, cs, cache, cache.clone(), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="both norm weights"):
        decode_qkv(q, k, k, torch.ones(8), None, 1e-6, cs, cs, cache, cache.clone(), torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="no_grad"):
        decode_qkv(q.requires_grad_(), k, k, None, None, 1e-6, cs, cs, cache, cache.clone(),
                   torch.zeros(2, dtype=torch.long), backend="reference")


def test_rms_norm_errors():
    with pytest.raises(ValueError, match="weight must be 1-D"):
        rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(torch.randn(2, 8), torch.randn(8), 0.0)


# ------------------------------------------------------------------------ logit blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,softcap,temperature,entropy", [
    (None, None, 1.0, False), (0.5, None, 0.7, True), (None, 30.0, 1.0, False), (1.5, 10.0, 0.8, True),
])
@pytest.mark.parametrize("width", [70, 1100])
def test_logit_block_kernels_match_the_reference(device, dtype, scale, softcap, temperature, entropy, width):
    """Both phases on one block of vocabulary columns [v0, v0 + width): labels inside and outside it
    (outside: no target logit, no one-hot in the gradient); 1,100 columns take several tiles, the last
    one part-empty, under the interpreter (512 columns a tile; on a GPU a tile spans up to 4,096: one)."""
    from swiftune.kernels.logit_stats import INTERPRETER_BLOCK

    assert INTERPRETER_BLOCK < 1100 <= 3 * INTERPRETER_BLOCK and 1100 % INTERPRETER_BLOCK
    torch.manual_seed(3)
    rows, v0 = 9, 100
    z = (torch.randn(rows, width) * 4).to(device=device, dtype=dtype)
    labels = torch.randint(v0 - 20, v0 + width + 20, (rows,), device=device)
    labels[:3] = torch.tensor([v0, v0 + width - 1, v0 + width // 2])  # the first, last and a middle tile's column
    lse, tgt, ent = logit_block_stats(z, labels, v0, scale, softcap, temperature, entropy)
    lse_r, tgt_r, ent_r = logit_block_stats_reference(z, labels, v0, scale, softcap, temperature, entropy)
    assert rel_err(lse, lse_r) < 1e-5 and rel_err(tgt, tgt_r) < 1e-5
    assert (ent is None) == (not entropy) and (ent is None or rel_err(ent, ent_r) < 1e-5)
    g_ce = torch.rand(rows, device=device)
    g_ent = torch.randn(rows, device=device) if entropy else None
    expected = logit_block_grad_reference(z, labels, v0, lse_r, g_ce, g_ent, ent_r, scale, softcap, temperature)
    got = logit_block_grad_(z.clone(), labels, v0, lse, g_ce, g_ent, ent, scale, softcap, temperature)
    assert got.dtype == dtype and rel_err(got, expected) < TOL[dtype]


# ------------------------------------------------------------------------------ dispatch


def test_dispatcher_rules():
    cpu = torch.randn(4)
    assert choose_backend("reference", object(), {"x": cpu}) == "reference"
    assert choose_backend("auto", object(), {"x": cpu}) == "reference"  # compiled kernel, CPU tensor
    with pytest.raises(ValueError, match="x is on cpu"):
        choose_backend("triton", object(), {"x": cpu})
    with pytest.raises(ValueError, match="backend must be"):
        choose_backend("cuda", object(), {"x": cpu})
    # a reference call on CPU is exactly the reference
    g, u = torch.randn(5, 7), torch.randn(5, 7)
    assert torch.equal(swiglu(g, u, backend="reference"), F.silu(g) * u)


def test_needs_int64_threshold():
    assert not needs_int64(torch.empty(10))
    assert not needs_int64(torch.empty(2**31 - 1, device="meta"))
    assert needs_int64(torch.empty(2**31, device="meta"))
    # few elements, but strided so that the largest offset passes 2^31 - 1
    assert needs_int64(torch.empty_strided((2, 1000), (2**31, 1), device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with > 30 GB free")
def test_swiglu_over_two_billion_elements_cuda():
    """A real > 2^31-element tensor: the 64-bit path is chosen and the tail is computed right."""
    n = 2**31 + 4096
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert needs_int64(g)
    out = swiglu(g, u)
    tail = slice(n - 65536, n)
    head = slice(0, 65536)
    for part in (head, tail):
        assert torch.equal(out[part], swiglu_reference(g[part], u[part]))
    del out
    g.requires_grad_()
    u.requires_grad_()
    out = swiglu(g, u)
    out.backward(torch.ones_like(out))
    gr, ur = g[tail].detach().requires_grad_(), u[tail].detach().requires_grad_()
    swiglu_reference(gr.float(), ur.float()).sum().backward()
    assert rel_err(g.grad[tail], gr.grad) < 1e-2 and rel_err(u.grad[tail], ur.grad) < 1e-2


def test_auto_backend_gives_float64_inputs_float64_math(monkeypatch):
    """The Triton kernels compute in float32: "auto" sends float64 tensors to the reference (as the losses
    do), so a float64 SwiGLU is exact where the kernel would round; "triton" asked for stays Triton."""
    import swiftune.kernels.launch as launch

    monkeypatch.setattr(launch, "kernel_is_interpreted", lambda kernel: True)  # as under TRITON_INTERPRET=1 on CPU
    x = torch.ones(2, 3, dtype=torch.float64)
    assert choose_backend("auto", object(), {"x": x}) == "reference"
    assert choose_backend("auto", object(), {"x": x.float()}) == "triton"
    assert choose_backend("triton", object(), {"x": x}) == "triton"
