"""FastRolloutEngine on gpt-oss (issue 25): attention sinks, alternating sliding / full layers, YaRN RoPE,
the MoE block that returns ``(out, router scores)``, biased clamped-SwiGLU experts.

The reference is transformers itself on the *unpatched* model (eager attention, fp32, CPU; PEFT's own
LoRA where an adapter is on): greedy tokens equal its ``generate``, every recorded log-prob equals the
log-softmax of its forward over the sampled sequence. The tiny model is tests/test_moe_parity.py's
(layer 0 sliding with window 4, layer 1 full; 4 experts top-2; sinks drawn from N(0, 1) so they take
real probability mass); the prompts are longer than the window, so the window cuts both the prefill
and the decode attention. The sink and window cases show that the reference's log-probs move far
beyond the tolerance without them, so the equality cases would catch an engine that dropped either.
The CUDA cases capture the decode step as CUDA graphs and compare replay with eager.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import swiftune.rl.rollout.kv_cache as rollout_state
from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
from swiftune.rl.rollout.layers import fused_prenorm_supported
from tests.helpers import rel_err
from tests.test_moe_rollout import _forward_logprobs, _hf_greedy, _models

#: a 12-token prompt and a 7-token one (both longer than the window of 4), and one shorter than it
PROMPTS = [[5, 9, 17, 33, 2, 61, 70, 71, 72, 80, 81, 90], [7, 8, 100, 12, 4, 40, 41], [3, 250]]
PAD = 0
WINDOW = 4


def _spy_attention(monkeypatch) -> dict[str, list]:
    """Record the window and whether sinks came with every prefill and decode attention of the engine."""
    seen: dict[str, list] = {"prefill": [], "decode": []}
    real_prefill, real_decode = rollout_state.sink_attention, rollout_state.DecodeContext.attend_cached

    def prefill(q, k, v, packed, *, window=None, **kw):
        seen["prefill"].append(window)
        return real_prefill(q, k, v, packed, window=window, **kw)

    def decode(self, layer, query, scale, window, softcap=None, sinks=None):
        seen["decode"].append((window, sinks is not None))
        return real_decode(self, layer, query, scale, window, softcap, sinks)

    monkeypatch.setattr(rollout_state, "sink_attention", prefill)
    monkeypatch.setattr(rollout_state.DecodeContext, "attend_cached", decode)
    return seen


@pytest.mark.parametrize("case", ["unpatched", "fused", "layer_forward", "attention_lora", "expert_lora",
                                  "expert_lora_merge", "cuda_paths_on_cpu"])
def test_greedy_equals_generate_of_the_unpatched_model(case, monkeypatch):
    """Greedy tokens equal transformers' generate on the unpatched model for every row of every group,
    the greedy log-probs its forward's (rel < 1e-5): transformers' own layers on the engine
    ("unpatched"), the patched model through the engine's fused layer loop and through each layer's
    own forward, LoRA on the attention projections and on the experts (runtime and merged, the base
    weights bit-identical afterwards), and what runs on CUDA forced on the CPU ("cuda_paths_on_cpu":
    the Triton kernels through the interpreter, decode_qkv with the widened YaRN table included, the
    prefill's flex attention with the sink slot, the experts' sync-free every-expert-per-row path).
    Every attention call had the sinks, the sliding layer its window."""
    import swiftune.models.experts as experts_module

    lora = {"attention_lora": "attention", "expert_lora": "experts", "expert_lora_merge": "experts",
            "cuda_paths_on_cpu": "experts"}.get(case)
    on_cuda_paths = case == "cuda_paths_on_cpu"
    if on_cuda_paths and torch.cuda.is_available():
        pytest.skip("the Triton kernels run compiled on CUDA tensors here, not interpreted on CPU ones")
    reference, policy = _models("gpt_oss", lora, seed=3, kernel_backend="triton" if on_cuda_paths else "reference")
    static_calls = []
    if on_cuda_paths:
        real = experts_module._routed_outputs

        def sync_free(*args, static: bool, **options):
            static_calls.append(static)
            return real(*args, static=True, **options)

        monkeypatch.setattr(experts_module, "_routed_outputs", sync_free)
    if case == "unpatched":
        policy = copy.deepcopy(reference)
    assert policy.config.layer_types == ["sliding_attention", "full_attention"]
    assert policy.config.sliding_window == WINDOW and policy.config.rope_parameters["rope_type"] == "yarn"
    if case == "fused":
        assert fused_prenorm_supported(policy.model, "gpt_oss", torch.float32)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    seen = _spy_attention(monkeypatch)
    engine = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=4, check_every=3,
                               lora="merge" if case == "expert_lora_merge" else "runtime",
                               fused_layers=case != "layer_forward",
                               attention_backend="flex" if on_cuda_paths else "auto")
    out = engine.generate(PROMPTS, 2, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=()))
    for i, p in enumerate(PROMPTS):
        ref = _hf_greedy(reference, p, 10)
        assert out.completion_ids[2 * i] == ref and out.completion_ids[2 * i + 1] == ref, (case, i)
    want = torch.cat([_forward_logprobs(reference, p, c, 1.0) for p, c in zip(PROMPTS, out.completion_ids[::2])])
    assert rel_err(torch.cat(out.logprobs[::2]).double(), want) < 1e-5
    assert all(torch.equal(before[n], p) for n, p in policy.named_parameters())
    assert seen["prefill"] == [WINDOW, None]  # one packed prefill, sliding layer then full layer
    assert set(seen["decode"]) == {(WINDOW, True), (None, True)} and len(seen["decode"]) == 2 * 9
    if on_cuda_paths:  # the forced path ran (the CPU engine itself asks for the per-block loop)
        assert static_calls and not any(static_calls)


def test_sampled_logprobs_equal_the_unpatched_forward_with_lora():
    """Sampled completions (temperature 0.8, LoRA on attention and experts, lora='runtime'): each
    recorded log-prob equals the unpatched PEFT model's forward log-prob of the sampled token at that
    temperature."""
    reference, policy = _models("gpt_oss", "experts", seed=4)
    out = FastRolloutEngine(policy, pad_token_id=PAD, seed=2, kv_bucket=4, lora="runtime").generate(
        PROMPTS, 3, SamplingParams(max_tokens=8, temperature=0.8, stop_token_ids=()))
    got, want = [], []
    for i, c in enumerate(out.completion_ids):
        assert len(c) == 8 and len(out.logprobs[i]) == 8
        got.append(out.logprobs[i].double())
        want.append(_forward_logprobs(reference, PROMPTS[i // 3], c, 0.8))
    assert len({tuple(c) for c in out.completion_ids}) > 3  # sampling, not one path per prompt
    assert rel_err(torch.cat(got), torch.cat(want)) < 1e-5


def test_sinks_and_window_change_the_result():
    """Without the sinks (zeroed) or without the window (every layer full), transformers' own forward
    gives log-probs far from the trained model's on the same tokens (so the equality cases above can
    fail); with the sinks zeroed in the policy, the engine follows: it equals the zero-sink reference,
    i.e. it reads the live sink parameters."""
    reference, policy = _models("gpt_oss", None, seed=5)
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=())
    out = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=4).generate(PROMPTS, 1, params)
    got = torch.cat(out.logprobs).double()

    def reference_logprobs(model, completions) -> torch.Tensor:
        return torch.cat([_forward_logprobs(model, p, c, 1.0) for p, c in zip(PROMPTS, completions)])

    assert rel_err(got, reference_logprobs(reference, out.completion_ids)) < 1e-5
    no_sinks = copy.deepcopy(reference)
    full = copy.deepcopy(reference)
    full.config.layer_types = ["full_attention"] * full.config.num_hidden_layers
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.zero_()
        for layer in policy.model.layers:
            layer.self_attn.sinks.zero_()
    assert rel_err(got, reference_logprobs(no_sinks, out.completion_ids)) > 1e-2
    assert rel_err(got, reference_logprobs(full, out.completion_ids)) > 1e-2
    zeroed = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=4).generate(PROMPTS, 1, params)
    assert zeroed.completion_ids == [_hf_greedy(no_sinks, p, 10) for p in PROMPTS]
    assert rel_err(torch.cat(zeroed.logprobs).double(), reference_logprobs(no_sinks, zeroed.completion_ids)) < 1e-5
    assert rel_err(torch.cat(zeroed.logprobs).double(), got) > 1e-2


def test_sinks_with_a_softcap_are_refused():
    """No family has both, and no attention computes them together: a clear error, not another attention."""
    ws = rollout_state.Workspace(1, 1, 1, 4, 4, 2, 8, torch.float32, torch.device("cpu"))
    ctx = rollout_state.DecodeContext(ws, "reference")
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="sinks with a soft-cap"):
        ctx.attend(0, q, q[:, :1], q[:, :1], 0.5, None, 30.0, sinks=torch.zeros(2))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graph_decode_equals_eager_bf16():
    """CUDA, bf16, compiled kernels, the default prefill backend (flex attention with the sink slot):
    decode steps replayed from CUDA graphs give the eager steps' tokens and log-probs exactly, greedy
    and sampled, with and without LoRA on the experts; every capture succeeded (no host sync)."""
    for lora in (None, "experts"):
        _, policy = _models("gpt_oss", lora, seed=7, kernel_backend="auto")
        policy = policy.to(device="cuda", dtype=torch.bfloat16)
        runs = {}
        for graph in (False, True):
            kw = dict(pad_token_id=PAD, use_cuda_graph=graph, kv_bucket=8, check_every=5, seed=3, lora="runtime")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runs[graph] = [FastRolloutEngine(policy, **kw).generate(PROMPTS, 4, params) for params in
                               (SamplingParams(max_tokens=24, temperature=0, stop_token_ids=()),
                                SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=()))]
            assert not [w for w in caught if "CUDA-graph capture" in str(w.message)], lora
        for eager, graph in zip(runs[False], runs[True]):
            assert graph.stats["capture_s"] > 0
            assert graph.completion_ids == eager.completion_ids, lora
            assert torch.equal(torch.cat(graph.logprobs), torch.cat(eager.logprobs)), lora


@cuda
@pytest.mark.parametrize("attention_backend", ["reference", "auto"])
def test_cuda_graph_greedy_fp32_equals_generate(attention_backend):
    """CUDA, fp32, CUDA graphs, prefill through the per-document reference or flex (``auto``): greedy
    tokens equal transformers' generate on the unpatched PEFT model, log-probs its forward's."""
    reference, policy = _models("gpt_oss", "experts", seed=8, kernel_backend="auto")
    reference, policy = reference.cuda(), policy.cuda()
    out = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=8, check_every=5, lora="runtime",
                            attention_backend=attention_backend).generate(
        PROMPTS, 2, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=()))
    assert out.stats["capture_s"] > 0
    for i, p in enumerate(PROMPTS):
        assert out.completion_ids[2 * i] == _hf_greedy(reference, p, 20), i
    want = torch.cat([_forward_logprobs(reference, p, c, 1.0) for p, c in zip(PROMPTS, out.completion_ids[::2])])
    assert rel_err(torch.cat(out.logprobs[::2]).double(), want) < 1e-4


def test_grpo_step_on_the_fast_engine_with_gpt_oss(tmp_path):
    """GRPOTrainer(rollout_engine="fast") on gpt-oss with LoRA on attention and experts: the engine samples
    (eager on CPU), the policy step runs, the adapters move and nothing else does."""
    from swiftune import GRPOConfig, GRPOTrainer
    from swiftune.data import build_tokenizer
    from swiftune.training import FastModel
    from tests.test_moe_parity import TARGETS, tiny_gpt_oss

    model = FastModel.get_peft_model(tiny_gpt_oss(seed=5), r=4, lora_alpha=8, init_lora_weights=False,
                                     use_gradient_checkpointing=False, **TARGETS["experts"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-2, rollout_engine="fast", kernel_backend="reference",
                      attention_backend="reference", report_to="none", save_strategy="no", disable_tqdm=True,
                      dataloader_pin_memory=False, seed=1)
    trainer = GRPOTrainer(model, [lambda completions, **kw: [float(len(c)) for c in completions]], args=args,
                          train_dataset=[{"prompt": "Reverse: abcdef\n"}, {"prompt": "Hi there\n"}] * 2,
                          processing_class=build_tokenizer())
    assert isinstance(trainer.rollout_engine, FastRolloutEngine)
    trainer.train()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.cpu(), before[n].cpu())}
    assert moved and all("lora_" in n for n in moved)
    assert any("experts" in n for n in moved) and any("self_attn" in n for n in moved)
