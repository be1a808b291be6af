"""VisionRolloutEngine samples several image prompts per prefill (issue 28), against transformers.

The reference is the unpatched ``Qwen3VLForConditionalGeneration`` on each prompt alone: its own
greedy ``generate`` (its own M-RoPE index, ``rope_deltas`` and cache) and, for sampled completions,
its full forward on ``prompt + completion`` (float64 log-softmax at the sampling temperature). The
engine runs on the patched model (swiftune's packed attention drops the left padding) and on the
unpatched one (transformers' attention masks it); prompts with 0, 1 and 2 images and three
different lengths share one prefill. fp32 on CPU; the tiny model and processor are those of
tests/test_qwen3_vl.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swiftune
from swiftune.models.patching import causal_lm_of
from swiftune.rl.multimodal import VisionGRPO, VisionRolloutEngine
from swiftune.rl.rollout import SamplingParams

from tests.test_qwen3_vl import SEVEN, _image, _model, _processor, _rel
from tests.test_qwen3_vl_grpo import FAST

peft = pytest.importorskip("peft")

G = 2


def _rows() -> list[dict]:
    """Prompts with 0 (the longest), 1 and 2 images (TRL's ``images`` column), each with a metadata column."""
    return [
        {"prompt": [{"role": "user", "content": "a text prompt, longer than both image prompts: " + "abc " * 8}],
         "images": None, "size": 0},
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": _image(16, 24, 0)},
                                                 {"type": "text", "text": "what is it?"}]}],
         "images": None, "size": 16 * 24},
        {"prompt": [{"role": "user", "content": "two:"}], "images": [_image(24, 16, 1), _image(16, 16, 2)],
         "size": 24 * 16 + 16 * 16},
    ]


@pytest.fixture(scope="module")
def setup():
    proc = _processor()
    base = _model(proc).eval()
    policy = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    vision = VisionGRPO(policy, proc)
    prompts = [vision.encode(row) for row in _rows()]
    assert [0 if p.image_grid_thw is None else p.image_grid_thw.shape[0] for p in prompts] == [0, 1, 2]
    assert len({len(p.input_ids) for p in prompts}) == 3  # left padding differs per row
    return proc, base, policy, vision, prompts


def _greedy(model, vision, prompt, max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate of one prompt alone (the image token banned, as the engine does)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.input_ids], device=device)
    kwargs = dict(input_ids=ids, mm_token_type_ids=(ids == vision.image_token_id).int(), do_sample=False,
                  max_new_tokens=max_new_tokens, bad_words_ids=[[vision.image_token_id]])
    if prompt.pixel_values is not None:
        kwargs.update(pixel_values=prompt.pixel_values.to(device), image_grid_thw=prompt.image_grid_thw.to(device))
    return model.generate(**kwargs)[0, ids.shape[1]:].tolist()


def _reference_logps(model, vision, prompt, completion, temperature: float) -> torch.Tensor:
    """The unpatched model on ``prompt + completion`` alone: float64 log-probs of the completion's
    tokens at ``temperature`` (the image token excluded, as the engine samples)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.input_ids + completion], device=device)
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == vision.image_token_id).int()}
    if prompt.pixel_values is not None:
        inputs.update(pixel_values=prompt.pixel_values.to(device), image_grid_thw=prompt.image_grid_thw.to(device))
    with torch.no_grad():
        logits = model(**inputs).logits[0].double().cpu()
    p = len(prompt.input_ids)
    logits = logits[p - 1:p - 1 + len(completion)] / temperature
    logits[:, vision.image_token_id] = float("-inf")
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


class PrefillCounter:
    """Counts the model's prefill forwards (a prompt of more than one token against an empty cache)
    and the vision tower's calls."""

    def __init__(self, model):
        lm = causal_lm_of(model)
        self.prefills, self.rows, self.vision_calls = 0, [], 0
        self.handles = [lm.register_forward_pre_hook(self._model_call, with_kwargs=True),
                        lm.model.visual.register_forward_pre_hook(self._vision_call)]

    def _model_call(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if kwargs.get("use_cache") and ids is not None and ids.shape[1] > 1 and cache.get_seq_length() == 0:
            self.prefills += 1
            self.rows.append(ids.shape[0])

    def _vision_call(self, module, args):
        self.vision_calls += 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_batched_greedy_equals_transformers_generate_per_prompt(setup, patched):
    """All three prompts in one prefill (one vision-tower call), 2 x 3 rows decoded together: every
    row is transformers' greedy generate of its prompt alone, and (patched) the same tokens and
    log-probs as one prompt per prefill (max_batch_size = G) and as chunks of two prompts (2G)."""
    proc, base, policy, vision, prompts = setup
    model = policy if patched else base
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=())
    runs = {}
    for max_batch in (None, G, 2 * G) if patched else (None,):  # the unpatched model: batched only
        engine = VisionRolloutEngine(model, vision.rope_index, vision.image_token_id, max_batch_size=max_batch)
        counter = PrefillCounter(model)
        try:
            runs[max_batch] = vision.generate(engine, prompts, G, params)
        finally:
            counter.remove()
        chunk_rows = {None: [3], G: [1, 1, 1], 2 * G: [2, 1]}[max_batch]
        assert counter.rows == chunk_rows, counter.rows  # prefills: one per chunk, never one per prompt
        # the vision tower once per chunk with images (the text-only prompt alone has none)
        assert counter.vision_calls == {None: 1, G: 2, 2 * G: 2}[max_batch]
    batched = runs[None]
    assert len(batched.completion_ids) == G * len(prompts)
    for k, prompt in enumerate(prompts):
        want = _greedy(base, vision, prompt, 8)
        assert len(want) == 8
        for j in range(G):
            assert batched.completion_ids[G * k + j] == want, (k, j)
    for other in (runs[G], runs[2 * G]) if patched else ():
        assert other.completion_ids == batched.completion_ids
        for a, b in zip(other.logprobs, batched.logprobs):
            assert _rel(a, b) < 1e-5
    # greedy log-probs: the unpatched model's, of each token, at temperature 1
    for k, prompt in enumerate(prompts):
        want = _reference_logps(base, vision, prompt, batched.completion_ids[G * k], 1.0)
        assert _rel(batched.logprobs[G * k].double(), want) < 1e-5


def test_batched_greedy_without_cache_row_ops(setup, monkeypatch):
    """Older caches (no batch_repeat_interleave / batch_select_indices): every copy of every prompt is
    prefilled, each with its prompt's images and delta; still transformers' greedy tokens per prompt."""
    from swiftune.rl import rollout

    proc, base, policy, vision, prompts = setup
    monkeypatch.setattr(rollout, "cache_supports", lambda cache, method: False)
    engine = VisionRolloutEngine(policy, vision.rope_index, vision.image_token_id)
    counter = PrefillCounter(policy)
    try:
        out = vision.generate(engine, prompts, G, SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=()))
    finally:
        counter.remove()
    assert counter.rows == [G * len(prompts)]
    for k, prompt in enumerate(prompts):
        want = _greedy(base, vision, prompt, 5)
        assert out.completion_ids[G * k:G * k + G] == [want] * G, k


@pytest.mark.parametrize("engine_name", ["VisionRolloutEngine", "VisionFastRolloutEngine"])
def test_batched_greedy_on_vl_moe(setup, engine_name):
    """Qwen3-VL-MoE (a sparse layer: swiftune's grouped experts on the patched model, in their rollout
    variant on the fast engine): both vision engines' batched prefill and decode give transformers'
    greedy generate of the unpatched MoE per prompt, and its forward's log-probs."""
    from swiftune.rl.rollout.vision_fast import VisionFastRolloutEngine
    from tests.test_qwen3_vl import tiny_vl_moe, transformers

    engine_class = {"VisionRolloutEngine": VisionRolloutEngine, "VisionFastRolloutEngine": VisionFastRolloutEngine}

    if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
        pytest.skip("this transformers has no Qwen3-VL-MoE")
    proc, base, _, _, _ = setup
    moe = tiny_vl_moe(base, scale=0.3).eval()
    policy = swiftune.patch_model(copy.deepcopy(moe), attention="reference", kernel_backend="reference")
    vision = VisionGRPO(policy, proc)
    prompts = [vision.encode(row) for row in _rows()]
    engine = engine_class[engine_name](policy, vision.rope_index, vision.image_token_id)
    out = vision.generate(engine, prompts, G, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=()))
    for k, prompt in enumerate(prompts):
        want = _greedy(moe, vision, prompt, 6)
        assert out.completion_ids[G * k:G * k + G] == [want] * G, k
        assert _rel(out.logprobs[G * k].double(), _reference_logps(moe, vision, prompt, want, 1.0)) < 1e-5


def test_sampled_logprobs_equal_the_unpatched_forward_and_the_seed_reproduces_them(setup):
    """Sampling (temperature 0.8, stop token, rows leaving the batch): each sample's log-probs are the
    unpatched model's forward log-probs of its tokens; the same seed gives the same samples."""
    proc, base, policy, vision, prompts = setup
    stop = proc.tokenizer.eos_token_id
    params = SamplingParams(max_tokens=7, temperature=0.8, stop_token_ids=(stop,))
    gen = [vision.generate(VisionRolloutEngine(policy, vision.rope_index, vision.image_token_id, seed=seed),
                           prompts, 3, params) for seed in (5, 5, 6)]
    out = gen[0]
    assert gen[1].completion_ids == out.completion_ids
    assert all(torch.equal(a, b) for a, b in zip(gen[1].logprobs, out.logprobs))
    assert gen[2].completion_ids != out.completion_ids  # the seed matters
    assert len({tuple(c) for c in out.completion_ids}) > len(prompts)  # rows of a group differ: sampled
    for i, completion in enumerate(out.completion_ids):
        assert completion and vision.image_token_id not in completion
        assert out.finished[i] == (completion[-1] == stop)
        want = _reference_logps(base, vision, prompts[i // 3], completion, 0.8)
        assert out.logprobs[i].shape == want.shape and _rel(out.logprobs[i].double(), want) < 1e-5, i


def test_grpo_trainer_rewards_see_each_rows_columns_with_batched_rollouts(setup, tmp_path):
    """One GRPOTrainer step on the three image prompts (one prefill for all three): each completion
    is scored with its own row's columns; at a near-zero temperature every completion is the greedy
    continuation of the prompt the reward function sees with it (its row's prompt)."""
    from swiftune import GRPOConfig, GRPOTrainer

    proc, base, _, vision, prompts = setup
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    max_new = 4
    with torch.no_grad():
        greedy = {row["size"]: _greedy(model, vision, p, max_new) for row, p in zip(_rows(), prompts)}
    seen: list[tuple] = []

    def size_reward(prompts, completions, completion_ids, size, **kwargs):
        seen.extend(zip(prompts, completion_ids, size, kwargs["images"]))
        return [float(s) / 400.0 + 0.1 * len(c) for s, c in zip(size, completion_ids)]

    args = GRPOConfig(output_dir=str(tmp_path / "vl"), max_steps=1, per_device_train_batch_size=G * 3,
                      num_generations=G, max_completion_length=max_new, temperature=1e-4, learning_rate=1e-2,
                      **FAST)
    trainer = GRPOTrainer(model, size_reward, args=args, train_dataset=_rows(), processing_class=proc)
    assert isinstance(trainer.rollout_engine, VisionRolloutEngine)
    counter = PrefillCounter(trainer.model)
    try:
        trainer.train()
    finally:
        counter.remove()
    assert counter.prefills == 1 and counter.rows == [3]  # fewer prefills than prompts
    assert len(seen) == G * 3
    rows_by_size = {row["size"]: row for row in _rows()}
    for prompt, completion, size, images in seen:
        row = rows_by_size[size]
        assert prompt == row["prompt"]  # the row's own prompt with its own column
        assert (images is None) == (row["images"] is None)
        assert images is None or [im.tobytes() for im in images] == [im.tobytes() for im in row["images"]]
        assert completion == greedy[size][:len(completion)] and completion, (size, completion, greedy[size])
    assert sorted(s for _, _, s, _ in seen) == sorted(r["size"] for r in _rows() for _ in range(G))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_batched_rollouts_match_transformers(setup):
    """On CUDA, fp32 (TF32 off): the patched policy with compiled kernels and the automatic packed
    attention, three image prompts per prefill; greedy rows equal transformers' generate of the
    unpatched CUDA model per prompt, sampled log-probs its forward's (1e-4)."""
    proc, base, _, vision, prompts = setup
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        reference = copy.deepcopy(base).cuda()
        policy = swiftune.patch_model(copy.deepcopy(base).cuda(), attention="auto", kernel_backend="auto")
        engine = VisionRolloutEngine(policy, vision.rope_index, vision.image_token_id, seed=3)
        greedy = vision.generate(engine, prompts, G, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=()))
        sampled = vision.generate(engine, prompts, 3, SamplingParams(max_tokens=8, temperature=0.8))
        for k, prompt in enumerate(prompts):
            assert greedy.completion_ids[G * k:G * k + G] == [_greedy(reference, vision, prompt, 8)] * G, k
        for i, completion in enumerate(sampled.completion_ids):
            want = _reference_logps(reference, vision, prompts[i // 3], completion, 0.8)
            assert _rel(sampled.logprobs[i].double(), want) < 1e-4, i
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
