"""Decode attention split along the cache (swiftune.kernels.decode_attention) against attention computed in
float64 from its definition, and against the engine's SDPA path (attention.kv_cache.cached_attention with the
engine's slot mask). On the CPU the kernels run through the Triton interpreter (tests/conftest.py); on CUDA
they are compiled."""

from __future__ import annotations

import importlib

import pytest
import torch

from swiftune.attention.kv_cache import additive_mask, cached_attention, slot_mask
from swiftune.kernels.decode_attention import split_decode_attention
from tests.helpers import count_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _float64_attention(q, k, v, cur, window, scale, sinks=None):
    """Row by row over the visible slots only; a sink is one more softmax column with no value."""
    j = torch.arange(k.shape[2], device=k.device)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        keep = j <= cur[b]
        if window:
            keep &= cur[b] - j < window
        scores = q[b].double() @ k[b][:, keep].double().transpose(-1, -2) * scale  # [Hk, g, n]
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().reshape(*scores.shape[:2], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        out[b] = (probs[..., :-1] if sinks is not None else probs) @ v[b][:, keep].double()
    return out


def _case(rows, kv_heads, group, dim, kv_len, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kv_heads, group, dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(rows, kv_heads, kv_len, dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(rows, kv_heads, kv_len, dim, generator=g).to(dtype).to(DEVICE)
    # rows at different lengths: one sees a single slot, one the whole cache, others in between
    cur = torch.tensor([0, kv_len - 1] + [int(x) for x in torch.randint(1, kv_len, (rows - 2,), generator=g)],
                       device=DEVICE)
    return q, k, v, cur


@pytest.mark.parametrize("rows,kv_heads,group,dim,kv_len,window,splits,sinks", [
    (4, 2, 4, 32, 300, None, None, False),  # chunks of several tiles, a ragged last tile
    (3, 1, 8, 64, 130, 48, 3, False),       # a sliding window: early slots hidden; whole chunks hidden for row 0
    (5, 2, 2, 16, 64, None, 1, False),      # one chunk
    (2, 4, 1, 32, 257, 100, 7, False),      # g = 1 (multi-head), more chunks than needed for short rows
    (4, 2, 4, 32, 300, None, 5, True),      # gpt-oss's attention sinks
    (3, 2, 8, 64, 130, 16, 3, True),        # sinks with a window (gpt-oss's sliding layers)
    (4, 2, 4, 32, 300, None, 1, True),      # one chunk with sinks: the split kernel writes the output itself
    (3, 2, 8, 64, 130, 16, 1, True),        # and with a window
])
def test_split_decode_attention_equals_float64_attention(rows, kv_heads, group, dim, kv_len, window, splits, sinks):
    q, k, v, cur = _case(rows, kv_heads, group, dim, kv_len, torch.float32, seed=kv_len)
    sink = (torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(9)) * 2).to(DEVICE) if sinks \
        else None
    got = split_decode_attention(q, k, v, cur, window, dim ** -0.5, sink, splits=splits, backend="triton")
    want = _float64_attention(q, k, v, cur, window, dim ** -0.5, sink)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("window,sinks", [(None, False), (70, False), (70, True)])
def test_split_decode_attention_never_reads_hidden_slots(window, sinks):
    """The cache past each row's last slot (a decode step's bucketed length runs up to a bucket beyond it) and,
    with a window, before the window holds NaN here: the kernel does not read those tiles, and hidden slots of a
    tile it reads load as zeros, so the output is finite and equals attention over the visible slots alone."""
    rows, kv_heads, group, dim, kv_len = 4, 2, 4, 32, 400
    q, k, v, cur = _case(rows, kv_heads, group, dim, kv_len, torch.float32, seed=3)
    j = torch.arange(kv_len, device=DEVICE)
    hidden = j[None, :] > cur[:, None]
    if window:
        hidden |= cur[:, None] - j[None, :] >= window
    assert hidden.sum(dim=1).ge(64).sum() >= rows - 1  # whole tiles hidden in every row but the one at the end
    k[hidden[:, None, :, None].expand_as(k)] = float("nan")
    v[hidden[:, None, :, None].expand_as(v)] = float("nan")
    sink = (torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(5)) * 2).to(DEVICE) if sinks \
        else None
    got = split_decode_attention(q, k, v, cur, window, dim ** -0.5, sink, splits=4, backend="triton")
    want = _float64_attention(q, k, v, cur, window, dim ** -0.5, sink)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("window", [None, 40])
def test_split_decode_attention_matches_the_engines_sdpa_path(window):
    """The engine's own decode attention (SDPA with its additive slot mask) gives the same, bf16 rounding aside."""
    rows, kv_heads, group, dim, kv_len = 6, 2, 4, 64, 200
    q, k, v, cur = _case(rows, kv_heads, group, dim, kv_len, torch.bfloat16, seed=1)
    bias = additive_mask(slot_mask(cur, kv_len, window), torch.bfloat16)
    sdpa = cached_attention(q.reshape(rows, kv_heads * group, 1, dim), k, v, bias, dim ** -0.5)
    got = split_decode_attention(q, k, v, cur, window, dim ** -0.5, backend="triton")
    want = _float64_attention(q, k, v, cur, window, dim ** -0.5)
    assert (got.double() - want).abs().max() < 2e-2
    assert (got.reshape(rows, 1, kv_heads * group, dim).double() - sdpa.double()).abs().max() < 3e-2


@pytest.mark.parametrize("rows,splits,chunks", [(64, None, 1), (2, None, 3), (64, 1, 1), (2, 3, 3)])
def test_one_chunk_is_written_without_the_merge_launch(rows, splits, chunks, monkeypatch):
    """Where one chunk covers a row (the default at G=64: rows x K/V heads fill two waves alone), the split
    kernel normalises and writes the output itself and the merge kernel is not launched; with several chunks
    the merge runs. Both equal the float64 attention."""
    module = importlib.import_module("swiftune.kernels.decode_attention")
    merges = count_launches(monkeypatch, module, "_merge_kernel")
    monkeypatch.setattr(module, "_splits", lambda programs, kv_len, device, block_n=64:
                        max(1, min(_cdiv(kv_len, block_n), _cdiv(16, programs))))
    q, k, v, cur = _case(rows, 2, 4, 32, 300, torch.float32, seed=rows)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = split_decode_attention(q, k, v, cur, None, 32 ** -0.5, sink, splits=splits, backend="triton")
    torch.testing.assert_close(got.double(), _float64_attention(q, k, v, cur, None, 32 ** -0.5, sink),
                               rtol=1e-5, atol=1e-5)
    assert len(merges) == (0 if chunks == 1 else 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_split_decode_attention_refuses_mismatched_shapes():
    q, k, v, cur = _case(3, 2, 2, 16, 20, torch.float32)
    with pytest.raises(ValueError, match=r"\[B, Hk, L, D\]"):
        split_decode_attention(q, k[:, :1], v[:, :1], cur, None, 0.25)
    with pytest.raises(ValueError, match="power of two"):
        split_decode_attention(q[..., :12], k[..., :12], v[..., :12], cur, None, 0.25)
    with pytest.raises(ValueError, match="one logit per query head"):
        split_decode_attention(q, k, v, cur, None, 0.25, torch.zeros(3))


@pytest.mark.parametrize("family,window", [("qwen3", False), ("qwen3", True), ("llama", False)])
def test_engine_with_split_decode_attention_equals_generate_of_the_unpatched_model(family, window, monkeypatch):
    """``FastRolloutEngine(decode_attention="split")``: greedy tokens (fp32) equal transformers' generate on the
    unpatched model, rows of different prompt lengths in one step (and a sliding window)."""
    import copy

    from swiftune.models import patch_model
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
    from tests.helpers import tiny_model

    import swiftune.rl.rollout.kv_cache as engine_cache

    calls = []
    monkeypatch.setattr(engine_cache, "split_decode_attention",
                        lambda *a, **k: calls.append(a) or split_decode_attention(*a, **k))
    reference = tiny_model(family, window=window).to(DEVICE)
    model = patch_model(copy.deepcopy(reference))
    prompts = [[5, 9, 17, 33, 2, 61], [7, 8, 100, 12, 4, 40, 41, 42, 43, 44, 45, 46], [3, 250]]
    steps = 20
    engine = FastRolloutEngine(model, use_cuda_graph=torch.cuda.is_available(), decode_attention="split")
    out = engine.generate(prompts, 1, SamplingParams(max_tokens=steps, temperature=0.0))
    for prompt, got in zip(prompts, out.completion_ids):
        ids = torch.tensor([prompt], device=DEVICE)
        want = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0)[0, len(prompt):]
        assert list(got) == want.tolist()
    assert calls  # the decode steps took the split kernel
    with pytest.raises(ValueError, match="decode_attention"):
        FastRolloutEngine(model, decode_attention="flash")


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_engine_with_split_decode_attention_equals_generate_on_moe_families(family, monkeypatch):
    """gpt-oss (attention sinks, sliding and full layers) and Qwen3-MoE on the engine with the split attention:
    greedy tokens (fp32) equal transformers' generate on the unpatched model."""
    import swiftune.rl.rollout.kv_cache as engine_cache
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
    from tests.test_moe_rollout import PAD, PROMPTS, _hf_greedy, _models

    calls = []
    monkeypatch.setattr(engine_cache, "split_decode_attention",
                        lambda *a, **k: calls.append(a) or split_decode_attention(*a, **k))
    reference, policy = _models(family, None, seed=5)
    engine = FastRolloutEngine(policy.to(DEVICE), pad_token_id=PAD, kv_bucket=4, decode_attention="split",
                               use_cuda_graph=torch.cuda.is_available())
    out = engine.generate(PROMPTS, 1, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=()))
    for prompt, got in zip(PROMPTS, out.completion_ids):
        assert got == _hf_greedy(reference.to(DEVICE), prompt, 12)
    assert calls and (family != "gpt_oss" or any(len(a) > 6 and a[6] is not None for a in calls))  # sinks passed


def test_auto_decode_attention_takes_the_split_kernel_only_where_it_was_timed(monkeypatch):
    """``decode_attention="auto"`` (the engine's default): the split kernel on CUDA for power-of-two head
    dimensions of 16 to 128; SDPA on the CPU, for other head dimensions (Gemma 3's 256, 80, 96) and where
    ``"sdpa"`` is asked for; ``"split"`` always."""
    from types import SimpleNamespace

    import swiftune.rl.rollout.kv_cache as engine_cache
    from swiftune.rl.rollout import FastRolloutEngine
    from swiftune.rl.rollout.kv_cache import DecodeContext, DecodeOptions
    from tests.helpers import tiny_model

    monkeypatch.setattr(engine_cache, "HAS_TRITON", True)
    on_cuda = {dim: SimpleNamespace(shape=(8, 32, 1, dim), is_cuda=True) for dim in (8, 16, 64, 80, 96, 128, 256)}
    auto = DecodeContext(None, "auto")
    assert [d for d, q in on_cuda.items() if auto.split_attention_applies(q)] == [16, 64, 128]
    assert not auto.split_attention_applies(SimpleNamespace(shape=(8, 32, 1, 128), is_cuda=False))
    sdpa, split = (DecodeContext(None, "auto", options=DecodeOptions(decode_attention=name))
                   for name in ("sdpa", "split"))
    assert not sdpa.split_attention_applies(on_cuda[128])
    assert split.split_attention_applies(on_cuda[80])
    monkeypatch.setattr(engine_cache, "HAS_TRITON", False)
    assert not auto.split_attention_applies(on_cuda[128])
    engine = FastRolloutEngine(tiny_model("qwen3"))
    assert engine.decode_attention == "auto" and engine.moe_route_kernels and engine.moe_fused_routing
    assert engine.fp8_stacked_qkv  # q/k/v as one FP8 product where laid out so (fp8-stacked-ab: faster at G 8, 64)
    assert engine.fp8_stacked_gate_up  # and gate/up (fp8-stacked-gate-up-ab: faster at G 8, 64)
