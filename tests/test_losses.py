"""swiftune.losses against float64 references that materialise the logits."""

from __future__ import annotations

import pytest
import torch

from swiftune.losses import (
    choose_chunk_tokens,
    free_gpu_bytes,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    selective_log_softmax,
    selective_log_softmax_reference,
)
from swiftune.losses.chunking import CPU_BUDGET_BYTES, vocab_blocks
from tests.helpers import rel_err

FP32_TOL = 1e-5  # float32 against float64: "well under 1e-4"
BF16_TOL = 1e-2
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# "auto": Triton block kernels (compiled on CUDA, interpreted on CPU: conftest sets TRITON_INTERPRET);
# "reference": the plain-PyTorch block math (same chunking).
BACKENDS = ["auto", "reference"]


def _inputs(shape, H, V, device, seed, bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, H, generator=g)
    w = torch.randn(V, H, generator=g) * H**-0.5 * 2
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    lab = torch.randint(0, V, shape, generator=g)
    conv = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return conv(h), conv(w), conv(b), lab.to(device)


def _leaves(*ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in ts]


def _grads(*ts):
    return [None if t is None else t.grad for t in ts]


def _check(actual, expected, tol):
    for a, e in zip(actual, expected):
        if e is None:
            assert a is None
            continue
        err = rel_err(a, e)
        assert err < tol, err


def _run_ce(h, w, b, lab, ref_dtype=torch.float64, upstream=None, **kw):
    """(loss, grads) of swiftune and of the reference (in ``ref_dtype``) for the same inputs."""
    ref_kw = {k: v for k, v in kw.items() if k not in ("chunk_tokens", "vocab_chunk", "chunk_multiplier", "backend")}
    out = []
    for fn, dt, extra in ((linear_cross_entropy, None, kw), (linear_cross_entropy_reference, ref_dtype, ref_kw)):
        hh, ww, bb = _leaves(h, w, b, dtype=dt)
        loss = fn(hh, ww, lab, bias=bb, **extra)
        g = torch.ones_like(loss) if upstream is None else upstream.to(loss)
        (loss * g).sum().backward()
        out.append((loss, _grads(hh, ww, bb)))
    return out


CE_CASES = [
    # shape, H, V, chunk_tokens, vocab_chunk, softcap, scale, bias, reduction
    ((2, 13), 16, 37, None, None, None, None, False, "mean"),
    ((2, 13), 16, 37, 5, None, 2.5, None, True, "mean"),
    ((26,), 8, 50, 1, 7, None, 0.6, False, "sum"),
    ((3, 9), 16, 41, 4, 16, 3.0, 1.7, True, "mean"),
    ((3, 9), 16, 41, 27, 11, 3.0, 0.5, True, "none"),
    ((4, 5), 12, 29, 3, None, None, None, True, "none"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,H,V,chunk,vchunk,softcap,scale,bias,reduction", CE_CASES)
def test_cross_entropy_matches_reference(device, backend, shape, H, V, chunk, vchunk, softcap, scale, bias, reduction):
    h, w, b, lab = _inputs(shape, H, V, device, seed=len(shape) * 100 + V, bias=bias)
    lab[..., ::3] = -100  # some ignored labels everywhere
    upstream = torch.randn(lab.shape, dtype=torch.float64) if reduction == "none" else None
    (loss, grads), (ref, ref_grads) = _run_ce(
        h, w, b, lab, upstream=upstream, reduction=reduction, chunk_tokens=chunk, vocab_chunk=vchunk,
        logit_softcap=softcap, logit_scale=scale, backend=backend,
    )
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert rel_err(loss, ref) < FP32_TOL
    _check(grads, ref_grads, FP32_TOL)
    if reduction == "none":
        assert (loss[lab == -100] == 0).all()


def test_cross_entropy_one_label_left(device):
    h, w, b, lab = _inputs((3, 11), 16, 45, device, seed=1, bias=True)
    keep = lab[1, 7].item()
    lab.fill_(-100)
    lab[1, 7] = keep
    (loss, grads), (ref, ref_grads) = _run_ce(h, w, b, lab, chunk_tokens=2, logit_softcap=4.0)
    assert rel_err(loss, ref) < FP32_TOL
    _check(grads, ref_grads, FP32_TOL)
    assert grads[0].abs().sum(-1).nonzero().tolist() == [[1, 7]]  # only that row gets a gradient


@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("mean", 0), ("sum", None), ("none", None)])
def test_cross_entropy_all_ignored(device, reduction, num_items):
    h, w, b, lab = _inputs((2, 6), 8, 19, device, seed=2, bias=True)
    lab.fill_(-100)
    hh, ww, bb = _leaves(h, w, b)
    loss = linear_cross_entropy(hh, ww, lab, reduction=reduction, num_items=num_items, bias=bb)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and (loss == 0).all()
    for g in _grads(hh, ww, bb):
        assert g is not None and torch.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_chunked_equals_unchunked(device, backend):
    h, w, b, lab = _inputs((40,), 16, 53, device, seed=3, bias=True)
    lab[::4] = -100
    n = int((lab != -100).sum())
    full = None
    for chunk, vchunk in [(n, None), (1, None), (7, None), (n - 1, 10), (3, 53), (n, 52)]:
        hh, ww, bb = _leaves(h, w, b)
        loss = linear_cross_entropy(
            hh, ww, lab, bias=bb, chunk_tokens=chunk, vocab_chunk=vchunk, logit_scale=1.3, backend=backend
        )
        loss.backward()
        got = [loss, *_grads(hh, ww, bb)]
        if full is None:
            full = got
        else:
            _check(got, full, 1e-6)  # float32 rounding of a different summation order only


@pytest.mark.parametrize("as_tensor", [False, True])
def test_cross_entropy_gradient_accumulation(device, as_tensor):
    h, w, b, lab = _inputs((4, 10), 16, 31, device, seed=4, bias=True)
    lab[0, :8] = -100  # unequal labelled counts per micro-batch
    lab[2, 3:] = -100
    total = int((lab != -100).sum())
    num_items = torch.tensor(total, device=device) if as_tensor else total
    hh, ww, bb = _leaves(h, w, b)
    accumulated = sum(
        linear_cross_entropy(hh[i : i + 1], ww, lab[i : i + 1], num_items=num_items, bias=bb, chunk_tokens=3)
        for i in range(4)
    )
    accumulated.backward()
    h1, w1, b1 = _leaves(h, w, b)
    one = linear_cross_entropy(h1, w1, lab, bias=b1)
    one.backward()
    assert rel_err(accumulated, one) < 1e-6
    _check(_grads(hh, ww, bb), _grads(h1, w1, b1), 1e-6)


def test_cross_entropy_frozen_head_and_upstream_scale(device):
    """LoRA-style frozen LM head: no weight grad is computed; upstream gradient scales the saved grads."""
    h, w, _, lab = _inputs((2, 9), 16, 23, device, seed=5)
    hh = h.clone().requires_grad_()
    (linear_cross_entropy(hh, w, lab, chunk_tokens=4) * 3.0).backward()
    hr = h.double().requires_grad_()
    (linear_cross_entropy_reference(hr, w.double(), lab) * 3.0).backward()
    assert w.grad is None
    assert rel_err(hh.grad, hr.grad) < FP32_TOL
    with torch.no_grad():
        assert rel_err(linear_cross_entropy(h, w, lab), linear_cross_entropy_reference(h.double(), w.double(), lab)) < FP32_TOL


def test_cross_entropy_rejects_bad_labels():
    h, w, _, lab = _inputs((5,), 8, 11, "cpu", seed=6)
    lab[2] = 11
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, lab)
    with pytest.raises(ValueError, match="num_items"):
        linear_cross_entropy(h, w, lab.clamp_max(10), reduction="sum", num_items=3)


def _run_sls(h, w, b, idx, entropy, ref_dtype=torch.float64, seed=0, **kw):
    ref_kw = {
        k: v for k, v in kw.items() if k not in ("chunk_tokens", "vocab_chunk", "offload", "chunk_multiplier", "backend")
    }
    gen = torch.Generator().manual_seed(seed)
    gl = torch.randn(idx.shape, generator=gen, dtype=torch.float64)
    ge = torch.randn(idx.shape, generator=gen, dtype=torch.float64)
    out = []
    for fn, dt, extra in ((selective_log_softmax, None, kw), (selective_log_softmax_reference, ref_dtype, ref_kw)):
        hh, ww, bb = _leaves(h, w, b, dtype=dt)
        res = fn(hh, ww, idx, bias=bb, return_entropy=entropy, **extra)
        logp, ent = res if entropy else (res, None)
        loss = (logp * gl.to(logp)).sum() + (0 if ent is None else (ent * ge.to(ent)).sum())
        loss.backward()
        out.append(((logp, ent), _grads(hh, ww, bb)))
    return out


SLS_CASES = [
    # shape, H, V, temperature, softcap, scale, chunk, vocab_chunk, bias, entropy
    ((2, 11), 16, 37, 1.0, None, None, None, None, False, False),
    ((2, 11), 16, 37, 0.7, None, None, 1, None, True, True),
    ((22,), 8, 50, 1.3, 2.0, None, 5, 7, False, True),
    ((3, 7), 16, 41, 0.9, 4.0, 1.5, 21, 16, True, False),
    ((3, 7), 16, 41, 1.0, None, 0.8, 6, 40, False, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,H,V,T,softcap,scale,chunk,vchunk,bias,entropy", SLS_CASES)
def test_selective_log_softmax_matches_reference(
    device, backend, shape, H, V, T, softcap, scale, chunk, vchunk, bias, entropy
):
    h, w, b, idx = _inputs(shape, H, V, device, seed=V + int(10 * T), bias=bias)
    ((logp, ent), grads), ((ref, ref_ent), ref_grads) = _run_sls(
        h, w, b, idx, entropy, temperature=T, logit_softcap=softcap, logit_scale=scale,
        chunk_tokens=chunk, vocab_chunk=vchunk, backend=backend,
    )
    assert logp.dtype == torch.float32 and logp.shape == idx.shape
    assert rel_err(logp, ref) < FP32_TOL
    if entropy:
        assert ent.shape == idx.shape and rel_err(ent, ref_ent) < FP32_TOL
    _check(grads, ref_grads, FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_entropy_only_gradient(device, backend):
    """Entropy used, logp not: the backward gets no logp gradient and must still be right."""
    h, w, b, idx = _inputs((10,), 8, 21, device, seed=7, bias=True)
    res = []
    for fn, dt in ((selective_log_softmax, None), (selective_log_softmax_reference, torch.float64)):
        hh, ww, bb = _leaves(h, w, b, dtype=dt)
        kw = {"chunk_tokens": 3, "backend": backend} if fn is selective_log_softmax else {}
        _, ent = fn(hh, ww, idx, temperature=0.8, logit_softcap=5.0, return_entropy=True, bias=bb, **kw)
        ent.sum().backward()
        res.append(_grads(hh, ww, bb))
    _check(res[0], res[1], FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_chunked_equals_unchunked_and_offload_noop(device, backend):
    h, w, b, idx = _inputs((2, 15), 16, 33, device, seed=8, bias=True)
    full = None
    for chunk, vchunk, offload in [(30, None, False), (1, None, False), (7, 10, False), (30, None, True), (4, None, True)]:
        (values, grads), _ = _run_sls(
            h, w, b, idx, True, temperature=0.9, logit_softcap=3.0, chunk_tokens=chunk, vocab_chunk=vchunk,
            offload=offload, backend=backend,
        )
        got = [*values, *grads]
        if full is None:
            full = got
        else:
            _check(got, full, 1e-6)


def test_float64_gradcheck():
    """Our backward against finite differences of our own forward (float64 end to end)."""
    h, w, b, lab = _inputs((5,), 4, 9, "cpu", seed=9, bias=True, dtype=torch.float64)
    hh, ww, bb = _leaves(h, w, b)
    lab[1] = -100
    kw = dict(chunk_tokens=2, vocab_chunk=4, logit_softcap=2.0, logit_scale=0.8)

    def sls(x, y, z):
        logp, ent = selective_log_softmax(x, y, lab.clamp_min(0), temperature=0.7, return_entropy=True, bias=z, **kw)
        return logp.sum() + 0.3 * ent.sum()

    assert torch.autograd.gradcheck(lambda x, y, z: linear_cross_entropy(x, y, lab, bias=z, **kw), (hh, ww, bb), fast_mode=True)
    assert torch.autograd.gradcheck(sls, (hh, ww, bb), fast_mode=True)


def test_negative_control_wrong_temperature():
    """The comparison can fail: a reference at the wrong temperature is far off."""
    h, w, _, idx = _inputs((12,), 16, 30, "cpu", seed=10)
    logp = selective_log_softmax(h, w, idx, temperature=0.7)
    assert rel_err(logp, selective_log_softmax_reference(h.double(), w.double(), idx, temperature=0.7)) < FP32_TOL
    assert rel_err(logp, selective_log_softmax_reference(h.double(), w.double(), idx, temperature=1.0)) > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_inputs(device, reduction, backend):
    h, w, b, lab = _inputs((3, 16), 32, 61, device, seed=11, bias=True, dtype=torch.bfloat16)
    lab[0, ::2] = -100
    upstream = torch.randn(lab.shape, dtype=torch.float64) if reduction == "none" else None
    (loss, grads), (ref, ref_grads) = _run_ce(
        h, w, b, lab, upstream=upstream, reduction=reduction, chunk_tokens=7, logit_softcap=6.0, backend=backend
    )
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    assert rel_err(loss, ref) < BF16_TOL
    _check(grads, ref_grads, BF16_TOL)
    ((logp, ent), sgrads), ((sref, sent), sref_grads) = _run_sls(
        h, w, b, lab.clamp_min(0), True, temperature=0.8, chunk_tokens=9, backend=backend
    )
    assert logp.dtype == torch.float32 and [g.dtype for g in sgrads] == [torch.bfloat16] * 3
    assert rel_err(logp, sref) < BF16_TOL and rel_err(ent, sent) < BF16_TOL
    _check(sgrads, sref_grads, BF16_TOL)


def test_cpu_autocast_matmul_dtype():
    """Under autocast the matmuls run in the autocast dtype (as F.linear would), stats in float32."""
    h, w, _, lab = _inputs((20,), 32, 40, "cpu", seed=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, lab, chunk_tokens=6)
        logp = selective_log_softmax(h, w, lab, chunk_tokens=6)
    assert loss.dtype == logp.dtype == torch.float32
    assert 1e-6 < rel_err(loss, linear_cross_entropy_reference(h.double(), w.double(), lab)) < BF16_TOL
    assert rel_err(logp, selective_log_softmax_reference(h.double(), w.double(), lab)) < BF16_TOL


def test_planner_plans_the_losses_default_chunk():
    from swiftune.losses.chunking import MAX_CHUNK_TOKENS
    from swiftune.memory.planner import DEFAULT_LOGIT_CHUNK

    assert DEFAULT_LOGIT_CHUNK == MAX_CHUNK_TOKENS


def test_choose_chunk_tokens():
    qwen = dict(hidden_size=4096, vocab_size=151936)
    per_token = 151936 * 10 + 4096 * 6
    # 40 GB free -> a quarter of it over ~1.5 MB per token, capped at 1,024 (MAX_CHUNK_TOKENS)
    assert choose_chunk_tokens(1_000_000, free_bytes=40 * 2**30, **qwen) == 1024
    assert choose_chunk_tokens(1_000_000, free_bytes=40 * 2**30, max_chunk=4096, **qwen) == 4096
    assert choose_chunk_tokens(1_000_000, free_bytes=4 * 2**30, **qwen) == 640  # 1 GiB / 1.54 MB = 695 -> multiple of 64
    assert choose_chunk_tokens(1_000_000, free_bytes=0, **qwen) == 16  # min_chunk
    assert choose_chunk_tokens(100, free_bytes=40 * 2**30, **qwen) == 100  # never above the tokens
    assert choose_chunk_tokens(5, free_bytes=0, **qwen, min_chunk=16) == 5
    assert choose_chunk_tokens(0, free_bytes=2**30, **qwen) == 1
    assert choose_chunk_tokens(4097, free_bytes=40 * 2**30, max_chunk=4096, **qwen) == 2112  # 2 chunks, not 4096 + 1
    assert choose_chunk_tokens(4097, free_bytes=40 * 2**30, **qwen) == 832  # 5 balanced chunks of <= 1,024
    assert choose_chunk_tokens(1_000_000, free_bytes=40 * 2**30, multiplier=2.0, **qwen) == 2048
    # the fused kernels need only the bf16 block: ~5x the tokens for the same budget
    assert choose_chunk_tokens(1_000_000, free_bytes=4 * 2**30, logit_bytes=2, max_chunk=8192, **qwen) == 3264
    last = 0
    for free in [0, 1, 2**20, 2**28, 2**30, 3 * 2**30, 2**33, 2**35, 2**37, 2**40]:
        for n in (1, 63, 4096, 10_000, 123_457):
            c = choose_chunk_tokens(n, free_bytes=free, **qwen)
            assert 1 <= c <= min(n, 1024)
            budget_c = max(16, free // 4 // per_token)
            assert c <= budget_c or c <= 16  # bounded by the memory fraction
        c = choose_chunk_tokens(123_457, free_bytes=free, **qwen)
        assert c >= last  # monotone in free memory
        last = c
    assert free_gpu_bytes("cpu") == CPU_BUDGET_BYTES
    assert vocab_blocks(151936, None) == [(0, 151936)]
    assert vocab_blocks(300_000, None) == [(0, 150_000), (150_000, 300_000)]
    assert vocab_blocks(10, 4) == [(0, 4), (4, 8), (8, 10)]


@cuda
def test_cuda_offload_real_path():
    torch.cuda.synchronize()
    h, w, b, idx = _inputs((4, 300), 64, 1000, "cuda", seed=13, bias=True, dtype=torch.bfloat16)
    res = []
    for offload in (False, True):
        hh, ww, bb = _leaves(h, w, b)
        logp, ent = selective_log_softmax(
            hh * 1.0, ww, idx, temperature=0.9, chunk_tokens=128, offload=offload, return_entropy=True, bias=bb
        )
        (logp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        res.append([logp, ent, *_grads(hh, ww, bb)])
    for a, e in zip(*res):
        assert torch.equal(a, e)  # same kernels, same order: bitwise equal


def test_offloaded_rows_in_blocks_cover_every_slice():
    """The pinned copy of the offloaded hidden states is kept in row blocks of at most PINNED_BLOCK_BYTES
    (torch's pinned allocator rounds one request up to a power of two: one [T, H] buffer would pin up to 2x
    its size); any row range read back is the pieces of the blocks that hold it, in order."""
    from swiftune.losses.selective_log_softmax import PINNED_BLOCK_BYTES, block_pieces, row_blocks

    assert PINNED_BLOCK_BYTES & (PINNED_BLOCK_BYTES - 1) == 0  # a power of two: a full block wastes nothing
    # Qwen3-8B's 676,352-token row in bf16: 8 KiB rows, 8,192 rows (64 MiB) a block
    blocks = row_blocks(676_352, 4096 * 2)
    assert blocks[0] == (0, 8192) and blocks[-1][1] == 676_352 and len(blocks) == 83
    assert max((r1 - r0) * 8192 for r0, r1 in blocks) == PINNED_BLOCK_BYTES
    rows = torch.arange(1000)
    for row_bytes, block in [(8, 80), (24, 100), (7, 7), (1000, 10)]:  # 10/4/1/1 rows a block
        blocks = row_blocks(1000, row_bytes, block)
        assert blocks[0][0] == 0 and blocks[-1][1] == 1000 and all(x[1] == y[0] for x, y in zip(blocks, blocks[1:]))
        assert all((r1 - r0) * row_bytes <= max(block, row_bytes) for r0, r1 in blocks)
        stored = [rows[r0:r1] for r0, r1 in blocks]
        for a, b in [(0, 1000), (0, 1), (3, 17), (9, 11), (990, 1000), (500, 500)]:
            got = [stored[i][lo:hi] for i, lo, hi in block_pieces(a, b, blocks)]
            assert torch.equal(torch.cat(got) if got else rows[:0], rows[a:b]), (row_bytes, block, a, b)


@cuda
def test_cuda_offloaded_blocks_read_back_every_chunk():
    from swiftune.losses.selective_log_softmax import _Offloaded

    t = torch.randn(1000, 24, device="cuda", dtype=torch.bfloat16)
    off = _Offloaded(t, block_bytes=24 * 2 * 64)  # 64 rows a block: chunks of 100 cross blocks
    assert len(off.cpu) == 16 and all(b.is_pinned() for b in off.cpu)
    bounds = [(a, min(a + 100, 1000)) for a in range(0, 1000, 100)] + [(5, 6), (60, 70)]
    for (a, b), x in zip(bounds, off.chunks(bounds)):
        assert torch.equal(x, t[a:b]), (a, b)


@cuda
def test_cuda_bf16_large_vocab_against_reference():
    h, w, b, lab = _inputs((2, 256), 128, 5000, "cuda", seed=14, dtype=torch.bfloat16)
    lab[:, :100] = -100
    (loss, grads), (ref, ref_grads) = _run_ce(h, w, b, lab, chunk_tokens=100, vocab_chunk=2048)
    assert rel_err(loss, ref) < BF16_TOL
    _check(grads, ref_grads, BF16_TOL)


def test_free_gpu_bytes_respects_the_per_process_memory_fraction(monkeypatch):
    """A process capped by ``set_per_process_memory_fraction`` (a shared GPU, an emulated smaller one) can
    allocate only up to its cap, though the driver reports the whole GPU free: the budgets that size
    offloaded checkpointing and loss chunks must see the cap, or they plan for memory the allocator refuses."""
    from types import SimpleNamespace

    from swiftune.losses.chunking import gpu_capacity_bytes

    GB = 10**9
    state = {"fraction": 20.7 / 140}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (120 * GB, 140 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 18 * GB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 17 * GB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: SimpleNamespace(total_memory=140 * GB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda dev=None: state["fraction"],
                        raising=False)
    assert gpu_capacity_bytes("cuda:0") == pytest.approx(20.7 * GB, rel=1e-9)
    # 2.7 GB left under the cap + 1 GB reserved by the allocator but not handed out
    assert free_gpu_bytes("cuda:0") == pytest.approx(3.7 * GB, rel=1e-9)
    state["fraction"] = 1.0  # no cap: the driver's free memory + the allocator's cached bytes
    assert free_gpu_bytes("cuda:0") == 121 * GB
    state["fraction"] = 0.1  # already over the cap (14 GB < 18 GB reserved): only the cached bytes
    assert free_gpu_bytes("cuda:0") == 1 * GB


def test_float_labels_are_refused_not_truncated():
    hidden, weight = torch.randn(2, 8), torch.randn(5, 8)
    for labels in (torch.tensor([1.7, 1.0]), torch.tensor([True, False])):
        with pytest.raises(ValueError, match="labels must be integer token ids"):
            linear_cross_entropy(hidden, weight, labels)
        with pytest.raises(ValueError, match="index must be integer token ids"):
            selective_log_softmax(hidden, weight, labels)
