"""Flex attention past its int32 offsets: a q of 2^31 elements or more runs in groups of K/V heads
(swiftune.attention.backends.flex_head_groups / flex_in_head_groups).

torch's flex kernels address q/k/v/out with int32 offsets: gpt-oss (64 query heads of 64) crashed with a CUDA
illegal memory access in the backward at 2 x 272,384 tokens, where 2 x 259,328 (2.12e9 q elements) ran. The
split is checked here against the unsplit attention of each backend's own reference (each document alone):
the grouping itself on real sizes, the outputs on CPU with the limit lowered so that small inputs split, and
on CUDA the compiled kernels' outputs and every gradient (q, k, v, the sinks)."""

from __future__ import annotations

import importlib

import pytest
import torch

from swiftune.attention import build_packed_batch, packed_attention
from swiftune.attention.backends import flex_head_groups, flex_in_head_groups
from swiftune.attention.sinks import sink_attention
from tests.helpers import rel_err

backends = importlib.import_module("swiftune.attention.backends")


@pytest.mark.parametrize("tokens,groups", [
    (2 * (259_072 + 256), [(0, 8)]),           # the 80 GB row that ran: q 2.12e9 elements, one call
    (2 * (272_128 + 256), [(0, 7), (7, 8)]),   # the row that crashed: 2.23e9, so 7 K/V heads, then 1
    (1_048_576, [(0, 3), (3, 6), (6, 8)]),     # 2^29 elements a K/V head: three a call
])
def test_gpt_oss_head_groups_keep_each_call_under_the_int32_limit(tokens, groups):
    got = flex_head_groups(tokens, 64, 8, 64)
    assert got == groups
    for h0, h1 in got:
        assert tokens * (h1 - h0) * 8 * 64 <= 2**31 - 1
    assert [h for h0, h1 in got for h in range(h0, h1)] == list(range(8))


def test_more_tokens_than_one_head_can_index_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match="fewer tokens a step"):
        flex_head_groups(2**31 // (8 * 64) + 1, 64, 8, 64)


def _packed(lengths, hq, hk, d, device, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
               for h in (hq, hk, hk))
    sinks = torch.randn(hq, generator=g).mul(2).to(device).requires_grad_()
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    return q, k, v, sinks, build_packed_batch(1, total, positions, None, device=torch.device(device))


def _lower_the_limit(monkeypatch, tokens, group, dim, heads_per_call):
    """The limit made small enough that ``heads_per_call`` K/V heads' queries are the most one call takes."""
    monkeypatch.setattr(backends, "FLEX_MAX_ELEMENTS", tokens * group * dim * heads_per_call + 1)


def test_split_calls_join_into_the_unsplit_result_with_every_gradient(monkeypatch):
    """The grouping's own arithmetic (the split, contiguous copies, the join, each group's sinks), with
    transformers' own gpt-oss eager attention (causal, sinks) standing in for flex, which has no CPU backward.
    Split in three (K/V heads of 2, 2, 1) against one unsplit call of that same function: the output and the
    gradients of q, k, v and the sinks, each non-zero."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    tokens, kv_heads, group, dim = 6, 5, 3, 4
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(tokens, kv_heads * group, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(kv_heads * group, generator=gen, dtype=torch.float64).mul(2).requires_grad_()
    causal = torch.zeros(tokens, tokens, dtype=torch.float64).masked_fill(
        torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))[None, None]
    seen = []

    def attend(q, k, v, first_head):
        seen.append((first_head, q.shape[1], k.shape[1], q.is_contiguous()))
        module = torch.nn.Module()
        module.num_key_value_groups, module.training = group, False
        module.sinks = sinks[first_head:first_head + q.shape[1]]  # this call's query heads' sinks
        out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], causal, scaling=dim ** -0.5)
        return out[0]  # [T, heads, D]

    want = attend(q, k, v, 0)
    cotangent = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * cotangent).sum(), (q, k, v, sinks))
    seen.clear()
    _lower_the_limit(monkeypatch, tokens, group, dim, heads_per_call=2)
    got = flex_in_head_groups(attend, q, k, v)
    assert seen == [(0, 6, 2, True), (6, 6, 2, True), (12, 3, 1, True)]
    got_grads = torch.autograd.grad((got * cotangent).sum(), (q, k, v, sinks))
    assert rel_err(got, want) < 1e-12
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < 1e-12 and w.abs().max() > 0


@pytest.mark.parametrize("window", [None, 4])
def test_split_flex_sink_attention_equals_the_reference_forward(window, monkeypatch):
    """The sink logits follow their query heads into each group (a wrong offset gives another attention)."""
    lengths = [7, 3, 9]
    q, k, v, sinks, packed = _packed(lengths, 8, 4, 8, "cpu")
    with torch.no_grad():
        want = sink_attention(q, k, v, packed, scale=0.3, sinks=sinks, window=window, backend="reference")
        _lower_the_limit(monkeypatch, sum(lengths), 2, 8, heads_per_call=1)
        assert len(flex_head_groups(sum(lengths), 8, 4, 8)) == 4
        got = sink_attention(q, k, v, packed, scale=0.3, sinks=sinks, window=window, backend="flex")
        assert rel_err(got, want) < 1e-5
        shifted = sink_attention(q, k, v, packed, scale=0.3, sinks=sinks.roll(2), window=window, backend="flex")
        assert rel_err(shifted, want) > 1e-3


@pytest.mark.parametrize("window,softcap", [(None, None), (6, 0.7)])
def test_split_flex_packed_attention_equals_the_reference_forward(window, softcap, monkeypatch):
    lengths = [9, 4, 17, 6]
    q, k, v, _, packed = _packed(lengths, 6, 2, 16, "cpu", seed=1)
    with torch.no_grad():
        want = packed_attention(q, k, v, packed, scale=0.25, window=window, softcap=softcap, backend="reference")
        _lower_the_limit(monkeypatch, sum(lengths), 3, 16, heads_per_call=1)
        got = packed_attention(q, k, v, packed, scale=0.25, window=window, softcap=softcap, backend="flex")
        assert rel_err(got, want) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's backward is compiled for CUDA only")
@pytest.mark.parametrize("window", [None, 16])
def test_split_flex_sink_attention_gradients_equal_the_reference_on_cuda(window, monkeypatch):
    """Compiled flex, split into K/V head groups, against the reference (each document alone, eager): the
    output and the gradients of q, k, v and the sinks, each non-zero."""
    lengths = [130, 70, 200]
    q, k, v, sinks, packed = _packed(lengths, 16, 4, 64, "cuda", seed=2)
    want = sink_attention(q, k, v, packed, scale=0.125, sinks=sinks, window=window, backend="reference")
    cotangent = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * cotangent).sum(), (q, k, v, sinks))
    _lower_the_limit(monkeypatch, sum(lengths), 4, 64, heads_per_call=1)
    got = sink_attention(q, k, v, packed, scale=0.125, sinks=sinks, window=window, backend="flex")
    got_grads = torch.autograd.grad((got * cotangent).sum(), (q, k, v, sinks))
    assert rel_err(got, want) < 1e-4
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < 1e-3 and w.abs().max() > 0
