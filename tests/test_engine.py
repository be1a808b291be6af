"""FastRolloutEngine on CPU: the eager path of the same decode step the GPU captures as CUDA graphs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftune.data import EOS_TOKEN_ID, build_tokenizer, tiny_model_config
from swiftune.models import patch_model
from swiftune.training import FastModel, enable_gradient_checkpointing
from swiftune.rl.rollout import FastRolloutEngine, FastSamplingParams, sample_tokens
from swiftune.rl.rollout import RolloutEngine, SamplingParams
from tests.helpers import rel_err

PROMPT_TEXTS = ["Reverse: abc\n", "Sort the letters: garden\n", "Hi\n"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]


def tiny_model(family="qwen3", seed=0, patch=True, **overrides):
    torch.manual_seed(seed)
    if family in ("gemma2", "gemma3", "mistral"):
        overrides.setdefault("sliding_window", 8)  # shorter than prompt + completion: the window matters
    model = AutoModelForCausalLM.from_config(tiny_model_config(family, **overrides), dtype=torch.float32)
    if patch:
        patch_model(model, attention="reference", kernel_backend="reference")
    return model.eval()


def add_lora(model, seed=1):
    torch.manual_seed(seed)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def hf_greedy(model, prompt, n, pad):
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, pad_token_id=pad)
    return out[0, len(prompt):].tolist()


def forward_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.mark.parametrize("family,patch",
                         [("llama", True), ("mistral", True), ("qwen2", True), ("qwen3", True), ("gemma2", True),
                          ("gemma3", True), ("qwen3", False)])
def test_greedy_equals_generate(tokenizer, prompts, family, patch):
    model = tiny_model(family, seed=5, patch=patch)
    attn = model.config._attn_implementation
    engine = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, kv_bucket=4, check_every=3)
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(prompts, 2, SamplingParams(max_tokens=14, temperature=0))
    assert model.config._attn_implementation == attn  # restored
    for i, p in enumerate(prompts):
        ref = hf_greedy(model, p, 14, tokenizer.pad_token_id)
        assert out.completion_ids[2 * i] == ref and out.completion_ids[2 * i + 1] == ref, (family, i)
    # greedy log-probs: temperature-1 log-softmax of the model's own logits
    assert rel_err(torch.cat(out.logprobs[::2]),
                   torch.cat([forward_logprobs(model, p, c, 1.0) for p, c in zip(prompts, out.completion_ids[::2])])) < 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_sampling_logprobs_equal_forward_pass(tokenizer, prompts, family):
    model = tiny_model(family, seed=6)
    model.train()
    enable_gradient_checkpointing(model)
    engine = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, seed=3, kv_bucket=8)
    out = engine.generate(prompts, 3, SamplingParams(max_tokens=12, temperature=0.8, stop_token_ids=[EOS_TOKEN_ID]))
    assert model.training  # training mode restored
    model.eval()
    got, want = [], []
    for i, c in enumerate(out.completion_ids):
        assert len(c) == len(out.logprobs[i]) and not out.logprobs[i].requires_grad
        got.append(out.logprobs[i])
        want.append(forward_logprobs(model, prompts[i // 3], c, 0.8))
    assert rel_err(torch.cat(got), torch.cat(want)) < 1e-5
    # top-k: log-probs renormalised over the top k, tokens inside the top k
    out_k = engine.generate(prompts, 2, SamplingParams(max_tokens=6, temperature=0.8, top_k=5))
    for i, c in enumerate(out_k.completion_ids):
        ids = torch.tensor([list(prompts[i // 2]) + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompts[i // 2]) - 1:-1].float() / 0.8
        top = logits.topk(5, dim=-1)
        assert (top.indices == torch.tensor(c)[:, None]).any(dim=1).all()
        want_k = logits.gather(1, torch.tensor(c)[:, None]).squeeze(1) - torch.logsumexp(top.values, dim=-1)
        assert rel_err(out_k.logprobs[i], want_k) < 1e-5


@pytest.mark.parametrize("family,dtype,backend", [("llama", torch.float32, "reference"),
                                                   ("mistral", torch.float32, "reference"),
                                                   ("qwen2", torch.float32, "reference"),
                                                   ("qwen3", torch.bfloat16, "reference"),
                                                   ("qwen3", torch.float32, "triton")])
def test_fused_residual_norm_layers_equal_the_layers_own_forward(tokenizer, prompts, family, dtype, backend,
                                                                  monkeypatch):
    """The engine's pre-norm loop (residual adds folded into the norms; q/k norms, RoPE and cache
    writes fused in decode steps) gives the same tokens and log-probs as calling each decoder
    layer, sampled, with a LoRA adapter running as PEFT layers."""
    import swiftune.rl.rollout.fast as engine_module

    torch.manual_seed(2)
    # Mistral with a window shorter than prompt + completion: the fused decode path must apply it
    overrides = {"sliding_window": 6} if family == "mistral" else {}
    model = AutoModelForCausalLM.from_config(tiny_model_config(family, **overrides), dtype=dtype)
    if backend == "triton" and torch.cuda.is_available():  # compiled kernels; the interpreter runs them on CPU
        model = model.cuda()
    with torch.no_grad():  # norms start as ones: give each its own weights, so a mixed-up norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    patch_model(model, attention="reference", kernel_backend=backend)
    model = add_lora(model).eval()
    calls = []
    real = engine_module.prenorm_layers
    monkeypatch.setattr(engine_module, "prenorm_layers", lambda *a: calls.append(1) or real(*a))
    params = SamplingParams(max_tokens=9, temperature=0.9)
    # the adapters' products as the ops compute them (the LoRA decode kernel, below, sums in another order)
    fused = FastRolloutEngine(model, seed=7, kv_bucket=4, check_every=2, lora="runtime", fused_layers=True,
                              lora_decode_kernel=False).generate(prompts, 2, params)
    assert calls  # the fused loop ran (prefill and every decode step)
    n = len(calls)
    plain = FastRolloutEngine(model, seed=7, kv_bucket=4, check_every=2, lora="runtime",
                              fused_layers=False).generate(prompts, 2, params)
    assert len(calls) == n  # ... and the unfused engine did not use it
    assert fused.completion_ids == plain.completion_ids
    assert torch.equal(torch.cat(fused.logprobs), torch.cat(plain.logprobs))
    # each adapter's product from the LoRA decode kernel (the engine's default on CUDA; here the interpreter runs
    # it): the same tokens, log-probs float32 sums apart (bf16 / fp16 outputs: an ulp of some projection outputs)
    kernel = FastRolloutEngine(model, seed=7, kv_bucket=4, check_every=2, lora="runtime", fused_layers=True,
                               lora_decode_kernel=True).generate(prompts, 2, params)
    assert kernel.completion_ids == plain.completion_ids
    torch.testing.assert_close(torch.cat(kernel.logprobs), torch.cat(plain.logprobs), rtol=0,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_lora_decode_kernel_is_on_by_default_on_cuda_only():
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"))
    assert FastRolloutEngine(model).decode_options.lora_decode_kernel is False  # CPU: the torch ops
    assert FastRolloutEngine(model, lora_decode_kernel=True).decode_options.lora_decode_kernel is True
    if torch.cuda.is_available():
        assert FastRolloutEngine(model.cuda()).decode_options.lora_decode_kernel is True
    with pytest.raises(ValueError, match="lora_decode_kernel must be True, False or 'auto'"):
        FastRolloutEngine(model, lora_decode_kernel="yes")


def test_fused_residual_norm_only_on_patched_pre_norm_models():
    from swiftune.rl.rollout.layers import fused_prenorm_supported

    for family, patch, expected in [("qwen3", True, True), ("llama", True, True), ("qwen3", False, False),
                                    ("gemma2", True, False), ("gemma3", True, False)]:
        model = tiny_model(family, patch=patch)
        assert fused_prenorm_supported(model.model, model.config.model_type, torch.float32) == expected, family
        if expected:  # norm weights in another dtype than the activations: transformers' rules apply
            assert not fused_prenorm_supported(model.model, model.config.model_type, torch.bfloat16)


def test_shared_prompt_prefill_equals_separate(tokenizer, prompts):
    model = tiny_model("qwen3", seed=9)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95)
    a = FastRolloutEngine(model, seed=4, share_prompt_prefill=True).generate(prompts, 4, params)
    b = FastRolloutEngine(model, seed=4, share_prompt_prefill=False).generate(prompts, 4, params)
    assert a.completion_ids == b.completion_ids
    assert rel_err(torch.cat(a.logprobs), torch.cat(b.logprobs)) < 1e-5
    assert len({tuple(c) for c in a.completion_ids[:4]}) > 1  # a group's samples differ


def test_lora_on_off_and_exact_restore(tokenizer, prompts):
    model = add_lora(tiny_model("qwen3", seed=10))
    params = SamplingParams(max_tokens=10, temperature=0)
    pad = tokenizer.pad_token_id
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merges = []
    merge = model.merge_adapter
    model.merge_adapter = lambda *a, **k: (merges.append(1), merge(*a, **k))
    on = {mode: FastRolloutEngine(model, pad_token_id=pad, lora=mode).generate(prompts, 1, params)
          for mode in ("runtime", "merge")}
    with model.disable_adapter():
        off = FastRolloutEngine(model, pad_token_id=pad, lora="merge").generate(prompts, 1, params)
        want_off = [hf_greedy(model, p, 10, pad) for p in prompts]
    want_on = [hf_greedy(model, p, 10, pad) for p in prompts]
    assert on["runtime"].completion_ids == want_on
    assert off.completion_ids == want_off
    assert want_on != want_off  # the adapters matter
    # merged: same tokens, log-probs equal up to the rounding of W + dW
    assert merges == [1]  # merged once (adapters on); not with adapters disabled
    assert on["merge"].completion_ids == want_on
    assert rel_err(torch.cat(on["merge"].logprobs), torch.cat(on["runtime"].logprobs)) < 1e-5
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-identical after unmerge
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_stop_token_and_stop_string(tokenizer, prompts):
    model = tiny_model("llama", seed=7)
    pad = tokenizer.pad_token_id
    engine = FastRolloutEngine(model, pad_token_id=pad, tokenizer=tokenizer, check_every=2)
    free = engine.generate(prompts, 1, SamplingParams(max_tokens=12, temperature=0))
    assert all(len(c) == 12 for c in free.completion_ids) and not any(free.finished)
    stop = free.completion_ids[0][3]
    out = engine.generate(prompts, 1, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))
    for full, got, done, lp in zip(free.completion_ids, out.completion_ids, out.finished, out.logprobs):
        if stop in full:
            assert done and got == full[:full.index(stop) + 1]
        else:
            assert not done and got == full
        assert len(lp) == len(got)
    # a stop string: the text of completion 0 around its 5th token
    text = tokenizer.decode(free.completion_ids[0][:5])
    stop_str = text[-3:] if len(text) >= 3 else text
    out = engine.generate(prompts, 1, FastSamplingParams(max_tokens=12, temperature=0, stop=[stop_str]))
    for full, got, done in zip(free.completion_ids, out.completion_ids, out.finished):
        k = next((k for k in range(1, 13) if stop_str in tokenizer.decode(full[:k])), None)
        if k is None:
            assert not done and got == full
        else:
            assert done and got == full[:k]
    assert out.finished[0] and len(out.completion_ids[0]) <= 5


def _stops_finishing_rows_at_different_steps(full: list[list[int]]) -> list[int]:
    """Stop tokens taken from greedy completions so that most rows end early, at different steps,
    and at least one row never ends (so the live rows become few but not none)."""
    def ends(stops):
        return [next((k for k, t in enumerate(c) if t in stops), None) for c in full]

    stops: set[int] = set()
    for t in dict.fromkeys(t for c in full for t in c[1:]):
        trial = stops | {t}
        if all(e is not None for e in ends(trial)):
            continue  # every row would stop
        stops = trial
        if sum(e is not None and e < len(c) - 8 for e, c in zip(ends(stops), full)) >= 0.75 * len(full):
            return sorted(stops)
    raise AssertionError("no stop set ends most rows early: pick another seed")


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_finished_rows_leave_the_batch_with_the_same_results(tokenizer, prompts, family):
    """Compaction (finished rows moved out, the live ones decoded as a smaller batch) changes nothing:
    greedy tokens, log-probs and finished flags equal the masked-only run; it does happen."""
    model = tiny_model(family, seed=13)
    pad = tokenizer.pad_token_id
    many = prompts + [p[:-1] for p in prompts] + [prompts[0] + prompts[2]]  # 7 prompts x 2 rows
    free = FastRolloutEngine(model, pad_token_id=pad).generate(many, 2, SamplingParams(max_tokens=24, temperature=0))
    params = SamplingParams(max_tokens=24, temperature=0,
                            stop_token_ids=_stops_finishing_rows_at_different_steps(free.completion_ids))
    kw = dict(pad_token_id=pad, check_every=2, kv_bucket=4)
    masked = FastRolloutEngine(model, compact_finished=False, **kw).generate(many, 2, params)
    engine = FastRolloutEngine(model, compact_finished=True, **kw)
    compact = engine.generate(many, 2, params)
    assert engine.stats.get("compactions", 0) >= 1 and "compactions" not in masked.stats
    assert compact.completion_ids == masked.completion_ids
    assert compact.finished == masked.finished
    for a, b in zip(compact.logprobs, masked.logprobs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert any(f for f in compact.finished) and not all(compact.finished)


def test_compacted_sampling_logprobs_equal_forward_pass(tokenizer, prompts):
    """Sampled rows after compaction (their KV cache moved to other slots) still have the log-probs of
    a plain forward pass over prompt + completion."""
    model = tiny_model("llama", seed=14)
    pad = tokenizer.pad_token_id
    vocab = model.config.vocab_size
    # a sixth of the vocabulary stops a row: rows end at random steps
    stops = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 6].tolist()
    engine = FastRolloutEngine(model, pad_token_id=pad, check_every=1, kv_bucket=4, seed=5)
    out = engine.generate(prompts, 4, SamplingParams(max_tokens=16, temperature=0.8, stop_token_ids=stops))
    assert engine.stats.get("compactions", 0) >= 1 and len({len(c) for c in out.completion_ids}) > 2
    for i, (c, lp) in enumerate(zip(out.completion_ids, out.logprobs)):
        assert len(lp) == len(c) >= 1
        assert rel_err(lp, forward_logprobs(model, prompts[i // 4], c, 0.8)) < 1e-5, i


def test_stop_strings_with_compaction(tokenizer, prompts):
    """Stop strings are checked per original row after slots have moved."""
    model = tiny_model("llama", seed=7)
    pad = tokenizer.pad_token_id
    kw = dict(pad_token_id=pad, tokenizer=tokenizer, check_every=1, kv_bucket=4)
    free = FastRolloutEngine(model, **kw).generate(prompts, 2, SamplingParams(max_tokens=12, temperature=0))
    stop = free.completion_ids[0][1]
    text = tokenizer.decode(free.completion_ids[2][:6])
    params = FastSamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop], stop=[text[-2:]])
    a = FastRolloutEngine(model, compact_finished=True, **kw).generate(prompts, 2, params)
    b = FastRolloutEngine(model, compact_finished=False, **kw).generate(prompts, 2, params)
    assert a.completion_ids == b.completion_ids and a.finished == b.finished


def test_all_finished_ends_the_loop_and_rows_are_masked(tokenizer, prompts):
    model = tiny_model("qwen3", seed=11)
    vocab = model.config.vocab_size
    engine = FastRolloutEngine(model, check_every=4)
    out = engine.generate(prompts, 2, SamplingParams(max_tokens=50, temperature=1.0, stop_token_ids=range(vocab)))
    assert all(len(c) == 1 for c in out.completion_ids) and all(out.finished)
    assert out.stats["decode_steps"] <= 1 + 4 + 1
    # finished rows: pad tokens and zero log-probs after their end in the static buffers
    ws = engine._ws
    assert (ws.out_tok[:, 1:int(out.stats["decode_steps"])] == engine.pad_token_id).all()
    assert (ws.out_lp[:, 1:] == 0).all()


def test_engines_refuse_no_generations_and_empty_prompts(prompts):
    """Both engines: num_generations below 1 (once a division by zero) and an empty prompt are refused by name."""
    from swiftune.rl import TransformersRolloutEngine

    model = tiny_model("qwen3", seed=11)
    for engine in (FastRolloutEngine(model), TransformersRolloutEngine(model, pad_token_id=0)):
        for g in (0, -2):
            with pytest.raises(ValueError, match=f"num_generations={g} must be a whole number >= 1"):
                engine.generate(prompts, g, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="at least one token"):
            engine.generate([[]], 1, SamplingParams(max_tokens=2))


def test_seeded_reproducibility_and_cache_reuse(prompts):
    model = tiny_model("qwen3", seed=8)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, min_p=0.05)
    ea = FastRolloutEngine(model, seed=11)
    a = ea.generate(prompts, 3, params)
    ws = ea._ws
    b = FastRolloutEngine(model, seed=11, keep_cache=False).generate(prompts, 3, params)
    c = FastRolloutEngine(model, seed=12).generate(prompts, 3, params)
    assert a.completion_ids == b.completion_ids
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert a.completion_ids != c.completion_ids
    ea.generate(prompts, 3, params)
    assert ea._ws is ws  # same shape: the static cache is reused ("auto" keeps it off CUDA)
    eb = FastRolloutEngine(model, keep_cache=False)
    eb.generate(prompts, 3, params)
    assert eb._ws is None  # freed after the call
    with pytest.raises(ValueError, match="keep_cache"):
        FastRolloutEngine(model, keep_cache="sometimes")


def test_auto_keep_cache_weighs_the_process_share_of_the_gpu(monkeypatch):
    """keep_cache="auto" keeps a CUDA workspace up to 10% of the memory this process may use: the card's
    times its per-process fraction (a shared or emulated smaller GPU), not the whole card's."""
    import types

    import swiftune.rl.rollout.fast as fast

    engine = FastRolloutEngine(tiny_model("qwen3"))
    cuda = types.SimpleNamespace(type="cuda")
    seen = []
    monkeypatch.setattr(fast, "gpu_capacity_bytes", lambda device: seen.append(device) or 24 * 10**9)
    for nbytes, kept in ((2 * 10**9, True), (3 * 10**9, False)):  # 10% of a 24 GB share: 2.4 GB
        engine._ws = types.SimpleNamespace(tok=types.SimpleNamespace(device=cuda), nbytes=lambda n=nbytes: n)
        assert engine._keeps_cache() is kept
    assert seen == [cuda, cuda]
    engine._ws = None


def _reference_keep(logits, top_k, top_p, min_p):
    """Plain per-row reference of the kept token set (temperature already applied)."""
    keep = []
    for row in logits.double().tolist():
        order = sorted(range(len(row)), key=lambda i: -row[i])
        alive = set(order[:top_k] if top_k else order)
        if top_p < 1.0:
            z = sum(torch.tensor([row[i] for i in alive]).exp().tolist())
            mass, nucleus = 0.0, set()
            for i in order:
                if i not in alive:
                    continue
                if mass >= top_p:
                    break
                nucleus.add(i)
                mass += float(torch.tensor(row[i]).exp()) / z
            alive = nucleus
        if min_p:
            z = sum(float(torch.tensor(row[i]).exp()) for i in alive)
            pmax = max(float(torch.tensor(row[i]).exp()) / z for i in alive)
            alive = {i for i in alive if float(torch.tensor(row[i]).exp()) / z >= min_p * pmax}
        keep.append(alive)
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(3, 1.0, None), (None, 0.7, None), (None, 1.0, 0.2), (5, 0.9, 0.1)])
def test_filtering_against_reference(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(0)
    vocab, rows, temp = 12, 4, 0.7
    logits = torch.randn(rows, vocab, generator=g) * 2
    keep = _reference_keep(logits / temp, top_k, top_p, min_p)
    draws = 4000
    big = logits.repeat(draws, 1)
    tokens, lps = sample_tokens(big, torch.rand(big.shape, generator=g), temp, top_k, top_p, min_p)
    tokens, lps = tokens.view(draws, rows), lps.view(draws, rows)
    for r in range(rows):
        kept = sorted(keep[r])
        ref_logp = torch.log_softmax((logits[r, kept] / temp).double(), dim=0)
        ref = dict(zip(kept, ref_logp.tolist()))
        assert set(tokens[:, r].tolist()) <= set(kept)
        for t, lp in zip(tokens[:, r].tolist(), lps[:, r].tolist()):
            assert abs(lp - ref[t]) < 1e-5
        freq = torch.bincount(tokens[:, r], minlength=vocab).double() / draws  # Gumbel-max samples the law
        assert (freq[kept] - ref_logp.exp()).abs().max() < 0.035


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3"])
def test_cuda_graph_decode_equals_eager_and_generate(tokenizer, prompts, family):
    """CUDA: decode steps replayed as CUDA graphs give the eager step's tokens and log-probs, and greedy
    tokens equal transformers' generate on the unpatched model (float32, so no bf16 near-ties)."""
    model = tiny_model(family, seed=7, patch=False).cuda()
    pad = tokenizer.pad_token_id

    def hf_greedy_cuda(p, n):
        ids = torch.tensor([p], device="cuda")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=pad)
        return out[0, len(p):].tolist()

    refs = [hf_greedy_cuda(p, 20) for p in prompts]
    # Triton kernels compiled for CUDA; the prefill attention on the reference backend because float32
    # would take flex, whose compile per prompt shape costs minutes (bf16 varlen: benchmarks/rollout.py)
    patch_model(model, attention="reference")
    greedy = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=())
    sampled = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, stop_token_ids=())
    runs = {}
    for graph in (False, True):
        kw = dict(pad_token_id=pad, use_cuda_graph=graph, kv_bucket=8, check_every=5, seed=3,
                  attention_backend="reference")
        runs[graph] = (FastRolloutEngine(model, **kw).generate(prompts, 2, greedy),
                       FastRolloutEngine(model, **kw).generate(prompts, 2, sampled))
    (g_eager, s_eager), (g_graph, s_graph) = runs[False], runs[True]
    assert g_graph.completion_ids == g_eager.completion_ids
    assert s_graph.completion_ids == s_eager.completion_ids
    assert rel_err(torch.cat(s_graph.logprobs), torch.cat(s_eager.logprobs)) < 1e-5
    assert g_graph.stats["capture_s"] > 0
    for i, ref in enumerate(refs):
        assert g_graph.completion_ids[2 * i] == ref and g_graph.completion_ids[2 * i + 1] == ref, (family, i)
    # sampled log-probs (temperature 1, no filter) equal a forward pass over the produced sequence
    plain = SamplingParams(max_tokens=20, temperature=1.0, stop_token_ids=())
    out = FastRolloutEngine(model, pad_token_id=pad, use_cuda_graph=True, kv_bucket=8, seed=4,
                            attention_backend="reference").generate(prompts, 2, plain)
    for p, c, lp in zip(prompts, out.completion_ids[::2], out.logprobs[::2]):
        ids = torch.tensor([list(p) + list(c)], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        ref = torch.log_softmax(logits[len(p) - 1:-1], dim=-1).gather(1, ids[0, len(p):, None]).squeeze(1)
        assert rel_err(lp, ref) < 1e-4


@cuda
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_graph_repetition_penalty_equals_eager_and_generate(tokenizer, prompts, family):
    """CUDA: the repetition penalty's seen mask inside the captured decode step (warm-up and capture
    must not leave marks) gives the eager step's samples and transformers' greedy generate with
    repetition_penalty on the unpatched model, token for token; compaction permutes the mask too."""
    model = tiny_model(family, seed=7, patch=False).cuda()
    pad, penalty = tokenizer.pad_token_id, 1.7

    def hf_greedy_cuda(p, n):
        ids = torch.tensor([p], device="cuda")
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, repetition_penalty=penalty,
                              pad_token_id=pad)[0, len(p):].tolist()

    refs = [hf_greedy_cuda(p, 20) for p in prompts]
    patch_model(model, attention="reference")
    greedy = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=penalty)
    sampled = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, repetition_penalty=penalty,
                             stop_token_ids=list(range(60, 120)))
    runs = {}
    for graph in (False, True):
        kw = dict(pad_token_id=pad, use_cuda_graph=graph, kv_bucket=8, check_every=2, seed=3,
                  attention_backend="reference")
        runs[graph] = (FastRolloutEngine(model, **kw).generate(prompts, 2, greedy),
                       FastRolloutEngine(model, **kw).generate(prompts, 4, sampled))
    (g_eager, s_eager), (g_graph, s_graph) = runs[False], runs[True]
    assert g_graph.stats["capture_s"] > 0
    for i, ref in enumerate(refs):
        assert g_graph.completion_ids[2 * i] == ref and g_eager.completion_ids[2 * i] == ref, (family, i)
    assert s_graph.completion_ids == s_eager.completion_ids
    assert rel_err(torch.cat(s_graph.logprobs), torch.cat(s_eager.logprobs)) < 1e-5


@cuda
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_fused_residual_norm_equals_the_layers_own_forward_bf16(tokenizer, prompts, family):
    """CUDA, bf16, CUDA graphs, compiled Triton kernels: the engine's fused layer loop (add_rms_norm,
    decode_qkv) gives the same sampled tokens and log-probs, bit for bit, as calling the layers."""
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_model_config(family), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    model = model.cuda().eval()
    patch_model(model, attention="reference")
    params = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=())
    kw = dict(pad_token_id=tokenizer.pad_token_id, kv_bucket=8, check_every=5, seed=5, attention_backend="reference")
    fused = FastRolloutEngine(model, fused_layers=True, **kw).generate(prompts, 2, params)
    plain = FastRolloutEngine(model, fused_layers=False, **kw).generate(prompts, 2, params)
    assert fused.stats["capture_s"] > 0 and plain.stats["capture_s"] > 0
    assert fused.completion_ids == plain.completion_ids
    assert torch.equal(torch.cat(fused.logprobs), torch.cat(plain.logprobs))


@cuda
def test_cuda_graph_with_lora_runtime_and_merge(tokenizer, prompts):
    """CUDA graphs over PEFT LoRA layers: both LoRA modes give the adapted model's greedy tokens."""
    model = add_lora(tiny_model("qwen3", seed=8, patch=False)).cuda()
    patch_model(model, attention="reference")
    greedy = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=())
    kw = dict(kv_bucket=8, attention_backend="reference")
    eager = FastRolloutEngine(model, use_cuda_graph=False, **kw).generate(prompts, 2, greedy)
    before = [p.detach().clone() for p in model.parameters()]
    for lora in ("runtime", "merge"):
        out = FastRolloutEngine(model, use_cuda_graph=True, lora=lora, **kw).generate(prompts, 2, greedy)
        assert out.completion_ids == eager.completion_ids, lora
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@cuda
def test_cuda_graphs_with_compaction(tokenizer, prompts):
    """CUDA graphs per (live rows, kv_len): after finished rows leave the batch the replayed steps
    still give the eager, masked-only tokens."""
    model = tiny_model("qwen3", seed=13, patch=False).cuda()
    patch_model(model, attention="reference")
    pad = tokenizer.pad_token_id
    many = prompts + [p[:-1] for p in prompts] + [prompts[0] + prompts[2]]
    kw = dict(pad_token_id=pad, kv_bucket=8, check_every=2, attention_backend="reference")
    free = FastRolloutEngine(model, **kw).generate(many, 2, SamplingParams(max_tokens=24, temperature=0))
    params = SamplingParams(max_tokens=24, temperature=0,
                            stop_token_ids=_stops_finishing_rows_at_different_steps(free.completion_ids))
    masked = FastRolloutEngine(model, use_cuda_graph=False, compact_finished=False, **kw).generate(many, 2, params)
    engine = FastRolloutEngine(model, use_cuda_graph=True, compact_finished=True, **kw)
    graph = engine.generate(many, 2, params)
    assert engine.stats.get("compactions", 0) >= 1
    assert graph.completion_ids == masked.completion_ids and graph.finished == masked.finished
