"""The FP8 x FP8 decode kernel (``swiftune.kernels.fp8_dot``): activations quantised per row to e4m3, then
``tl.dot`` on e4m3 codes with both scales and the bias in the epilogue.

Reference: the float64 formula ``(q(x) sx) (Q s)^T + b`` in plain torch, with ``q(x)`` and ``sx`` made by
plain torch ops here (``max |x| / 448``, IEEE division, torch's own ``float8_e4m3fn`` cast), never swiftune;
and torch's own ``torch._scaled_mm`` on the same codes (it runs on CPU). On CPU the kernel runs through the
Triton interpreter (tests/conftest.py), whose fp8 ``tl.dot`` multiplies the codes exactly in float32: the
kernel body the GPU compiles, with both K-loop decodings (``"fp8"`` and ``"bits"``), both operand orders
(``swap_ab``) and the split-K reduction. Without a GPU the kernel is also compiled for sm_90 (Triton's
NVIDIA backend needs none), to check that the codes reach FP8 ``wgmma`` unconverted; on a CUDA machine
every test runs compiled, and the Qwen3-8B projections add a CUDA-graph replay == eager check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from swiftune.kernels.fp8_dot import fp8_dot_matmul, fp8_dot_matmul_reference, fp8_dot_quantize
from tests.test_fp8_matmul import _assert_close, _rel

E4M3 = torch.float8_e4m3fn


def _torch_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch per-row e4m3: ``s = max|x| / 448`` (1 for a zero row), ``q = e4m3(clamp(x / s))``."""
    v = x.float()
    amax = v.abs().amax(dim=-1, keepdim=True)
    s = amax / torch.full_like(amax, 448.0)  # a tensor divisor: IEEE division on CUDA too
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (v / s).clamp(-448.0, 448.0).to(E4M3), s


def _operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0, device: str = "cpu"):
    """x ``[m, k]`` (one row of zeros: its scale is 1 and its codes 0), e4m3 weight codes spanning e4m3's
    range (subnormals included), per-row weight scales, bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]
    x[m // 2] = 0
    w = (torch.randn(n, k, generator=g) * torch.logspace(-3, 2.4, k)[torch.randperm(k, generator=g)]).clamp(-448, 448)
    s = torch.rand(n, generator=g) * 1e-2 + 1e-3
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return (x.to(dtype).to(device), w.to(E4M3).to(device), s.to(device), None if b is None else b.to(device))


def _float64(xq: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None):
    y = (xq.double() * xs.double().reshape(-1, 1)) @ (q.double() * s.double().reshape(-1, 1)).t()
    return y if b is None else y + b.double()


def _abs_terms(xq: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``sum_k |x_k w_k|`` per output: the scale of any summation error."""
    return (xq.double().abs() * xs.double().reshape(-1, 1)) @ (q.double().abs() * s.double().reshape(-1, 1)).t()


def _fp8_slack(device: str, decode: str = "auto", precise_acc: bool = True) -> float:
    """Summation error allowed, relative to :func:`_abs_terms`, beyond float32's: 0 where the K loop
    adds in float32 (the interpreter, the ``"bits"`` decoding, GPUs without FP8 tensor cores). Hopper's
    FP8 tensor cores add the products of each BLOCK_K step in a reduced-precision accumulator (about 14
    significant bits, as DeepSeek-V3 reports; products aligned to the largest, truncated) before the
    float32 add: 2^-9 of the terms allowed per output (a worst case: errors of one sign); without that
    promotion (``precise_acc=False``) the whole K loop stays there: 2^-5. Norm-wise the errors average
    out, which :func:`_assert_formula` checks far tighter."""
    if device != "cuda" or decode == "bits" or torch.cuda.get_device_capability() < (8, 9):
        return 0.0
    return 2.0**-9 if precise_acc else 2.0**-5


def _assert_formula(y: torch.Tensor, want: torch.Tensor, terms: torch.Tensor, dtype: torch.dtype, slack: float,
                    label: object = "") -> None:
    """Within float32 summation error (fp32) or one rounding (bf16/fp16) of the float64 value, plus
    ``slack`` times the sum of |terms| (:func:`_fp8_slack`) per output; never NaN. With a slack, the
    relative norm of the error also stays within 2e-3 (fp32) / 6e-3 (bf16) with the accumulator's
    promotion and 3e-2 without: a wrong scale or a lost partial sum is off by O(1)."""
    assert y.dtype == dtype and y.shape == want.shape and torch.isfinite(y).all(), label
    if slack == 0.0:
        _assert_close(y, want, dtype)
        return
    half_ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    err = (y.double() - want).abs()
    bound = want.abs() * half_ulp + 1e-6 * want.abs().max() + slack * terms
    assert torch.all(err <= bound), (label, float((err - bound).max()))
    rel_max = 3e-2 if slack > 2.0**-9 else 2e-3 if dtype == torch.float32 else 6e-3
    assert _rel(y, want) < rel_max, (label, _rel(y, want))


# (m, n, k, split_k, block_n): rows 17..64 (the path's range), K not a multiple of 128, forced splits
_SHAPES = [(17, 64, 256, None, None), (33, 129, 130, 3, None), (64, 70, 384, 2, 32), (24, 100, 300, 1, 64)]
_CASES = [(dtype, *shape, swap, decode) for dtype in (torch.float32, torch.bfloat16) for shape in _SHAPES
          for swap in (True, False) for decode in ("fp8", "bits")]


@pytest.mark.parametrize("dtype,m,n,k,split,block_n,swap,decode", _CASES,
                         ids=[f"{str(c[0])[6:]}-m{c[1]}-n{c[2]}-k{c[3]}-split{c[4]}-bn{c[5]}-"
                              f"{'swap' if c[6] else 'noswap'}-{c[7]}" for c in _CASES])
def test_kernel_equals_float64_formula(device, dtype, m, n, k, split, block_n, swap, decode):
    """A float ``x`` (quantised inside) and the same rows given as codes and scales both give the float64
    formula on plain torch's codes, within float32 summation error (fp32) or one bf16 rounding."""
    x, q, s, b = _operands(m, n, k, dtype, bias=m % 2 == 1, device=device)
    xq, xs = _torch_quant(x)
    want = _float64(xq, xs, q, s, b)
    kw = dict(backend="triton", split_k=split, block_n=block_n, swap_ab=swap, decode=decode)
    if device == "cuda" and decode == "fp8":
        kw["decode"] = "auto"  # "fp8" needs FP8 tensor cores (the interpreter has them all)
    with torch.no_grad():
        y = fp8_dot_matmul(x, q, s, b, **kw)
        y_codes = fp8_dot_matmul(xq, q, s, b, x_scale=xs, out_dtype=dtype, **kw)
        ref = fp8_dot_matmul_reference(xq, xs, q, s, b, dtype)
    _assert_formula(y, want, _abs_terms(xq, xs, q, s), dtype, _fp8_slack(device, decode))
    assert torch.equal(y, y_codes)  # the quantiser inside gives plain torch's codes and scales
    _assert_close(ref, want, dtype)
    assert want.abs().max() > 0 and torch.all(y[m // 2] == (0 if b is None else b.to(dtype)))


def test_equals_torch_scaled_mm_on_the_same_codes(device):
    """torch's own FP8 matmul on the same codes and scales: float32 outputs within float32 summation
    error of each other, bf16 outputs within one bf16 rounding (of nearly the same float32 value)."""
    x, q, s, b = _operands(48, 96, 256, torch.bfloat16, True, seed=3, device=device)
    xq, xs = _torch_quant(x)
    with torch.no_grad():
        for out_dtype in (torch.float32, torch.bfloat16):
            try:
                theirs = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=out_dtype)
            except RuntimeError as e:  # a GPU without FP8 tensor cores
                pytest.skip(f"torch._scaled_mm does not run here: {e}")
            ours = fp8_dot_matmul(xq, q, s, None, x_scale=xs, out_dtype=out_dtype, backend="triton")
            assert ours.dtype == out_dtype and torch.isfinite(ours).all()
            # both sum in float32 here, in different orders; on FP8 tensor cores each may be off by the slack
            slack = 2 * _fp8_slack(device) * _abs_terms(xq, xs, q, s)
            err = (ours.double() - theirs.double()).abs()
            if out_dtype == torch.float32:
                assert torch.all(err <= theirs.double().abs() * 2.0**-20 + 1e-6 * theirs.abs().max() + slack)
                assert _rel(ours, theirs) < (1e-6 if slack.max() == 0 else 2e-3)
            else:
                assert torch.all(err <= theirs.double().abs() * 2.0**-7 + 1e-6 + slack), float(err.max())
                assert _rel(ours, theirs) < (4e-3 if slack.max() == 0 else 6e-3)
    assert theirs.abs().max() > 0


def test_leading_axes_strided_x_64_bit_indexing_and_fixed_order_split(device):
    x, q, s, b = _operands(20, 40, 256, torch.float32, True, seed=1, device=device)
    x3 = torch.randn(2, 10, 400, device=device)[..., 100:356]  # rows 400 apart, not contiguous
    xq, xs = _torch_quant(x3.reshape(-1, 256))
    want = _float64(xq, xs, q, s, b)
    terms, slack = _abs_terms(xq, xs, q, s), _fp8_slack(device)
    with torch.no_grad():
        y = fp8_dot_matmul(x3, q, s.view(-1, 1), b, backend="triton")
        y64 = fp8_dot_matmul(x3, q.view(torch.uint8), s, b, backend="triton", _force_int64=True, split_k=2)
        again = fp8_dot_matmul(x3, q, s, b, backend="triton", _force_int64=True, split_k=2)
    assert y.shape == (2, 10, 40)
    _assert_formula(y.view(20, 40), want, terms, torch.float32, slack)
    _assert_formula(y64.view(20, 40), want, terms, torch.float32, slack)
    assert torch.equal(again, y64)  # the split-K partials are added in a fixed order: the same bits


@pytest.mark.parametrize("m,n,k,split,block_m,bias", [(40, 96, 512, 2, 16, True), (64, 70, 384, 3, None, False),
                                                      (17, 129, 1024, 4, 16, True), (33, 64, 256, 1, None, True)])
def test_split_reduced_in_launch_equals_second_launch_bit_for_bit(device, m, n, k, split, block_m, bias):
    """A split K's partials added by each tile's last program (``reduce_in_launch``) give the bits of the second
    reduce launch (the same float32 additions in the same order), with several row and column tiles; both
    within the float64 formula's bound; the tile counts are left at zero for the next call (which then
    gives the same bits again)."""
    from swiftune.kernels._fp8_common import tile_counters

    x, q, s, b = _operands(m, n, k, torch.bfloat16, bias, seed=m + split, device=device)
    xq, xs = _torch_quant(x)
    kw = dict(backend="triton", split_k=split, block_m=block_m, block_n=32, x_scale=xs)
    with torch.no_grad():
        here = fp8_dot_matmul(xq, q, s, b, reduce_in_launch=True, **kw)
        counts = tile_counters.get(x.device, 1)  # the buffer the launcher used
        assert int(counts.abs().sum()) == 0  # every tile's count back at zero
        launched = fp8_dot_matmul(xq, q, s, b, reduce_in_launch=False, **kw)
        again = fp8_dot_matmul(xq, q, s, b, reduce_in_launch=True, **kw)
    assert torch.equal(here, launched) and torch.equal(again, here)
    _assert_formula(here, _float64(xq, xs, q, s, b), _abs_terms(xq, xs, q, s), torch.bfloat16, _fp8_slack(device))
    assert here.abs().max() > 0


def test_plain_cpu_reference_and_empty_inputs():
    """Without the interpreter's backend the plain-PyTorch path gives the formula too; no rows, or K = 0
    (an empty sum: the bias alone), need no kernel."""
    x, q, s, b = _operands(18, 24, 64, torch.float32, True, seed=2)
    xq, xs = _torch_quant(x)
    with torch.no_grad():
        y = fp8_dot_matmul(x, q, s, b, backend="reference")
        empty = fp8_dot_matmul(x[:0], q, s, b, backend="reference")
        no_k = fp8_dot_matmul(torch.ones(3, 0), q[:, :0], s, b, backend="reference")
    assert _rel(y, _float64(xq, xs, q, s, b)) < 1e-6
    assert empty.shape == (0, 24)
    assert torch.equal(no_k, b.expand(3, 24))


def test_bad_inputs_are_refused():
    x, q, s, b = _operands(17, 16, 64, torch.float32, True)
    xq, xs = _torch_quant(x)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_dot_matmul(x, q.float(), s)
    with pytest.raises(ValueError, match="in_features"):
        fp8_dot_matmul(x[:, :8], q, s)
    with pytest.raises(ValueError, match="one float32 value per output row"):
        fp8_dot_matmul(x, q, s[:4])
    with pytest.raises(ValueError, match="bias must have"):
        fp8_dot_matmul(x, q, s, b[:3])
    with pytest.raises(ValueError, match="needs x_scale"):
        fp8_dot_matmul(xq, q, s)
    with pytest.raises(ValueError, match="needs x_scale"):
        fp8_dot_matmul(xq, q, s, x_scale=xs[:3])
    with pytest.raises(ValueError, match="pass a float x without it"):
        fp8_dot_matmul(x, q, s, x_scale=xs)
    with pytest.raises(ValueError, match="out_dtype is x's dtype"):
        fp8_dot_matmul(x, q, s, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        fp8_dot_matmul(x, q, s, block_n=24)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 32"):
        fp8_dot_matmul(x, q, s, block_k=16)
    with pytest.raises(ValueError, match="decode must be"):
        fp8_dot_matmul(x, q, s, decode="native")
    with pytest.raises(RuntimeError, match="no backward"):
        fp8_dot_matmul(x.clone().requires_grad_(), q, s)


# Compiles the kernel for sm_90 (H100/H200) in a fresh process: the test session's kernels are
# interpreted (tests/conftest.py), and Triton compiles for a GPU target it is given without one present.
_SM90_LOWERING = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from swiftune.kernels.fp8_dot import _fp8_dot_kernel

out = []
for bm, bn, bk, split, stages in json.loads(sys.argv[1]):
    sig = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16",
           "y_ptr": "*bf16", "p_ptr": "*fp32" if split > 1 else "*bf16", "c_ptr": "*i32" if split > 1 else "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
           "k_per_split": "i32"}
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, HAS_BIAS=True, FP8_DOT=True, SWAP_AB=True,
                 PROMOTE_EVERY=bk, BITS_DOT_F32=False, EVEN_K=True, ROUND_BF16=False, INT64=False,
                 REDUCE_HERE=split > 1)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(_fp8_dot_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=stages))
    ptx = k.asm["ptx"]
    out.append(dict(mma=sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)[.\w]*", ptx))),
                    converts=len(re.findall(r"cvt[.\w]*e4m3", ptx)), shared=k.metadata.shared,
                    atomics=sorted(set(re.findall(r"atom\.[.\w]*", ptx))),
                    l2_loads=len(re.findall(r"ld\.global\.cg", ptx))))
print(json.dumps(out))
"""


def test_sm90_lowering_feeds_e4m3_codes_to_wgmma():
    """Compiled for sm_90 (no GPU needed): the default decode tiles (17..32 and 33..64 rows, N <= 2048
    and wider) and the benchmark's deepest pipelines lower to FP8 ``wgmma`` with the activation rows on
    the instruction's N side (``m64n{BLOCK_M}k32 e4m3 x e4m3``), no e4m3 conversion anywhere (the
    codes go to the tensor cores untouched), within the H200's 227 KB of shared memory per block; a split
    K's in-launch reduction counts each tile with a GPU-scope acquire-release atomic add and reads the
    partials from L2 (``ld.global.cg``); an unsplit product has no atomic."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend compiles sm_90 code")
    configs = [(32, 64, 128, 8, 4), (32, 128, 128, 4, 4), (64, 64, 128, 8, 4), (64, 128, 128, 1, 4),
               (64, 128, 256, 2, 3), (64, 128, 128, 2, 6)]
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _SM90_LOWERING, json.dumps(configs)], env=env, capture_output=True,
                         text=True, timeout=300)
    if run.returncode and ("ptxas" in run.stderr and "not found" in run.stderr):
        pytest.skip("no ptxas in this Triton install")
    assert run.returncode == 0, run.stderr[-3000:]
    for (bm, _, _, split, _), got in zip(configs, json.loads(run.stdout.strip().splitlines()[-1])):
        assert got["mma"] == [f"wgmma.mma_async.sync.aligned.m64n{bm}k32.f32.e4m3.e4m3"], got
        assert got["converts"] == 0, got
        assert 0 < got["shared"] <= 227 * 1024, got
        if split > 1:  # the in-launch reduction: the tile's count released and acquired GPU-wide, partials from L2
            assert any(".gpu." in a and ".acq_rel." in a and ".add." in a for a in got["atomics"]), got
            assert got["l2_loads"] > 0, got
        else:
            assert got["atomics"] == [], got


# Qwen3-8B's decoder projections: (N, K)
_QWEN3_8B = {"q_o": (4096, 4096), "k_v": (1024, 4096), "gate_up": (12288, 4096), "down": (4096, 12288)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernel: needs CUDA")
@pytest.mark.parametrize("m", [17, 64])
@pytest.mark.parametrize("proj", list(_QWEN3_8B))
def test_cuda_qwen3_8b_projections_compiled_and_graph_replay(proj, m):
    """Each Qwen3-8B projection compiled at 17 and 64 rows, default tiles and forced ones (both operand
    orders, both decodings, splits, 8 warps, a 256-wide K step, no accumulator promotion), against the
    float64 formula (within one bf16 rounding plus :func:`_fp8_slack`); a CUDA graph replay of the
    launcher (quantise kernel included) equals its eager result bit for bit (no host sync, fixed-order
    sums)."""
    n, k = _QWEN3_8B[proj]
    x, q, s, b = _operands(m, n, k, torch.bfloat16, proj == "k_v", device="cuda")
    xq, xs = _torch_quant(x)
    want, terms = _float64(xq, xs, q, s, b), _abs_terms(xq, xs, q, s)
    configs = [dict(), dict(swap_ab=False), dict(block_n=64, split_k=4), dict(block_n=128, split_k=1, num_warps=8),
               dict(block_k=256, num_stages=3), dict(decode="bits", split_k=2), dict(precise_acc=False)]
    with torch.no_grad():
        for cfg in configs:
            y = fp8_dot_matmul(x, q, s, b, **cfg)
            slack = _fp8_slack("cuda", cfg.get("decode", "auto"), cfg.get("precise_acc", True))
            _assert_formula(y, want, terms, torch.bfloat16, slack, cfg)
        eager = fp8_dot_matmul(x, q, s, b, split_k=2)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fp8_dot_matmul(x, q, s, b, split_k=2)  # compiled before the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            captured = fp8_dot_matmul(x, q, s, b, split_k=2)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernel: needs CUDA")
@pytest.mark.parametrize("proj", list(_QWEN3_8B))
def test_cuda_split_reduced_in_launch_equals_second_launch_every_time(proj):
    """Compiled, at the G=64 decode step's 64 rows: the in-launch reduction (each tile's last program, its
    count's release / acquire ordering the other programs' partial stores before its loads) gives the
    second launch's bits on every one of 200 back-to-back calls (a missed ordering shows as a partial
    read before it was written: a different value on some call), at the default split and forced ones."""
    n, k = _QWEN3_8B[proj]
    x, q, s, b = _operands(64, n, k, torch.bfloat16, proj == "k_v", device="cuda")
    xq, xs = fp8_dot_quantize(x)
    with torch.no_grad():
        for split in (None, 2, 4, 8):
            want = fp8_dot_matmul(xq, q, s, b, x_scale=xs, split_k=split, reduce_in_launch=False)
            calls = [fp8_dot_matmul(xq, q, s, b, x_scale=xs, split_k=split, reduce_in_launch=True)
                     for _ in range(200)]
            torch.cuda.synchronize()
            assert all(torch.equal(y, want) for y in calls), (proj, split)
