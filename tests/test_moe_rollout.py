"""FastRolloutEngine on the mixture-of-experts families (Qwen3-MoE, Mixtral; issue 25).

The reference is transformers itself on the *unpatched* model (plus PEFT's own LoRA where an adapter is
on): greedy tokens equal its ``generate``, sampled log-probs equal the log-softmax of its forward over
the sampled sequence. The tiny models are tests/test_moe_parity.py's (4 experts top-2; Qwen3-MoE with
a sparse and a dense layer, Mixtral with a sliding window shorter than prompt + completion); the
adapters are its LoRA on the attention projections and on the experts through PEFT's
``target_parameters``. The engine runs the model's own MoE block (transformers' router) with
swiftune's grouped experts in the rollout variant (device-side routing, deterministic combine),
eagerly on CPU; the CUDA cases capture the decode step as CUDA graphs and compare replay with eager.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from swiftune.models import patch_model
from swiftune.models.experts import grouped_linear, rollout_experts, rollout_experts_forward, static_grouped_linear
from swiftune.models.families import FAMILIES
from swiftune.models.moe import record_router_logits
from swiftune.rl.rollout import FastRolloutEngine, SamplingParams, TransformersRolloutEngine
from swiftune.rl.rollout.fast import SUPPORTED
from swiftune.training import FastModel
from tests.helpers import rel_err
from tests.test_moe_parity import TARGETS, _targeted_lora_reference, tiny_moe

PROMPTS = [[5, 9, 17, 33, 2, 61], [7, 8, 100, 12, 4, 40, 41, 42, 43], [3, 250]]
PAD = 0
FAMILIES_ON_ENGINE = ["qwen3_moe", "mixtral"]


def _models(family: str, lora: str | None, seed: int = 0, kernel_backend: str = "reference", **overrides):
    """``(reference, policy)``: the unpatched transformers model (with PEFT's adapter when ``lora``) and
    the same weights patched by swiftune (adapter added through FastModel, as the trainers do). No
    end-of-sequence id in the config: transformers' generate would stop there (the engine's calls
    here have no stop token)."""
    base = tiny_moe(family, seed=seed, eos_token_id=None, **overrides)
    if lora is None:
        return base, patch_model(copy.deepcopy(base), attention="reference", kernel_backend=kernel_backend).eval()
    reference = _targeted_lora_reference(base, lora).eval()
    policy = patch_model(copy.deepcopy(base), attention="reference", kernel_backend=kernel_backend)
    policy = FastModel.get_peft_model(policy, r=4, lora_alpha=8, init_lora_weights=False,
                                      use_gradient_checkpointing=False, **TARGETS[lora])
    policy.load_state_dict(reference.state_dict())
    return reference, policy.eval()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def _forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(completion)], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / temperature
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp.gather(1, ids[0, len(prompt):, None]).squeeze(1)


def _experts_chosen(router_logits: list[torch.Tensor], top_k: int) -> set[int]:
    return {int(e) for logits in router_logits for e in logits.topk(top_k, dim=-1).indices.flatten()}


@pytest.mark.parametrize("family", FAMILIES_ON_ENGINE)
@pytest.mark.parametrize("lora,mode", [(None, "runtime"), ("attention", "runtime"), ("experts", "runtime"),
                                       ("experts", "merge")])
def test_greedy_equals_generate_of_the_unpatched_model(family, lora, mode):
    """Greedy tokens (fp32, CPU) equal transformers' generate on the unpatched (PEFT) model, for every
    row of every group; the routers ran in prefill and decode and chose more than one expert; with
    lora='merge' the base weights are bit-identical afterwards."""
    reference, policy = _models(family, lora, seed=3)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    engine = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=4, check_every=3, lora=mode)
    with record_router_logits(policy) as routed:
        out = engine.generate(PROMPTS, 2, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=()))
    for i, p in enumerate(PROMPTS):
        ref = _hf_greedy(reference, p, 10)
        assert out.completion_ids[2 * i] == ref and out.completion_ids[2 * i + 1] == ref, (family, lora, i)
    top_k = policy.config.num_experts_per_tok
    assert len(routed) >= 2 and len(_experts_chosen(routed, top_k)) > top_k  # routing differs across tokens
    # greedy log-probs: the temperature-1 log-softmax of the reference's own logits
    want = torch.cat([_forward_logprobs(reference, p, c, 1.0) for p, c in zip(PROMPTS, out.completion_ids[::2])])
    assert rel_err(torch.cat(out.logprobs[::2]).double(), want) < 1e-5
    assert all(torch.equal(before[n], p) for n, p in policy.named_parameters())  # merge restored exactly


@pytest.mark.parametrize("family", FAMILIES_ON_ENGINE)
def test_sampled_logprobs_equal_the_unpatched_forward_with_expert_lora(family, monkeypatch):
    """Sampled completions (temperature 0.8, LoRA on attention and experts, lora='runtime'): each
    recorded log-prob equals the unpatched PEFT model's forward log-prob of the sampled token. The
    expert adapters run as per-block low-rank products (no PEFT parametrisation registered, which
    would rebuild every expert's adapted matrix), the attention adapters as PEFT layers."""
    import torch.nn.utils.parametrize as parametrize

    reference, policy = _models(family, "experts", seed=4)
    registered = []
    real = parametrize.register_parametrization
    monkeypatch.setattr(parametrize, "register_parametrization", lambda *a, **k: registered.append(1) or real(*a, **k))
    policy.train()  # the engine switches to eval and back
    out = FastRolloutEngine(policy, pad_token_id=PAD, seed=2, kv_bucket=4, lora="runtime").generate(
        PROMPTS, 3, SamplingParams(max_tokens=8, temperature=0.8, stop_token_ids=()))
    assert policy.training and not registered
    with torch.no_grad():
        policy(input_ids=torch.tensor([PROMPTS[0]]))
    assert registered  # outside the engine PEFT's own path runs (the spy sees it)
    got, want = [], []
    for i, c in enumerate(out.completion_ids):
        assert len(c) == 8 and len(out.logprobs[i]) == 8
        got.append(out.logprobs[i].double())
        want.append(_forward_logprobs(reference, PROMPTS[i // 3], c, 0.8))
    assert len({tuple(c) for c in out.completion_ids}) > 1  # sampling, not one greedy path
    assert rel_err(torch.cat(got), torch.cat(want)) < 1e-5


@pytest.mark.parametrize("family", FAMILIES_ON_ENGINE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_experts_equal_transformers_experts_exactly(family, dtype):
    """The rollout variant of the grouped experts adds each token's expert outputs in transformers'
    order and roundings: the MoE block's output equals the unpatched block's bit for bit (fp32 and
    bf16 on the CPU); and the variant is what runs inside rollout_experts, restored afterwards."""
    # one CPU thread: with two, the CPU GEMM may split a product's reduction differently for the two
    # paths' shapes, and bit equality is a claim about the order of the additions, not about threading
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_rollout_experts_exactly(family, dtype)
    finally:
        torch.set_num_threads(threads)


def _check_rollout_experts_exactly(family, dtype):
    torch.manual_seed(0)
    reference = tiny_moe(family).to(dtype)
    model = patch_model(copy.deepcopy(reference), attention="reference", kernel_backend="reference")
    block, ref_block = model.model.layers[0].mlp, reference.model.layers[0].mlp
    x = torch.randn(1, 11, reference.config.hidden_size, dtype=dtype)
    experts = block.experts
    bound = experts.forward
    with torch.no_grad():
        want = ref_block(x)
        with rollout_experts(model, FAMILIES[family]) as (n_bound, n_total):
            assert n_bound == n_total >= 1
            assert experts.forward.__func__.func is rollout_experts_forward
            got = block(x)
    assert experts.forward == bound  # the training forward is back
    if family == "mixtral" and dtype == torch.bfloat16:
        # Mixtral's routing weights stay float32 and its SwiGLU is transformers' act(gate) * up, which in
        # bf16 rounds differently from swiftune's kernel; the training forward gives these same numbers
        with torch.no_grad():
            assert torch.equal(got, block(x))
        assert rel_err(got.float(), want.float()) < 1e-2
    else:
        assert torch.equal(got, want)


def test_static_grouped_linear_equals_the_per_expert_products():
    """The sync-free CUDA fallback (every expert on every row, each row keeping its own block's
    result) against the float64 product of each sorted row with its expert's matrix; empty blocks included."""
    torch.manual_seed(0)
    experts, rows = 5, 13
    blocks = torch.tensor([4, 0, 6, 1, 2])  # expert 1 gets no row
    offsets = blocks.cumsum(0).to(torch.int32)
    expert_of = torch.repeat_interleave(torch.arange(experts), blocks)
    x = torch.randn(rows, 8)
    for transposed in (False, True):
        w = torch.randn(experts, 8, 6) if transposed else torch.randn(experts, 6, 8)
        b = w.double() if transposed else w.double().transpose(1, 2)
        want = torch.stack([x[r].double() @ b[expert_of[r]] for r in range(rows)])
        got = static_grouped_linear(x, w, offsets, transposed=transposed)
        assert rel_err(got.double(), want) < 1e-6
        loop = grouped_linear(x, w, offsets, transposed=transposed, grouped=False)  # the training reference path
        assert rel_err(loop.double(), want) < 1e-6


@pytest.mark.parametrize("family", FAMILIES_ON_ENGINE)
def test_sync_free_expert_path_in_the_engine_equals_generate(family, monkeypatch):
    """The engine with the experts' CUDA path (every expert on every row, selected per row: what runs
    inside the graph where the grouped GEMM does not, e.g. fp32) forced on the CPU: greedy tokens still
    equal transformers' generate on the unpatched model, with LoRA on the experts."""
    import swiftune.models.experts as experts_module

    real = experts_module._routed_outputs
    calls = []

    def sync_free(*args, static: bool, **options):
        calls.append(static)
        return real(*args, static=True, **options)

    monkeypatch.setattr(experts_module, "_routed_outputs", sync_free)
    reference, policy = _models(family, "experts", seed=6)
    out = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=4, lora="runtime").generate(
        PROMPTS, 1, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=()))
    assert calls and not any(calls)  # on the CPU the engine itself would take the per-block loop
    for p, c in zip(PROMPTS, out.completion_ids):
        assert c == _hf_greedy(reference, p, 8), family


def test_unpatched_moe_model_runs_eagerly_on_the_cpu():
    """Without swiftune's patch the MoE block runs transformers' own experts (host syncs: refused for
    CUDA graphs, see the CUDA case); eagerly on the CPU the engine still gives generate's greedy tokens."""
    reference = tiny_moe("qwen3_moe", seed=9, eos_token_id=None)
    out = FastRolloutEngine(reference, pad_token_id=PAD, kv_bucket=4).generate(
        PROMPTS, 1, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=()))
    assert out.completion_ids == [_hf_greedy(reference, p, 6) for p in PROMPTS]


def test_grpo_default_engine_is_the_fast_engine_for_moe(tmp_path, monkeypatch):
    """GRPOConfig(rollout_engine="auto") picks FastRolloutEngine for Qwen3-MoE, Mixtral and gpt-oss
    (tests/test_gptoss_rollout.py) on CUDA (the device read from the config: patched to CUDA here on a
    CPU machine, nothing is run there); on the CPU transformers' engine."""
    from swiftune import GRPOConfig, GRPOTrainer
    from swiftune.data import build_tokenizer

    assert set(FAMILIES_ON_ENGINE + ["gpt_oss"]) <= set(SUPPORTED)
    tokenizer = build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, kernel_backend="reference", attention_backend="reference",
                      report_to="none", save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)
    assert args.rollout_engine == "auto"
    rows = [{"prompt": "Reverse: abc\n"}, {"prompt": "Hi\n"}]
    picked = {}
    for family in FAMILIES_ON_ENGINE + ["gpt_oss"]:
        trainer = GRPOTrainer(tiny_moe(family), [lambda completions, **kw: [0.0] * len(completions)], args=args,
                              train_dataset=rows, processing_class=tokenizer)
        on_this_device = FastRolloutEngine if args.device.type == "cuda" else TransformersRolloutEngine
        assert type(trainer.rollout_engine) is on_this_device, family
        with monkeypatch.context() as m:
            m.setattr(type(trainer.args), "device", property(lambda self: torch.device("cuda")))
            picked[family] = type(trainer._builtin_engine(PAD))
    assert picked == {"qwen3_moe": FastRolloutEngine, "mixtral": FastRolloutEngine, "gpt_oss": FastRolloutEngine}


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("family", FAMILIES_ON_ENGINE)
def test_cuda_graph_decode_equals_eager_bf16(family):
    """CUDA, bf16 (the grouped GEMM with device offsets on SM >= 80), compiled kernels: decode steps
    replayed from CUDA graphs give the eager steps' tokens and log-probs exactly, greedy and sampled,
    with and without LoRA on the experts; every capture succeeded (no host sync in the step)."""
    for lora in (None, "experts"):
        _, policy = _models(family, lora, seed=7, kernel_backend="auto")  # compiled Triton kernels on CUDA
        policy = policy.to(device="cuda", dtype=torch.bfloat16)
        runs = {}
        for graph in (False, True):
            kw = dict(pad_token_id=PAD, use_cuda_graph=graph, kv_bucket=8, check_every=5, seed=3, lora="runtime",
                      attention_backend="reference")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runs[graph] = [FastRolloutEngine(policy, **kw).generate(PROMPTS, 4, params) for params in
                               (SamplingParams(max_tokens=24, temperature=0, stop_token_ids=()),
                                SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=()))]
            # a failed capture (a host sync in the step) warns and runs that bucket eagerly
            assert not [w for w in caught if "CUDA-graph capture" in str(w.message)], (family, lora)
        for eager, graph in zip(runs[False], runs[True]):
            assert graph.stats["capture_s"] > 0
            assert graph.completion_ids == eager.completion_ids, (family, lora)
            assert torch.equal(torch.cat(graph.logprobs), torch.cat(eager.logprobs)), (family, lora)


@cuda
@pytest.mark.parametrize("family", FAMILIES_ON_ENGINE)
def test_cuda_graph_greedy_fp32_equals_generate(family):
    """CUDA, fp32 (the grouped GEMM does not take it: the engine's sync-free per-row fallback inside
    the graph): greedy tokens equal transformers' generate on the unpatched model; an unpatched MoE
    model is refused for CUDA graphs with the fix named."""
    reference, policy = _models(family, "experts", seed=8, kernel_backend="auto")
    reference, policy = reference.cuda(), policy.cuda()
    out = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=8, check_every=5, lora="runtime",
                            attention_backend="reference").generate(
        PROMPTS, 2, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=()))
    assert out.stats["capture_s"] > 0
    for i, p in enumerate(PROMPTS):
        assert out.completion_ids[2 * i] == _hf_greedy(reference, p, 20), (family, i)
    with pytest.raises(ValueError, match="patch_model"):
        FastRolloutEngine(reference).generate(PROMPTS, 1, SamplingParams(max_tokens=2, temperature=0))


def test_grpo_step_on_the_fast_engine_with_moe(tmp_path):
    """GRPOTrainer(rollout_engine="fast") on Qwen3-MoE with LoRA on attention and experts: the engine
    samples (eager on CPU), the policy step runs, the adapters move and the base weights do not."""
    from swiftune import GRPOConfig, GRPOTrainer
    from swiftune.data import build_tokenizer

    model = FastModel.get_peft_model(tiny_moe("qwen3_moe", seed=5), r=4, lora_alpha=8, init_lora_weights=False,
                                     use_gradient_checkpointing=False, **TARGETS["experts"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-2, rollout_engine="fast", kernel_backend="reference",
                      attention_backend="reference", report_to="none", save_strategy="no", disable_tqdm=True,
                      dataloader_pin_memory=False, seed=1)
    trainer = GRPOTrainer(model, [lambda completions, **kw: [float(len(c)) for c in completions]], args=args,
                          train_dataset=[{"prompt": "Reverse: abc\n"}, {"prompt": "Hi\n"}] * 2,
                          processing_class=build_tokenizer())
    assert isinstance(trainer.rollout_engine, FastRolloutEngine)
    trainer.train()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.cpu(), before[n].cpu())}
    assert moved and all("lora_" in n for n in moved)
    assert any("experts" in n for n in moved)  # the expert adapters trained from the engine's rollouts
