"""VisionFastRolloutEngine (the fast engine for Qwen3-VL image prompts, issue 28) against transformers.

The reference is the unpatched ``Qwen3VLForConditionalGeneration`` (PEFT's LoRA model for the
adapted cases) on each prompt alone: its own greedy ``generate`` (its own M-RoPE index,
``rope_deltas`` and cache) and, for sampled completions, its forward on ``prompt + completion``
(float64 log-softmax at the sampling temperature, the image token excluded as the engine samples).
Prompts with 0, 1 and 2 images and three lengths share one packed prefill; fp32 on CPU (the decode
step eager), the tiny model and processor of tests/test_qwen3_vl.py. The claim the decode step rests
on (M-RoPE with equal channels is plain RoPE) is tested on its own, against transformers' Qwen3
rotary embedding and a float64 formula.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swiftune
from swiftune.models.patching import causal_lm_of
from swiftune.rl.multimodal import VisionGRPO, VisionRolloutEngine
from swiftune.rl.rollout import SamplingParams
from swiftune.rl.rollout.vision_fast import VisionFastRolloutEngine

from tests.test_qwen3_vl import SEVEN, _model, _processor, _rel, transformers
from tests.test_qwen3_vl_grpo import FAST
from tests.test_vl_rollout_batched import G, _greedy, _reference_logps, _rows

peft = pytest.importorskip("peft")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
N_NEW = 8


@pytest.fixture(scope="module")
def setup():
    proc = _processor()
    base = _model(proc).eval()
    policy = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    vision = VisionGRPO(policy, proc)
    prompts = [vision.encode(row) for row in _rows()]
    assert [0 if p.image_grid_thw is None else p.image_grid_thw.shape[0] for p in prompts] == [0, 1, 2]
    greedy = [_greedy(base, vision, p, N_NEW) for p in prompts]
    return proc, base, policy, vision, prompts, greedy


def _rope_deltas(model, vision, prompt) -> int:
    """transformers' own ``rope_deltas`` of one prompt alone (its largest M-RoPE position + 1 - length)."""
    ids = torch.tensor([prompt.input_ids])
    _, delta = causal_lm_of(model).model.get_rope_index(ids, (ids == vision.image_token_id).int(),
                                                        image_grid_thw=prompt.image_grid_thw)
    return int(delta.reshape(-1)[0])


class VisionCalls:
    """Counts the multimodal model's forwards and the vision tower's calls."""

    def __init__(self, model):
        stack = causal_lm_of(model).model
        self.model_calls = self.tower_calls = 0
        self.handles = [stack.register_forward_pre_hook(lambda *a: self._count("model_calls")),
                        stack.visual.register_forward_pre_hook(lambda *a: self._count("tower_calls"))]

    def _count(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("head_dim, section, theta", [(16, [2, 3, 3], 1e4), (128, [24, 20, 20], 5e6)],
                         ids=["tiny", "qwen3-vl-8b"])
def test_equal_channel_mrope_is_plain_rope(head_dim, section, theta):
    """Qwen3-VL's interleaved M-RoPE tables at positions equal on the t/h/w channels (what a decoded
    text token gets) are plain RoPE at that position: bit for bit transformers' Qwen3 rotary
    embedding (same theta and head size), a float64 formula to fp32 rounding; and a channel that
    differs changes the tables."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": theta}
    heads = 4
    vl = Qwen3VLTextRotaryEmbedding(transformers.Qwen3VLTextConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
        rope_parameters={**rope, "mrope_section": section, "mrope_interleaved": True}))
    plain = Qwen3RotaryEmbedding(transformers.Qwen3Config(hidden_size=heads * head_dim, num_attention_heads=heads,
                                                          head_dim=head_dim, rope_parameters=rope))
    x = torch.zeros(1, dtype=torch.float32)
    pos = torch.tensor([[0, 1, 2, 7, 37, 300, 4095], [5, 6, 9, 11, 64, 1000, 2]])  # [B, S]
    cos3, sin3 = vl(x, pos[None].expand(3, -1, -1))
    cos_p, sin_p = plain(x, pos)
    assert cos3.shape == cos_p.shape == (2, 7, head_dim)
    assert torch.equal(cos3, cos_p) and torch.equal(sin3, sin_p)
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = pos[..., None].double() * inv
    angles = torch.cat([angles, angles], dim=-1)
    assert (cos3.double() - angles.cos()).abs().max() < 1e-3 * max(1.0, float(pos.max()) * 1e-3)
    small = pos < 64  # fp32 angles exact enough there for a tight bound
    assert (cos3.double() - angles.cos())[small].abs().max() < 1e-5
    assert (sin3.double() - angles.sin())[small].abs().max() < 1e-5
    # the claim is about equal channels: shift the height channel and the tables differ
    shifted = pos[None].expand(3, -1, -1).clone()
    shifted[1] += 3
    cos_h, _ = vl(x, shifted)
    assert not torch.equal(cos_h, cos_p)


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_greedy_equals_transformers_generate_per_prompt(setup, patched):
    """Three prompts (0, 1, 2 images) in one packed prefill (one vision-tower call), 2 x 3 rows decoded
    together: every row is transformers' greedy generate of its prompt alone; its log-probs the
    unpatched forward's (temperature 1); each row's delta is transformers' rope_deltas (non-zero for
    the image prompts); one prompt per chunk and an unshared prefill (each row's prompt prefilled)
    give the same; the text config's and the vision config's attention are restored."""
    proc, base, policy, vision, prompts, greedy = setup
    model = policy if patched else base
    attention = causal_lm_of(model).config.text_config._attn_implementation
    vision_attention = causal_lm_of(model).config.vision_config._attn_implementation
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, stop_token_ids=())
    runs = {}
    for max_batch, shared in ((None, True), (G, True), (None, False)):  # unshared: every row's prompt prefilled
        engine = VisionFastRolloutEngine(model, vision.rope_index, vision.image_token_id, max_batch_size=max_batch,
                                         kv_bucket=4, check_every=3, share_prompt_prefill=shared)
        calls = VisionCalls(model)
        try:
            runs[max_batch, shared] = vision.generate(engine, prompts, G, params)
        finally:
            calls.remove()
        assert calls.model_calls == {None: 1, G: 3}[max_batch]  # one multimodal forward per chunk: the prefill
        assert calls.tower_calls == {None: 1, G: 2}[max_batch]  # per chunk with images
        if max_batch is None:
            deltas = [_rope_deltas(base, vision, p) for p in prompts]
            assert deltas[0] == 0 and deltas[1] != 0 and deltas[2] != 0
            assert engine._ws.rope_delta.tolist() == [d for d in deltas for _ in range(G)]
            assert engine.stats["decode_steps"] == N_NEW
    out = runs[None, True]
    for k, prompt in enumerate(prompts):
        assert len(greedy[k]) == N_NEW
        assert out.completion_ids[G * k:G * k + G] == [greedy[k]] * G, k
        want = _reference_logps(base, vision, prompt, greedy[k], 1.0)
        for j in range(G):
            assert _rel(out.logprobs[G * k + j].double(), want) < 1e-5, (k, j)
    for other in (runs[G, True], runs[None, False]):
        assert other.completion_ids == out.completion_ids
        assert all(_rel(a, b) < 1e-5 for a, b in zip(other.logprobs, out.logprobs))
    assert causal_lm_of(model).config.text_config._attn_implementation == attention
    assert causal_lm_of(model).config.vision_config._attn_implementation == vision_attention


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the Triton kernels through the interpreter")
def test_triton_kernels_in_the_fused_decode_step(setup):
    """The patched policy with swiftune's Triton kernels (the interpreter on CPU): the fused decode
    step (q/k norms, the M-RoPE tables at the shifted positions and the cache writes in one kernel)
    gives transformers' greedy tokens (the one-image prompt: the interpreter is slow), with the attention
    over the cache split along it (``decode_attention="split"``, what ``"auto"`` takes on CUDA)."""
    import swiftune.rl.rollout.kv_cache as engine_cache
    from swiftune.kernels.decode_attention import split_decode_attention
    from swiftune.rl.rollout import layers

    proc, base, _, vision, prompts, greedy = setup
    policy = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="triton")
    engine = VisionFastRolloutEngine(policy, vision.rope_index, vision.image_token_id, decode_attention="split")
    steps, splits = [], []
    original = layers.decode_attention

    def counted(*args, **kwargs):
        steps.append(1)
        return original(*args, **kwargs)

    layers.decode_attention = counted
    engine_cache.split_decode_attention = lambda *a, **k: splits.append(1) or split_decode_attention(*a, **k)
    try:
        out = vision.generate(engine, prompts[1:2], 1, SamplingParams(max_tokens=3, temperature=0.0,
                                                                      stop_token_ids=()))
    finally:
        layers.decode_attention = original
        engine_cache.split_decode_attention = split_decode_attention
    layer_count = causal_lm_of(base).config.text_config.num_hidden_layers
    assert len(steps) == len(splits) == 2 * layer_count  # the fused loop ran, its attention split
    assert out.completion_ids == [greedy[1][:3]]


def test_sampled_logprobs_equal_the_unpatched_forward(setup):
    """Sampling (temperature 0.8, top-p 0.95, half the vocabulary as stop tokens, so rows end at
    different steps and leave the batch, their deltas moving with them): each sample's log-probs are
    the unpatched forward's; no image token is sampled; the same seed gives the same samples."""
    proc, base, policy, vision, prompts, _ = setup
    stop = tuple(range(0, 300, 2))
    params = SamplingParams(max_tokens=12, temperature=0.8, stop_token_ids=stop)
    kw = dict(kv_bucket=4, check_every=2)
    engines = [VisionFastRolloutEngine(policy, vision.rope_index, vision.image_token_id, seed=s, **kw) for s in (5, 5)]
    out, again = (vision.generate(e, prompts, 3, params) for e in engines)
    assert again.completion_ids == out.completion_ids
    assert all(torch.equal(a, b) for a, b in zip(again.logprobs, out.logprobs))
    assert engines[0].stats.get("compactions", 0) >= 1, engines[0].stats  # rows left the batch mid-decode
    assert len({len(c) for c in out.completion_ids}) > 1
    assert len({tuple(c) for c in out.completion_ids}) > len(prompts)  # rows of a group differ: sampled
    for i, completion in enumerate(out.completion_ids):
        assert completion and vision.image_token_id not in completion
        assert out.finished[i] == (completion[-1] in stop)
        want = _reference_logps(base, vision, prompts[i // 3], completion, 0.8)
        assert out.logprobs[i].shape == want.shape and _rel(out.logprobs[i].double(), want) < 1e-5, i


def test_image_token_is_never_sampled(setup):
    """With the image placeholder made the most likely next token after every prompt (its LM-head row
    along the prompts' last hidden states), the engine still never samples it (greedy: the unpatched
    model's best other token each step)."""
    proc, base, policy, vision, prompts, _ = setup
    boosted, reference = copy.deepcopy(policy), copy.deepcopy(base)

    def inputs(p):
        ids = torch.tensor([p.input_ids])
        kw = {} if p.pixel_values is None else dict(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        return dict(input_ids=ids, mm_token_type_ids=(ids == vision.image_token_id).int(), **kw)

    with torch.no_grad():
        last = [causal_lm_of(reference).model(**inputs(p)).last_hidden_state[0, -1] for p in prompts]
        direction = 10.0 * sum(h / h.norm() for h in last)
        for m in (boosted, reference):
            causal_lm_of(m).lm_head.weight[vision.image_token_id] = direction
        for p in prompts:  # the image token is now the unpatched model's argmax after every prompt
            assert int(reference(**inputs(p)).logits[0, -1].argmax()) == vision.image_token_id
    engine = VisionFastRolloutEngine(boosted, vision.rope_index, vision.image_token_id)
    out = vision.generate(engine, prompts, 1, SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=()))
    for k, p in enumerate(prompts):
        assert vision.image_token_id not in out.completion_ids[k]
        assert out.completion_ids[k] == _greedy(reference, vision, p, 4), k


@pytest.fixture(scope="module")
def lora_setup(setup):
    """PEFT's LoRA model on the text decoder's seven projections (random non-zero B), unpatched, and
    its own greedy generate of each prompt (6 tokens)."""
    _, base, _, vision, prompts, _ = setup
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    reference = peft.get_peft_model(copy.deepcopy(base), config).eval()
    return reference, [_greedy(reference, vision, p, 6) for p in prompts]


@pytest.mark.parametrize("lora", ["runtime", "merge"])
def test_lora_on_the_text_decoder(setup, lora_setup, lora):
    """PEFT LoRA on the text decoder's seven projections (random non-zero B): greedy tokens equal PEFT's
    own generate of the unpatched adapted model per prompt, log-probs its forward's, with the
    adapters run as PEFT layers or merged for the call (the base weights bit-identical afterwards);
    under disable_adapter the base model's greedy tokens."""
    proc, base, _, vision, prompts, greedy = setup
    reference, adapted = lora_setup
    policy = swiftune.patch_model(copy.deepcopy(reference), attention="reference", kernel_backend="reference")
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    engine = VisionFastRolloutEngine(policy, vision.rope_index, vision.image_token_id, lora=lora)
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())
    out = vision.generate(engine, prompts, G, params)
    assert adapted != [g[:6] for g in greedy]  # the adapters change the completions
    for k, prompt in enumerate(prompts):
        assert out.completion_ids[G * k:G * k + G] == [adapted[k]] * G, k
        want = _reference_logps(reference, vision, prompt, adapted[k], 1.0)
        assert _rel(out.logprobs[G * k].double(), want) < 1e-5, k
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
    with policy.disable_adapter():
        plain = vision.generate(engine, prompts, 1, params)
    assert plain.completion_ids == [g[:6] for g in greedy]


def test_grpo_trainer_takes_the_fast_engine(setup, tmp_path):
    """GRPOTrainer on image prompts: 'auto' on the CPU keeps VisionRolloutEngine, 'fast' is this engine
    (run eagerly here); one step with it scores every completion with its own row's columns, and at a
    near-zero temperature each completion is the greedy continuation of its row's prompt (PEFT's own
    generate of the LoRA policy)."""
    from swiftune import GRPOConfig, GRPOTrainer

    proc, base, _, vision, prompts, _ = setup
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    max_new = 4
    with torch.no_grad():
        greedy = {row["size"]: _greedy(model, vision, p, max_new) for row, p in zip(_rows(), prompts)}
    seen: list[tuple] = []

    def size_reward(prompts, completions, completion_ids, size, **kwargs):
        seen.extend(zip(completion_ids, size))
        return [float(s) / 400.0 + 0.1 * len(c) for s, c in zip(size, completion_ids)]

    common = dict(max_steps=1, per_device_train_batch_size=G * 3, num_generations=G, max_completion_length=max_new,
                  temperature=1e-4, learning_rate=1e-2, **FAST)
    auto = GRPOTrainer(copy.deepcopy(model), size_reward, args=GRPOConfig(output_dir=str(tmp_path / "a"), **common),
                       train_dataset=_rows(), processing_class=proc)
    assert type(auto.rollout_engine) is VisionRolloutEngine
    trainer = GRPOTrainer(model, size_reward, args=GRPOConfig(output_dir=str(tmp_path / "f"), rollout_engine="fast",
                                                               **common), train_dataset=_rows(), processing_class=proc)
    assert isinstance(trainer.rollout_engine, VisionFastRolloutEngine)
    trainer.train()
    assert sorted(s for _, s in seen) == sorted(r["size"] for r in _rows() for _ in range(G))
    for completion, size in seen:
        assert completion and completion == greedy[size][:len(completion)], (size, completion, greedy[size])


def test_refuses_what_it_cannot_run(setup):
    """A text model is not this engine's (it names the one to use); vision inputs must match the prompts;
    without any, prompts are text (plain positions): the text prompt's greedy tokens."""
    proc, base, policy, vision, prompts, greedy = setup
    text = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="VisionRolloutEngine"):
        VisionFastRolloutEngine(text, vision.rope_index, vision.image_token_id).generate([[1, 2]], 1, SamplingParams())
    engine = VisionFastRolloutEngine(policy, vision.rope_index, vision.image_token_id)
    with pytest.raises(ValueError, match="2 vision inputs for 3 prompts"):
        engine.generate([p.input_ids for p in prompts], 1, SamplingParams(), vision_inputs=prompts[:2])
    plain = engine.generate([prompts[0].input_ids], 1, SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=()))
    assert plain.completion_ids == [greedy[0][:4]]


@pytest.mark.gpu
@cuda
def test_cuda_graph_replay_equals_eager_and_transformers(setup, tmp_path):
    """CUDA, fp32 (TF32 off), compiled kernels: the decode step replayed as CUDA graphs gives the eager
    step's tokens and log-probs (greedy and sampled, rows leaving the batch); greedy rows equal
    transformers' generate of the unpatched CUDA model per prompt, sampled log-probs its forward's;
    GRPOTrainer's 'auto' on CUDA picks this engine."""
    from swiftune import GRPOConfig, GRPOTrainer

    proc, base, _, vision, prompts, _ = setup
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        reference = copy.deepcopy(base).cuda()
        policy = swiftune.patch_model(copy.deepcopy(base).cuda(), attention="reference", kernel_backend="auto")
        greedy = SamplingParams(max_tokens=N_NEW, temperature=0.0, stop_token_ids=())
        # no top-p: the engine's log-probs are the filtered distribution's, the reference's the temperature's alone
        sampled = SamplingParams(max_tokens=12, temperature=0.8, stop_token_ids=tuple(range(0, 300, 3)))
        runs = {}
        for graph in (False, True):
            kw = dict(use_cuda_graph=graph, kv_bucket=4, check_every=2, seed=3, attention_backend="reference")
            runs[graph] = [vision.generate(VisionFastRolloutEngine(policy, vision.rope_index, vision.image_token_id,
                                                                   **kw), prompts, n, p)
                           for n, p in ((G, greedy), (3, sampled))]
        (g_eager, s_eager), (g_graph, s_graph) = runs[False], runs[True]
        assert g_graph.stats["capture_s"] > 0 and s_graph.stats["capture_s"] > 0
        assert g_graph.completion_ids == g_eager.completion_ids
        assert s_graph.completion_ids == s_eager.completion_ids
        assert all(_rel(a, b) < 1e-6 for a, b in zip(s_graph.logprobs, s_eager.logprobs))
        for k, prompt in enumerate(prompts):
            assert g_graph.completion_ids[G * k:G * k + G] == [_greedy(reference, vision, prompt, N_NEW)] * G, k
        for i, completion in enumerate(s_graph.completion_ids):
            want = _reference_logps(reference, vision, prompts[i // 3], completion, 0.8)
            assert _rel(s_graph.logprobs[i].double(), want) < 1e-4, i
        args = GRPOConfig(output_dir=str(tmp_path / "g"), max_steps=1, per_device_train_batch_size=G * 3,
                          num_generations=G, max_completion_length=4, report_to="none", save_strategy="no")
        def zero_reward(prompts, completions, **kwargs):
            return [0.0] * len(completions)

        trainer = GRPOTrainer(policy, zero_reward, args=args, train_dataset=_rows(), processing_class=proc)
        assert isinstance(trainer.rollout_engine, VisionFastRolloutEngine)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
