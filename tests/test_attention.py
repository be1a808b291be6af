"""Packed attention: document layout, backends against each other and against each document alone."""

from __future__ import annotations

import pytest
import torch

from swiftune.attention import (
    ATTENTION_NAME,
    BACKENDS,
    PACKED_KWARG,
    backend_available,
    build_packed_batch,
    cu_seqlens_from_position_ids,
    packed_attention,
    packed_attention_forward,
    register_packed_attention,
    resolve_backend,
)
from tests.helpers import rel_err

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _positions(lengths: list[int], device="cpu") -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)


def _qkv(total: int, hq: int = 4, hk: int = 2, d: int = 16, dtype=torch.float64, device="cpu", grad=False):
    g = torch.Generator(device="cpu").manual_seed(total)
    q, k, v = (torch.randn(total, h, d, generator=g, dtype=torch.float32) for h in (hq, hk, hk))
    out = [t.to(device=device, dtype=dtype) for t in (q, k, v)]
    if grad:
        for t in out:
            t.requires_grad_(True)
    return out


def _alone(q, k, v, lengths, scale, window=None, softcap=None):
    """Independent oracle: every document alone, dense masked softmax in float64."""
    outs, start = [], 0
    groups = q.shape[1] // k.shape[1]
    for n in lengths:
        qd, kd, vd = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))
        kd, vd = kd.repeat_interleave(groups, 0), vd.repeat_interleave(groups, 0)
        s = qd @ kd.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        ok = (j <= i) & ((i - j < window) if window else True)
        outs.append((s.masked_fill(~ok, float("-inf")).softmax(-1) @ vd).transpose(0, 1))
        start += n
    return torch.cat(outs)


# ----------------------------------------------------------------------------- layout


def test_cu_seqlens_from_position_ids():
    cu, longest = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 9] and longest == 4
    # two rows: each row starts a document; 1-D input is one row
    cu, longest = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]]))
    assert cu.tolist() == [0, 4, 6, 8] and longest == 4
    cu, longest = cu_seqlens_from_position_ids(torch.arange(7))
    assert cu.tolist() == [0, 7] and longest == 7


def test_packed_batch_from_padding_mask():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    pb = build_packed_batch(3, 5, None, mask)
    assert pb.indices.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert pb.cu_seqlens.tolist() == [0, 3, 7, 12] and pb.max_seqlen == 5
    # positions restarting inside a padded row split it into documents too
    pos = torch.tensor([[0, 1, 0, 0, 0], [0, 0, 1, 0, 1], [0, 1, 2, 3, 4]])
    pb = build_packed_batch(3, 5, pos, mask)
    assert pb.cu_seqlens.tolist() == [0, 2, 3, 5, 7, 12]
    x = torch.randn(3, 5, 2)
    back = pb.pad(pb.unpad(x))
    assert torch.equal(back * mask[..., None], x * mask[..., None])
    # all-ones masks take the no-padding path
    assert build_packed_batch(3, 5, None, torch.ones(3, 5)).indices is None


# ----------------------------------------------------------------------------- backends on CPU


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 0.7), (6, 0.7)])
def test_reference_matches_each_document_alone(window, softcap):
    lengths = [5, 11, 3, 14, 7]
    q, k, v = _qkv(sum(lengths))
    pb = build_packed_batch(1, sum(lengths), _positions(lengths))
    out = packed_attention(q, k, v, pb, scale=0.3, window=window, softcap=softcap, backend="reference")
    assert rel_err(out, _alone(q, k, v, lengths, 0.3, window, softcap)) < 1e-12


@pytest.mark.parametrize("window,softcap", [(None, None), (6, 0.7)])
def test_flex_matches_reference_forward(window, softcap):
    """Flex's document/window block mask and soft-cap score_mod, run eagerly (forward only on CPU)."""
    lengths = [9, 4, 17, 6]
    pb = build_packed_batch(1, sum(lengths), _positions(lengths))
    q, k, v = _qkv(sum(lengths), dtype=torch.float32)
    want = packed_attention(q, k, v, pb, scale=0.25, window=window, softcap=softcap, backend="reference")
    got = packed_attention(q, k, v, pb, scale=0.25, window=window, softcap=softcap, backend="flex")
    assert rel_err(got, want) < 1e-5


def test_sdpa_per_document_matches_each_document_alone_with_gradients():
    """The ``sdpa`` backend (one dense causal call per document, GQA in the call) against the float64
    oracle, outputs and q/k/v gradients, on fresh random inputs; a single document too."""
    for lengths in ([5, 11, 3, 14, 7], [23]):
        total = sum(lengths)
        pb = build_packed_batch(1, total, _positions(lengths))
        q, k, v = _qkv(total, grad=True)
        out = packed_attention(q, k, v, pb, scale=0.3, backend="sdpa")
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), dout)
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        want = _alone(qq, kk, vv, lengths, 0.3)
        ref = torch.autograd.grad(want, (qq, kk, vv), dout)
        assert rel_err(out, want) < 1e-12
        for g, r in zip(got, ref):
            assert rel_err(g, r) < 1e-10


def test_sdpa_backward_builds_no_row_sized_gradient_per_document():
    """Per-document sdpa takes q/k/v apart with ``row_pieces``: its backward gathers each tensor's document
    gradients once, where a plain slice per document would fill a zero gradient of the whole row for each
    (``O(documents x T)`` memory traffic per layer); the gradients are those of the float64 oracle."""
    from tests.test_grpo import autograd_nodes

    lengths = [5, 11, 3, 14, 7]
    total = sum(lengths)
    pb = build_packed_batch(1, total, _positions(lengths))
    q, k, v = _qkv(total, grad=True)
    out = packed_attention(q, k, v, pb, scale=0.3, backend="sdpa")
    nodes = autograd_nodes(out)
    gathers = [node for node in nodes if type(node).__name__.startswith("_RowPiecesBackward")]
    row_slices = [node for node in nodes if type(node).__name__ == "SliceBackward0"
                  and tuple(node._saved_self_sym_sizes)[:1] == (total,)]
    assert len(gathers) == 3 and not row_slices, (gathers, row_slices)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = torch.autograd.grad(_alone(qq, kk, vv, lengths, 0.3), (qq, kk, vv), dout)
    for g, r in zip(got, ref):
        assert g.abs().sum() > 0 and rel_err(g, r) < 1e-10


def test_sdpa_retries_with_expanded_heads_when_the_gqa_call_fails(monkeypatch):
    """A torch whose fused kernels refuse grouped K/V (or a shape cuDNN refuses): the call is made
    again with K/V repeated to the query heads, same result; an out-of-memory is not retried."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention
    calls = []

    def picky(q, k, v, *args, enable_gqa=False, **kw):
        calls.append(enable_gqa)
        if enable_gqa:
            raise RuntimeError("No available kernel. Aborting execution.")
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", picky)
    lengths = [9, 13]
    pb = build_packed_batch(1, sum(lengths), _positions(lengths))
    q, k, v = _qkv(sum(lengths), grad=True)
    out = packed_attention(q, k, v, pb, scale=0.3, backend="sdpa")
    assert calls == [True, False, True, False]
    assert rel_err(out, _alone(q, k, v, lengths, 0.3)) < 1e-12

    def oom(*args, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(F, "scaled_dot_product_attention", oom)
    with pytest.raises(torch.OutOfMemoryError):
        packed_attention(q, k, v, pb, scale=0.3, backend="sdpa")


def test_sdpa_backend_refuses_window_and_softcap_and_auto_prefers_it_for_long_documents():
    from swiftune.attention.backends import SDPA_MIN_MEAN_DOC_TOKENS, prefers_sdpa

    q, k, _ = _qkv(4, dtype=torch.float32)
    for window, softcap in ((8, None), (None, 30.0)):
        with pytest.raises(ValueError, match="sdpa"):
            resolve_backend("sdpa", q, k, window, softcap, 0.0)
    n = SDPA_MIN_MEAN_DOC_TOKENS
    assert prefers_sdpa(2 * n, 2) and prefers_sdpa(65_792 * 2, 2)
    assert not prefers_sdpa(2 * n - 1, 2) and not prefers_sdpa(16_384, 90) and not prefers_sdpa(0, 0)
    # CPU: auto stays on the reference path whatever the layout
    long_doc = build_packed_batch(1, 2 * n, None)
    assert resolve_backend("auto", q, k, None, None, 0.0, long_doc) == "reference"


def test_negative_control_without_boundaries_differs():
    """The oracle comparison can fail: one document instead of five gives other outputs."""
    lengths = [5, 11, 3, 14, 7]
    q, k, v = _qkv(sum(lengths))
    merged = build_packed_batch(1, sum(lengths), torch.arange(sum(lengths))[None])
    out = packed_attention(q, k, v, merged, scale=0.3, backend="reference")
    assert rel_err(out, _alone(q, k, v, lengths, 0.3)) > 1e-2


def test_backend_resolution_on_cpu():
    q, k, _ = _qkv(4, dtype=torch.float32)
    assert resolve_backend("auto", q, k, None, None, 0.0) == "reference"
    assert backend_available("flex", "cpu") and not backend_available("varlen", "cpu")
    with pytest.raises(ValueError, match="varlen"):
        resolve_backend("varlen", q, k, None, None, 0.0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend_available("nope", "cpu")


# ----------------------------------------------------------------------------- transformers function


class _Layer(torch.nn.Module):
    is_causal = True


def test_hf_function_padded_batch_equals_packed_row():
    """[B, H, S, D] with a 2-D mask (left and right padding) equals the same rows packed."""
    lengths, seq = [6, 9, 4], 9
    q, k, v = _qkv(sum(lengths), dtype=torch.float32)
    pb = build_packed_batch(1, sum(lengths), _positions(lengths))
    want = packed_attention(q, k, v, pb, scale=0.25, backend="reference")

    mask = torch.zeros(3, seq, dtype=torch.long)
    mask[0, :6] = 1  # right padding
    mask[1, :] = 1
    mask[2, seq - 4 :] = 1  # left padding
    padded = [torch.zeros(3, seq, t.shape[1], t.shape[2]) for t in (q, k, v)]
    starts = [0, 6, 15]
    for row, (n, s0) in enumerate(zip(lengths, starts)):
        cols = mask[row].nonzero().squeeze(1)
        for dst, src in zip(padded, (q, k, v)):
            dst[row, cols] = src[s0 : s0 + n]
    bhsd = [t.transpose(1, 2) for t in padded]
    out, weights = packed_attention_forward(_Layer(), *bhsd, mask.bool(), scaling=0.25)
    assert weights is None and out.shape == (3, seq, 4, 16)
    got = torch.cat([out[row, mask[row].bool()] for row in range(3)])
    assert rel_err(got, want) < 1e-6
    assert out[0, 6:].abs().max() == 0  # padding rows are zeros, never NaN


def test_hf_function_decode_step_matches_full_forward():
    """One query against a longer (cached) key axis: the dense fallback equals the last row."""
    total = 12
    q, k, v = _qkv(total, dtype=torch.float32)
    full, _ = packed_attention_forward(_Layer(), *(t.transpose(0, 1)[None] for t in (q, k, v)), None, scaling=0.25)
    last, _ = packed_attention_forward(
        _Layer(), q[-1:].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, scaling=0.25
    )
    assert rel_err(last[0, 0], full[0, -1]) < 1e-6


def test_packed_layout_names_the_kernel_offloaded_checkpointing_plans_for():
    from swiftune.attention.backends import SDPA_MIN_MEAN_DOC_TOKENS, layout_attention_kernel

    n = SDPA_MIN_MEAN_DOC_TOKENS
    assert layout_attention_kernel("auto", True, 2 * n, 2) == "sdpa"  # long documents on CUDA
    assert layout_attention_kernel("auto", True, 2 * n - 1, 2) is None  # varlen / flash
    assert layout_attention_kernel("auto", False, 2 * n, 2) is None  # CPU: the reference path
    assert layout_attention_kernel("auto", True, 0, 0) is None
    assert layout_attention_kernel("sdpa", False, 10, 5) == "sdpa"
    assert layout_attention_kernel("flex", True, 10, 5) == "flex"
    assert layout_attention_kernel("varlen", True, 2 * n, 1) is None
    assert build_packed_batch(1, 3 * n, _positions([2 * n, n])).attention_kernel is None  # CPU, auto
    assert build_packed_batch(1, 9, _positions([5, 4]), backend="sdpa").attention_kernel == "sdpa"


def test_registered_with_transformers():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert register_packed_attention() == ATTENTION_NAME
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is packed_attention_forward
    mask_fn = AttentionMaskInterface._global_mapping[ATTENTION_NAME]
    mask = torch.ones(2, 10, dtype=torch.bool)
    # the 2-D mask comes back as it is (sliced to the keys), never as a [B, 1, S, S] tensor
    assert torch.equal(mask_fn(batch_size=2, q_length=10, kv_length=10, attention_mask=mask), mask)
    assert mask_fn(batch_size=2, q_length=1, kv_length=4, attention_mask=mask).shape == (2, 4)
    assert mask_fn(batch_size=2, q_length=10, kv_length=10, attention_mask=None) is None
    assert PACKED_KWARG == "swiftune_packed"


# ----------------------------------------------------------------------------- GPU


def _random_lengths(total: int, docs: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: docs - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("window,softcap", [(None, None), (512, None), (None, 30.0)])
def test_gpu_backend_matches_reference(backend, window, softcap):
    lengths = _random_lengths(4096, 7, seed=1)
    pb = build_packed_batch(1, 4096, _positions(lengths, "cuda"), backend=backend)
    q, k, v = _qkv(4096, hq=8, hk=2, d=64, dtype=torch.bfloat16, device="cuda")
    from swiftune.attention.backends import unsupported_reason

    reason = unsupported_reason(backend, q, k, window, softcap, 0.0)
    if reason:
        pytest.skip(reason)
    results = {}
    for name in (backend, "reference"):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        if name == "reference":  # the oracle in float64
            qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        out = packed_attention(qq, kk, vv, pb, scale=0.125, window=window, softcap=softcap, backend=name)
        out.float().square().mean().backward()
        results[name] = (out, qq.grad, kk.grad, vv.grad)
    for got, want in zip(results[backend], results["reference"]):
        assert rel_err(got, want) < 1e-2


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["varlen", "flex", "sdpa"])
def test_gpu_128k_packed_row_is_linear_memory(backend):
    total = 128 * 1024
    q, k, v = _qkv(total, hq=16, hk=4, d=128, dtype=torch.bfloat16, device="cuda", grad=True)
    if not backend_available(backend, "cuda"):
        pytest.skip(f"{backend} not available")
    pb = build_packed_batch(1, total, _positions(_random_lengths(total, 8, seed=2), "cuda"), backend=backend)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = packed_attention(q, k, v, pb, window=4096 if backend == "flex" else None, backend=backend)
    out.float().sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # O(T): output, its fp32 copy and the q/k/v gradients take ~9x q's bytes (4.5 GiB); a T x T
    # boolean mask alone would be 16 GiB, bf16 scores 32 GiB per head.
    assert extra < 16 * q.numel() * q.element_size(), f"{backend}: {extra / 2**30:.2f} GiB over the inputs"
    assert torch.isfinite(out).all()


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_gpu_128k_packed_row_matches_documents_alone(backend):
    """The equivalence at 128K total tokens: each document of the packed row (bf16, the backend)
    against that document alone through PyTorch's float32 SDPA (memory-efficient, causal)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not backend_available(backend, "cuda"):
        pytest.skip(f"{backend} not available")
    total, hq, hk, d = 128 * 1024, 8, 2, 64
    lengths = _random_lengths(total, 8, seed=3)
    pb = build_packed_batch(1, total, _positions(lengths, "cuda"), backend=backend)
    q, k, v = _qkv(total, hq=hq, hk=hk, d=d, dtype=torch.bfloat16, device="cuda", grad=True)
    out = packed_attention(q, k, v, pb, scale=d**-0.5, backend=backend)
    dout = torch.randn_like(out)
    out.backward(dout)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        # [n, H, d] token-major slices -> [1, H, n, d] for SDPA; the memory-efficient kernel only
        # (float32 on the math fallback would hold H x n x n scores: 34 GB for a 34K-token document)
        qq, kk, vv = (t.detach()[sl].transpose(0, 1).float().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            ref = F.scaled_dot_product_attention(
                qq[None], kk.repeat_interleave(hq // hk, 0)[None], vv.repeat_interleave(hq // hk, 0)[None],
                is_causal=True, scale=d**-0.5,
            )[0]
            ref.backward(dout[sl].transpose(0, 1).float())
        for got, want in ((out[sl], ref.transpose(0, 1)), (q.grad[sl], qq.grad.transpose(0, 1)),
                          (k.grad[sl], kk.grad.transpose(0, 1)), (v.grad[sl], vv.grad.transpose(0, 1))):
            assert rel_err(got, want) < 1e-2, (backend, n)
        start += n


@cuda
@pytest.mark.gpu
def test_gpu_sdpa_saves_kv_unexpanded_as_the_planner_plans_it():
    """What per-document sdpa saves for its backward, per token, measured with saved-tensor hooks
    on a row of 8K-token documents, against the planner's attention term for the kernel the
    layout names (``PackedBatch.attention_kernel`` = what ``auto`` runs): q, K/V with their own
    heads, the output and a float32 log-sum-exp (K/V expanded would be 2 (Hq - Hk) D b more)."""
    from swiftune.attention.backends import planner_attention_terms

    total, hq, hk, d = 65_536, 32, 8, 128
    q, k, v = _qkv(total, hq=hq, hk=hk, d=d, dtype=torch.bfloat16, device="cuda", grad=True)
    pb = build_packed_batch(1, total, _positions([8192] * 8, "cuda"))
    assert pb.attention_kernel == "sdpa" == resolve_backend("auto", q, k, None, None, 0.0, pb)
    assert planner_attention_terms(pb.attention_kernel)["kv_expanded"] is False
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        packed_attention(q, k, v, pb)
    seen: dict[int, torch.Tensor] = {}
    for t in saved:  # each storage once (q/k/v slices of one tensor share it)
        seen.setdefault(t.untyped_storage().data_ptr(), t)
    per_token = sum(t.untyped_storage().nbytes() for t in seen.values()) / total
    dq, dkv, b = hq * d, hk * d, 2
    planned = (dq + 2 * dkv) * b + dq * b + hq * 4  # the planner's attention term, K/V unexpanded
    assert 0.9 * planned <= per_token <= planned * 1.02, (per_token, planned)


@cuda
@pytest.mark.gpu
def test_gpu_sdpa_one_400k_sequence_equals_varlen_and_auto_picks_sdpa():
    """One 409,600-token document (the long-context target) through the per-document sdpa path and
    through torch's varlen kernel: same outputs and gradients in bf16, O(T) memory; ``auto`` picks
    sdpa for it and keeps varlen for a row of short documents."""
    from swiftune.attention.backends import BACKEND_FUNCTIONS

    total, hq, hk, d = 409_600, 8, 2, 128
    q, k, v = _qkv(total, hq=hq, hk=hk, d=d, dtype=torch.bfloat16, device="cuda", grad=True)
    pb = build_packed_batch(1, total, _positions([total], "cuda"))
    short = build_packed_batch(1, 8192, _positions(_random_lengths(8192, 16, seed=4), "cuda"))
    assert resolve_backend("auto", q, k, None, None, 0.0, pb) == "sdpa"
    assert resolve_backend("auto", q[:8192], k[:8192], None, None, 0.0, short) != "sdpa"
    if not backend_available("varlen", "cuda"):
        pytest.skip("varlen not available for the comparison")
    dout = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name in ("sdpa", "varlen"):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = BACKEND_FUNCTIONS[name](qq, kk, vv, pb, scale=d**-0.5)
        out.backward(dout)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra < 16 * q.numel() * q.element_size(), f"{name}: {extra / 2**30:.2f} GiB over the inputs"
        results[name] = (out.detach(), qq.grad, kk.grad, vv.grad)
    for got, want in zip(results["sdpa"], results["varlen"]):
        assert rel_err(got, want) < 1e-2


@cuda
@pytest.mark.gpu
def test_gpu_flex_stays_compiled_across_changing_lengths():
    """Padding-free batches change length every step. Were flex recompiled per length, it would
    hit dynamo's recompile limit and fall back to eager flex, which materialises T x T scores:
    after ten lengths, a 48K-token step must still cost O(T) memory."""
    for step, total in enumerate([3000, 3500, 4100, 2900, 5000, 3300, 4500, 3900, 2700, 3100, 48 * 1024]):
        pb = build_packed_batch(1, total, _positions(_random_lengths(total, 5, seed=step), "cuda"), backend="flex")
        q, k, v = _qkv(total, hq=8, hk=2, d=64, dtype=torch.bfloat16, device="cuda", grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        softcap = 30.0 if step % 2 else None  # soft-capping on dynamic shapes too
        packed_attention(q, k, v, pb, window=256, softcap=softcap).float().sum().backward()
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 2 * 2**30, f"{extra / 2**30:.1f} GiB at 48K tokens: flex fell back to eager?"
