"""The rollout engine's FP8 KV cache (``FastRolloutEngine(kv_cache_dtype="fp8")``): e4m3 codes with a float32 scale
per slot and head.

The kernels that write it (``decode_qkv``) and read it (the split decode attention) against plain PyTorch formulas
(RMSNorm, RoPE and per-row e4m3 quantisation written out; attention in float64 over the dequantised cache), and the
engine against transformers' own unpatched model: the cache holds transformers' K/V to e4m3's rounding, and the
log-probabilities the engine reports for its tokens are the model's to within what that rounding moves them. On the
CPU the kernels run through the Triton interpreter (tests/conftest.py); on CUDA they are compiled."""

from __future__ import annotations

import copy

import pytest
import torch

from swiftune.kernels.decode_attention import dequantize_cache, split_decode_attention
from swiftune.kernels.decode_qkv import decode_qkv
from swiftune.kernels.fp8_quant import FP8_E4M3_MAX

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 written out: the row's largest magnitude maps to 448."""
    x = x.float()
    amax = x.abs().amax(-1)
    # an elementwise tensor divisor: CUDA torch divides by a 0-dim (scalar) one as a multiply by its float32
    # reciprocal, an ulp off IEEE division about half the time (the H100 run caught it)
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def _norm_rope(x, w, eps, cos, sin):
    """RMSNorm over each head, then the rotation of its halves (Qwen3's q/k path), in float32, rounded to x's dtype
    after each as transformers rounds them."""
    dtype = x.dtype
    xf = x.float()
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float() * w.float()
    xf = xf.to(dtype).float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None].float() + rotated * sin[:, None].float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_qkv_writes_each_vector_as_its_e4m3_codes_and_scale(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter truncates float32 -> bf16 (the rotated K differs by an ulp): bf16 on CUDA")
    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, length = 3, 8, 2, 64, 20
    q, k, v = (torch.randn(rows, h, dim, generator=g).to(dtype).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    wq, wk = (torch.rand(dim, generator=g).add(0.5).to(dtype).to(DEVICE) for _ in range(2))
    angle = torch.rand(rows, dim // 2, generator=g) * 3
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    slot = torch.tensor([0, 5, length - 1], device=DEVICE)
    k_cache, v_cache = (torch.zeros(rows, kv_heads, length, dim, dtype=torch.float8_e4m3fn, device=DEVICE)
                        for _ in range(2))
    k_scales, v_scales = (torch.zeros(rows, kv_heads, length, device=DEVICE) for _ in range(2))
    got_q = decode_qkv(q, k, v, wq, wk, 1e-6, cos, sin, k_cache, v_cache, slot, k_scales=k_scales,
                       v_scales=v_scales, backend="triton")
    # bf16: the kernel rounds the norm times its weight once (swiftune's RMSNorm), transformers' formula twice; a
    # rotation that cancels leaves that ulp (of the inputs' size, ~2^-7) beside a small result: absolute tolerance
    torch.testing.assert_close(got_q, _norm_rope(q, wq, 1e-6, cos, sin), **(dict(rtol=1e-5, atol=1e-6)
                                                                            if dtype == torch.float32 else
                                                                            dict(rtol=1.6e-2, atol=1.6e-2)))
    rows_ = torch.arange(rows, device=DEVICE)
    want_v, want_vs = _quantise(v)
    assert torch.equal(v_cache[rows_, :, slot].view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(v_scales[rows_, :, slot], want_vs)
    # K: rotated in the kernel's own order of float32 operations (the formula's to an ulp of K's dtype: float32's,
    # or bf16's 2^-7 after its one rounding against the formula's two), then quantised the same way: its scale the
    # formula's to that ulp, its vector the formula's to e4m3's half code step (2^-4 relative) and that ulp
    # (a bf16 rotation that cancels leaves that ulp of the inputs' size beside a small result, as q's check allows)
    ulp = 1e-5 if dtype == torch.float32 else 2 ** -7
    atol = 1e-6 if dtype == torch.float32 else 1.6e-2
    want_k = _norm_rope(k, wk, 1e-6, cos, sin).float()
    torch.testing.assert_close(k_scales[rows_, :, slot], _quantise(want_k)[1], rtol=ulp, atol=0)
    got_k = dequantize_cache(k_cache[rows_, :, slot], k_scales[rows_, :, slot])
    assert ((got_k - want_k).abs() <= torch.maximum(want_k.abs() * (1 / 16 + ulp),
                                                    k_scales[rows_, :, slot, None] / 1024) + atol).all()
    # the unfused reference (torch's ops, what other dtypes fall back to) writes the same V bytes and K to the bound
    ref = [torch.zeros_like(t) for t in (k_cache, v_cache, k_scales, v_scales)]
    decode_qkv(q, k, v, wq, wk, 1e-6, cos, sin, ref[0], ref[1], slot, k_scales=ref[2], v_scales=ref[3],
               backend="reference")
    assert torch.equal(ref[1].view(torch.uint8), v_cache.view(torch.uint8)) and torch.equal(ref[3], v_scales)
    ref_k = dequantize_cache(ref[0][rows_, :, slot], ref[2][rows_, :, slot])
    assert ((ref_k - want_k).abs() <= torch.maximum(want_k.abs() * (1 / 16 + ulp), ref[2][rows_, :, slot, None] / 1024)
            + atol).all()
    untouched = torch.ones(rows, length, dtype=torch.bool, device=DEVICE)
    untouched[rows_, slot] = False
    for cache in (k_cache, v_cache):  # no other slot written
        assert not cache.view(torch.uint8).permute(0, 2, 1, 3)[untouched].any()
    with pytest.raises(ValueError, match="FP8 cache"):
        decode_qkv(q, k, v, wq, wk, 1e-6, cos, sin, k_cache, v_cache, slot, k_scales=k_scales)


@pytest.mark.parametrize("window,sinks", [(None, False), (40, False), (None, True)])
def test_split_attention_over_an_fp8_cache_equals_float64_attention_of_its_vectors(window, sinks):
    """Scores and probabilities scaled by each slot's scale in the kernel == attention over codes x scales."""
    g = torch.Generator().manual_seed(1)
    rows, kv_heads, group, dim, length = 4, 2, 4, 32, 150
    q = torch.randn(rows, kv_heads, group, dim, generator=g).to(DEVICE)
    k_codes, k_scale = _quantise(torch.randn(rows, kv_heads, length, dim, generator=g) * 3)
    v_codes, v_scale = _quantise(torch.randn(rows, kv_heads, length, dim, generator=g))
    k_codes, k_scale, v_codes, v_scale = (t.to(DEVICE) for t in (k_codes, k_scale, v_codes, v_scale))
    cur = torch.tensor([0, 70, 149, 100], device=DEVICE)
    sink = torch.randn(kv_heads * group, generator=g).to(DEVICE) if sinks else None
    got = split_decode_attention(q, k_codes, v_codes, cur, window, dim ** -0.5, sink, key_scales=k_scale,
                                 value_scales=v_scale, splits=3, backend="triton")
    keys = k_codes.double() * k_scale.double()[..., None]
    values = v_codes.double() * v_scale.double()[..., None]
    j = torch.arange(length, device=DEVICE)
    for b in range(rows):
        keep = j <= cur[b]
        if window:
            keep &= cur[b] - j < window
        scores = q[b].double() @ keys[b][:, keep].transpose(-1, -2) * dim ** -0.5
        if sinks:
            scores = torch.cat([scores, sink.double().reshape(kv_heads, group, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :keep.sum()]
        torch.testing.assert_close(got[b].double(), probs @ values[b][:, keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(dequantize_cache(k_codes, k_scale), keys.float())
    with pytest.raises(ValueError, match="both key_scales and value_scales"):
        split_decode_attention(q, k_codes, v_codes, cur, window, dim ** -0.5, key_scales=k_scale)


@pytest.mark.parametrize("decode_attention", ["split", "sdpa"])
def test_engine_with_an_fp8_cache_holds_transformers_kv_and_its_log_probs(decode_attention):
    """Greedy decoding on a tiny Qwen3 (fp32) with ``kv_cache_dtype="fp8"``: every cached K/V vector the engine
    holds at the end is transformers' own (``past_key_values`` of the unpatched model over prompt + completion) to
    e4m3's rounding (half a code step: |error| <= |x| / 16, or 2^-10 of the slot's scale near zero) where nothing
    before it read the rounded cache (the prompt, the first layer); later layers' completion slots within 15% of
    the layer's largest magnitude; and the log-probability the engine reports for each token is the unpatched
    model's to 0.02 (0.004 measured: what the cache's rounding moves them on this model)."""
    from swiftune.models import patch_model
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
    from tests.helpers import tiny_model

    reference = tiny_model("qwen3").to(DEVICE).eval()
    model = patch_model(copy.deepcopy(reference))
    prompts = [[5, 9, 17, 33, 2, 61], [7, 8, 100, 12, 4, 40, 41, 42, 43]]
    steps = 12
    engine = FastRolloutEngine(model, use_cuda_graph=torch.cuda.is_available(), decode_attention=decode_attention,
                               kv_cache_dtype="fp8", keep_cache=True)
    out = engine.generate(prompts, 1, SamplingParams(max_tokens=steps, temperature=0.0))
    ws = engine._ws
    assert ws.k[0].dtype == torch.float8_e4m3fn and ws.k_scale is not None
    worst, drift = 0.0, []
    for row, (prompt, completion, logps) in enumerate(zip(prompts, out.completion_ids, out.logprobs)):
        ids = torch.tensor([prompt + list(completion)], device=DEVICE)
        with torch.no_grad():
            ref = reference(input_ids=ids, use_cache=True)
        want_logps = torch.log_softmax(ref.logits[0, len(prompt) - 1:-1].float(), -1)
        want_logps = want_logps.gather(-1, ids[0, len(prompt):, None])[:, 0]
        diff = (torch.as_tensor(logps, device=DEVICE).float() - want_logps).abs().max().item()
        worst = max(worst, diff)
        # the cache holds every token but the last sampled one (its K/V are written by the step that would follow)
        cached = len(prompt) + len(completion) - 1
        slot = row  # one completion a prompt, none ending early: no compaction moved a row
        for layer in range(len(ws.k)):
            pkv = ref.past_key_values
            want_k = pkv.layers[layer].keys[0] if hasattr(pkv, "layers") else pkv[layer][0][0]
            want_v = pkv.layers[layer].values[0] if hasattr(pkv, "layers") else pkv[layer][1][0]
            for codes, scales, want in ((ws.k, ws.k_scale, want_k), (ws.v, ws.v_scale, want_v)):
                got = dequantize_cache(codes[layer][slot, :, :cached], scales[layer][slot, :, :cached])
                want = want[:, :cached].float()
                # exact up to the rounding: the prompt's slots (its prefill attends to unquantised K/V) and the
                # first layer's; later layers' completion slots carry the earlier layers' attention over the
                # rounded cache too
                exact = cached if layer == 0 else len(prompt)
                bound = torch.maximum(want.abs() / 16, scales[layer][slot, :, :cached, None] / 1024) + 1e-5
                assert ((got - want).abs() <= bound)[:, :exact].all()
                drift.append(((got - want).abs()[:, exact:].amax() / want.abs().amax()).item() if exact < cached
                             else 0.0)
    assert worst <= 0.02  # 0.004 measured
    assert max(drift) <= 0.15  # 0.043 measured (of the layer's largest |K| / |V|)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        FastRolloutEngine(model, kv_cache_dtype="int8")


def test_workspace_moves_scales_with_codes_and_reads_them_back():
    """An FP8 workspace: ``write`` stores what ``read`` gives back to e4m3's rounding, views slice the scales with
    the codes, compaction (``keep_slots``) moves a row's scales with its codes, and the bytes counted include them."""
    from swiftune.rl.rollout.kv_cache import Workspace

    layers, rows, kv_heads, dim, length = 2, 3, 2, 16, 8
    ws = Workspace(layers, rows, kv_heads, dim, length, 4, 32, torch.float32, torch.device(DEVICE),
                   kv_cache_dtype="fp8")
    g = torch.Generator().manual_seed(2)
    keys = [torch.randn(rows, length, kv_heads, dim, generator=g).to(DEVICE) * (r + 1) for r in range(layers)]
    values = [torch.randn(rows, length, kv_heads, dim, generator=g).to(DEVICE) for _ in range(layers)]
    row_ids = torch.arange(rows, device=DEVICE).repeat_interleave(length)
    slots = torch.arange(length, device=DEVICE).repeat(rows)
    for layer in range(layers):
        ws.write(layer, row_ids, slots, keys[layer].reshape(-1, kv_heads, dim),
                 values[layer].reshape(-1, kv_heads, dim))
    for layer in range(layers):
        got_k, got_v = ws.read(layer, length, torch.float32)
        for got, want in ((got_k, keys[layer].transpose(1, 2)), (got_v, values[layer].transpose(1, 2))):
            scale = want.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX  # half a code step at most
            assert ((got - want).abs() <= torch.maximum(want.abs() / 16, scale / 1024) + 1e-6).all()
    before = [ws.read(layer, length, torch.float32) for layer in range(layers)]
    assert ws.view(2).k_scale[0].shape == (2, kv_heads, length)
    ws.keep_slots([2, 0])
    for layer in range(layers):
        after = ws.read(layer, length, torch.float32)
        for a, b in zip(after, before[layer]):
            assert torch.equal(a[:2], b[[2, 0]])
    assert ws.nbytes() == 2 * layers * rows * kv_heads * length * (dim + 4)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Workspace(layers, rows, kv_heads, dim, length, 4, 32, torch.float32, torch.device(DEVICE),
                  kv_cache_dtype="e5m2")


def _logprobs_with_rounded_cache(reference, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Transformers' own model decoding ``completion`` token by token with its ``DynamicCache`` rounded as the FP8
    cache rounds it: the prefill attends to the unrounded K/V and leaves them rounded in the cache; each later
    token's K/V are rounded before the cache takes them (and before its own attention reads them)."""
    from transformers import DynamicCache

    def rounded(x):
        codes, scale = _quantise(x)
        return (codes.float() * scale[..., None]).to(x.dtype)

    cache = DynamicCache(config=reference.config)
    with torch.no_grad():
        out = reference(input_ids=torch.tensor([prompt], device=DEVICE), past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            layer.keys, layer.values = rounded(layer.keys), rounded(layer.values)
        update = cache.update
        cache.update = lambda k, v, i, *a, **kw: update(rounded(k), rounded(v), i, *a, **kw)
        logps = [torch.log_softmax(out.logits[0, -1].float(), -1)[completion[0]]]
        for token, following in zip(completion[:-1], completion[1:]):
            out = reference(input_ids=torch.tensor([[token]], device=DEVICE), past_key_values=cache, use_cache=True)
            logps.append(torch.log_softmax(out.logits[0, -1].float(), -1)[following])
    return torch.stack(logps)


@pytest.mark.parametrize("family,decode_attention", [("qwen3", "split"), ("qwen3", "sdpa"), ("llama", "split"),
                                                     ("gpt_oss", "split"), ("gpt_oss", "sdpa")])
def test_engine_with_an_fp8_cache_equals_transformers_with_its_cache_rounded(family, decode_attention):
    """The engine with ``kv_cache_dtype="fp8"`` (greedy, fp32) reports, for every token, the log-probability that
    transformers' own unpatched model gives when its KV cache holds the same e4m3 rounding
    (:func:`_logprobs_with_rounded_cache`), to float32's noise: Qwen3 (q/k norms), Llama, and gpt-oss (attention
    sinks, sliding and full layers, experts). What the rounding itself moves (against the unrounded model) is
    bounded by the test above on Qwen3; docs/fp8.md gives it for these tiny models."""
    from swiftune.models import patch_model
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
    from tests.helpers import tiny_model
    from tests.test_moe_rollout import PAD, PROMPTS, _models

    if family == "gpt_oss":
        reference, model = _models(family, None, seed=5)
    else:
        reference = tiny_model(family)
        model = patch_model(copy.deepcopy(reference))
    reference, model = reference.to(DEVICE).eval(), model.to(DEVICE)
    engine = FastRolloutEngine(model, pad_token_id=PAD, use_cuda_graph=torch.cuda.is_available(),
                               decode_attention=decode_attention, kv_cache_dtype="fp8")
    out = engine.generate(PROMPTS, 1, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=()))
    for prompt, completion, logps in zip(PROMPTS, out.completion_ids, out.logprobs):
        assert len(completion) == 12
        want = _logprobs_with_rounded_cache(reference, prompt, list(completion))
        # float32 noise (2e-6 measured on the CPU); CUDA's float32 matmuls may round through TF32
        torch.testing.assert_close(torch.as_tensor(logps, device=DEVICE).float(), want, rtol=0,
                                   atol=2e-5 if DEVICE == "cpu" else 1e-3)
